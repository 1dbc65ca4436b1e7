//! The multi-process bootstrap without processes: `LaunchEnv` from torchrun-style variables
//! (and every way they can be wrong), the TCPStore client against our store server, and
//! ranks as threads meeting at a rendezvous — the NCCL id shared by 2 and 4 ranks, through
//! rank 0's store and through an agent-hosted one, a rank that never arrives named in the
//! timeout, and mismatched world sizes named with both numbers. Ports are picked free.

use std::net::TcpListener;
use std::time::{Duration, Instant};

use ferrograd::dist::{
    LaunchEnv, NCCL_UNIQUE_ID_BYTES, Rendezvous, StoreClient, StoreServer, share_unique_id,
};

const LOCAL: &str = "127.0.0.1";
const T: Duration = Duration::from_secs(20);

fn free_port() -> u16 {
    let l = TcpListener::bind((LOCAL, 0)).expect("a free port");
    l.local_addr().expect("its address").port()
}

fn rank_env(rank: usize, world: usize, port: u16, agent: bool) -> LaunchEnv {
    LaunchEnv {
        rank,
        local_rank: rank,
        world_size: world,
        local_world_size: world,
        master_addr: LOCAL.into(),
        master_port: port,
        use_agent_store: agent,
        restart_count: 0,
    }
}

fn id_of(seed: u8) -> [u8; NCCL_UNIQUE_ID_BYTES] {
    std::array::from_fn(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
}

/// Every rank of a `world`-rank run as a thread calling `share_unique_id`.
fn share_on_threads(world: usize, port: u16, agent: bool) -> Vec<[u8; NCCL_UNIQUE_ID_BYTES]> {
    let id = id_of(7);
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..world)
            .map(|r| {
                s.spawn(move || {
                    let mine = (r == 0).then_some(&id);
                    share_unique_id(&rank_env(r, world, port, agent), mine, T)
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("no panic").expect("the id is shared"))
            .collect()
    })
}

fn err_of<T>(r: ferrograd::Result<T>) -> String {
    match r {
        Ok(_) => panic!("expected an error"),
        Err(e) => e.to_string(),
    }
}

fn env_from(pairs: &[(&str, &str)]) -> ferrograd::Result<Option<LaunchEnv>> {
    LaunchEnv::from_pairs(pairs)
}

const FULL: &[(&str, &str)] = &[
    ("RANK", "1"),
    ("LOCAL_RANK", "1"),
    ("WORLD_SIZE", "4"),
    ("LOCAL_WORLD_SIZE", "2"),
    ("MASTER_ADDR", "10.0.0.1"),
    ("MASTER_PORT", "29500"),
];

fn with(changes: &[(&'static str, &'static str)]) -> Vec<(&'static str, &'static str)> {
    let mut v: Vec<_> = FULL.to_vec();
    for (k, val) in changes {
        v.retain(|(name, _)| name != k);
        v.push((k, val));
    }
    v
}

fn env_error(changes: &[(&'static str, &'static str)]) -> String {
    err_of(env_from(&with(changes)))
}

#[test]
fn launch_env_absent_is_a_single_process() {
    assert_eq!(env_from(&[]).unwrap(), None);
    assert_eq!(env_from(&[("UNRELATED", "1")]).unwrap(), None);
}

#[test]
fn launch_env_reads_the_torchrun_variables() {
    let env = env_from(&with(&[("TORCHELASTIC_USE_AGENT_STORE", "True")]))
        .unwrap()
        .expect("a rank");
    assert_eq!((env.rank, env.local_rank), (1, 1));
    assert_eq!((env.world_size, env.local_world_size), (4, 2));
    assert_eq!(env.endpoint(), "10.0.0.1:29500");
    assert!(env.use_agent_store);
    let plain = env_from(FULL).unwrap().expect("a rank");
    assert!(!plain.use_agent_store);
    assert_eq!(
        LaunchEnv::from_pairs(&as_pairs(&plain.to_vars())).unwrap(),
        Some(plain)
    );
}

fn as_pairs<'a>(vars: &'a [(&'static str, String)]) -> Vec<(&'static str, &'a str)> {
    vars.iter().map(|(k, v)| (*k, v.as_str())).collect()
}

#[test]
fn launch_env_names_the_missing_variables() {
    let e = err_of(env_from(&[("RANK", "0"), ("MASTER_PORT", "29500")]));
    assert!(e.contains("RANK, MASTER_PORT are set"), "{e}");
    assert!(
        e.contains("LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR not"),
        "{e}"
    );
}

#[test]
fn launch_env_refuses_values_that_are_not_numbers() {
    assert!(env_error(&[("RANK", "one")]).contains("RANK=\"one\" is not"));
    assert!(env_error(&[("WORLD_SIZE", "-2")]).contains("WORLD_SIZE=\"-2\""));
    assert!(env_error(&[("MASTER_PORT", "70000")]).contains("not a port number"));
    assert!(env_error(&[("MASTER_PORT", "0")]).contains("fixed port"));
    let e = env_error(&[("TORCHELASTIC_USE_AGENT_STORE", "maybe")]);
    assert!(e.contains("neither True nor False"), "{e}");
}

#[test]
fn launch_env_refuses_ranks_outside_the_world() {
    let e = env_error(&[("RANK", "4")]);
    assert!(e.contains("RANK=4 is not below WORLD_SIZE=4"), "{e}");
    let e = env_error(&[("LOCAL_RANK", "2")]);
    assert!(
        e.contains("LOCAL_RANK=2 is not below LOCAL_WORLD_SIZE=2"),
        "{e}"
    );
    let e = env_error(&[("LOCAL_WORLD_SIZE", "8")]);
    assert!(
        e.contains("LOCAL_WORLD_SIZE=8 must be between 1 and WORLD_SIZE=4"),
        "{e}"
    );
    assert!(env_error(&[("WORLD_SIZE", "0")]).contains("at least one rank"));
}

#[test]
fn store_client_sets_gets_adds_and_checks() {
    let server = StoreServer::bind(LOCAL, 0).unwrap();
    let mut a = StoreClient::connect(LOCAL, server.port(), T).unwrap();
    let mut b = StoreClient::connect(LOCAL, server.port(), T).unwrap();
    assert!(!a.check(&["k"]).unwrap());
    a.set("k", b"value").unwrap();
    // SET has no answer: a's next command is what orders it before b's.
    assert!(a.check(&["k"]).unwrap());
    assert!(b.check(&["k"]).unwrap());
    assert_eq!(b.get("k", T).unwrap(), b"value");
    assert_eq!(a.add("n", 2).unwrap(), 2);
    assert_eq!(b.add("n", 3).unwrap(), 5);
    assert_eq!(
        a.get("n", T).unwrap(),
        b"5",
        "counters are decimal text, as in PyTorch"
    );
}

#[test]
fn store_get_waits_for_a_later_set() {
    let server = StoreServer::bind(LOCAL, 0).unwrap();
    let port = server.port();
    let setter = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(200));
        let mut c = StoreClient::connect(LOCAL, port, T).unwrap();
        c.set("late", &[1, 2, 3]).unwrap();
    });
    let mut c = StoreClient::connect(LOCAL, port, T).unwrap();
    assert_eq!(c.get("late", T).unwrap(), [1, 2, 3]);
    setter.join().unwrap();
}

