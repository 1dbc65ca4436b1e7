//! Shares a 128-byte id made by rank 0 with every rank of a multi-process run, the way the
//! NCCL group shares its unique id, and prints a checksum per rank (all equal when it works):
//!
//! ```text
//! ferrograd launch --nproc-per-node 2 -- target/debug/examples/share_nccl_id
//! torchrun --no-python --nproc-per-node 2 target/debug/examples/share_nccl_id
//! ```
//!
//! Under torchrun the ranks meet at the TCPStore its agent hosts; under `ferrograd launch`
//! rank 0 hosts the store.

use std::process::ExitCode;
use std::time::{SystemTime, UNIX_EPOCH};

use ferrograd::dist::{LaunchEnv, NCCL_UNIQUE_ID_BYTES, RENDEZVOUS_TIMEOUT, share_unique_id};

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run() -> Result<(), Box<dyn std::error::Error>> {
    let Some(env) = LaunchEnv::from_env()? else {
        return Err("no RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT: start this under torchrun or `ferrograd launch`".into());
    };
    // A different id every run, so an old value left in a store cannot pass for a new one.
    let id = (env.rank == 0).then(fresh_id);
    let got = share_unique_id(&env, id.as_ref(), RENDEZVOUS_TIMEOUT)?;
    println!(
        "rank {} of {}: id checksum {:016x} (store at {}, {})",
        env.rank,
        env.world_size,
        checksum(&got),
        env.endpoint(),
        if env.use_agent_store {
            "torchrun's agent"
        } else {
            "hosted by rank 0"
        }
    );
    Ok(())
}

fn fresh_id() -> [u8; NCCL_UNIQUE_ID_BYTES] {
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    let mut x = nanos ^ u64::from(std::process::id());
    std::array::from_fn(|_| {
        // xorshift: enough to make the bytes differ from run to run.
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x as u8
    })
}

/// FNV-1a over the id's bytes.
fn checksum(id: &[u8]) -> u64 {
    id.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}