#[test]
fn store_wait_times_out_and_says_so() {
    let server = StoreServer::bind(LOCAL, 0).unwrap();
    let mut c = StoreClient::connect(LOCAL, server.port(), T).unwrap();
    let e = err_of(c.get("never", Duration::from_millis(300)));
    assert!(e.contains("did not answer within 0.3s"), "{e}");
    assert!(err_of(c.check(&["x"])).contains("abandoned"));
}

#[test]
fn two_ranks_share_a_128_byte_id() {
    let ids = share_on_threads(2, free_port(), false);
    assert!(ids.iter().all(|id| *id == id_of(7)));
}

#[test]
fn four_ranks_share_a_128_byte_id() {
    let ids = share_on_threads(4, free_port(), false);
    assert_eq!(ids.len(), 4);
    assert!(ids.iter().all(|id| *id == id_of(7)));
}

#[test]
fn ranks_share_the_id_through_an_agent_hosted_store_more_than_once() {
    // torchrun's agent hosts the store: no rank binds the port, and every rank is a client.
    let agent = StoreServer::bind(LOCAL, 0).unwrap();
    for _ in 0..2 {
        let ids = share_on_threads(3, agent.port(), true);
        assert!(ids.iter().all(|id| *id == id_of(7)));
    }
}

#[test]
fn rank_zero_can_host_its_store_again_on_the_same_port() {
    let port = free_port();
    for _ in 0..2 {
        let ids = share_on_threads(2, port, false);
        assert!(ids.iter().all(|id| *id == id_of(7)));
    }
}

#[test]
fn a_rank_that_never_joins_is_named() {
    let port = free_port();
    let start = Instant::now();
    let e = err_of(Rendezvous::join(
        &rank_env(0, 3, port, false),
        Duration::from_secs(2),
    ));
    let want = format!("ranks 1, 2 of 3 did not join the rendezvous at 127.0.0.1:{port} within 2s");
    assert!(e.contains(&want), "{e}");
    assert!(e.contains("same MASTER_ADDR/MASTER_PORT"), "{e}");
    assert!(start.elapsed() < Duration::from_secs(10));
}

#[test]
fn a_missing_rank_zero_is_named_by_the_others() {
    let port = free_port();
    let e = err_of(Rendezvous::join(
        &rank_env(1, 2, port, false),
        Duration::from_secs(1),
    ));
    assert!(e.contains("rank 0 of 2 did not join the rendezvous"), "{e}");
    assert!(e.contains(&format!("127.0.0.1:{port}")), "{e}");
}

#[test]
fn mismatched_world_sizes_are_named_with_both_numbers() {
    let port = free_port();
    let errors: Vec<String> = std::thread::scope(|s| {
        let a = s.spawn(|| err_of(Rendezvous::join(&rank_env(0, 2, port, false), T)));
        let b = s.spawn(|| {
            let mut env = rank_env(1, 3, port, false);
            env.local_world_size = 3;
            err_of(Rendezvous::join(&env, T))
        });
        vec![a.join().unwrap(), b.join().unwrap()]
    });
    for e in errors {
        assert!(
            e.contains("WORLD_SIZE=2") && e.contains("WORLD_SIZE=3"),
            "{e}"
        );
        assert!(
            e.contains("start every rank with the same WORLD_SIZE"),
            "{e}"
        );
    }
}

#[test]
fn a_rank_that_skips_a_barrier_is_named() {
    let port = free_port();
    let short = Duration::from_secs(1);
    let e = std::thread::scope(|s| {
        let other = s.spawn(move || {
            let rdv = Rendezvous::join(&rank_env(1, 2, port, false), T).unwrap();
            std::thread::sleep(Duration::from_secs(3));
            drop(rdv);
        });
        let mut rdv = Rendezvous::join(&rank_env(0, 2, port, false), short).unwrap();
        let e = err_of(rdv.barrier("after init"));
        drop(rdv);
        other.join().unwrap();
        e
    });
    assert!(
        e.contains("rank 1 of 2 did not reach barrier \"after init\""),
        "{e}"
    );
}

#[test]
fn broadcast_and_barrier_in_order() {
    let port = free_port();
    let got: Vec<Vec<Vec<u8>>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..3)
            .map(|r| {
                s.spawn(move || {
                    let mut rdv = Rendezvous::join(&rank_env(r, 3, port, false), T).unwrap();
                    let mut got = Vec::new();
                    for msg in [&b"first"[..], b"second"] {
                        got.push(rdv.broadcast_bytes("m", (r == 0).then_some(msg)).unwrap());
                        rdv.barrier("between").unwrap();
                    }
                    rdv.close().unwrap();
                    got
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for g in got {
        assert_eq!(g, vec![b"first".to_vec(), b"second".to_vec()]);
    }
}

#[test]
fn only_rank_zero_brings_bytes_to_a_broadcast() {
    let port = free_port();
    let mut rdv = Rendezvous::join(&rank_env(0, 1, port, false), T).unwrap();
    assert!(err_of(rdv.broadcast_bytes("k", None)).contains("must pass Some"));
}

#[test]
fn two_processes_with_the_same_rank_are_refused() {
    let port = free_port();
    // Nobody closes before all three have joined or been refused: rank 0's store must still
    // be there when the second rank 1 arrives, however late its thread starts.
    let all_tried = std::sync::Barrier::new(3);
    let results: Vec<Result<(), String>> = std::thread::scope(|s| {
        let handles: Vec<_> = [0, 1, 1]
            .into_iter()
            .map(|r| {
                let all_tried = &all_tried;
                s.spawn(move || {
                    let joined = Rendezvous::join(&rank_env(r, 2, port, false), T);
                    all_tried.wait();
                    joined
                        .map_err(|e| e.to_string())?
                        .close()
                        .map_err(|e| e.to_string())
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let errors: Vec<&String> = results.iter().filter_map(|r| r.as_ref().err()).collect();
    assert_eq!(errors.len(), 1, "{results:?}");
    assert!(
        errors[0].contains("as rank 1 (RANK=1 twice)"),
        "{}",
        errors[0]
    );
}
