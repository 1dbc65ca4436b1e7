//! CUDA launcher of the mixed-precision gradient unscale (`FusedOp::UnscaleCheck`, kernels in
//! kernels/amp.cu): one launch per dtype unscales every gradient of that dtype in place and
//! raises the shared found_inf flag on any inf or NaN. The host checks every operand first, so
//! an error leaves all gradients untouched, then uploads a table of (grad, numel, first chunk)
//! for the kernel to walk, as the Adam launch (optim.rs) does. The upload waits for the stream;
//! the flag stays on the device for the caller to read once.

use cudarc::driver::{LaunchConfig, PushKernelArg};

use super::{CudaDevice, ptr};
use crate::backend::cpu::check_unscale_operands;
use crate::backend::{Storage, View};
use crate::error::{Error, Result};
use crate::memory::Category;
use crate::tensor::{DType, Device};

const MODULE: &str = "amp";
const SRC: &str = concat!(
    include_str!("kernels/strided.cuh"),
    include_str!("kernels/amp.cu")
);
const OP: &str = "unscale_check";
/// Threads per block (AMP_BLOCK in amp.cu).
const BLOCK: u32 = 256;
/// Elements per chunk (AMP_CHUNK in amp.cu).
const CHUNK: usize = 4096;
/// Most blocks a launch asks for; further chunks are taken by a grid-stride loop.
const MAX_BLOCKS: usize = 65_535 * 32;

/// One gradient of the list (struct UnscaleEntry in amp.cu).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct UnscaleEntry {
    g: u64,
    n: i64,
    first_chunk: i64,
}

/// The gradients of one dtype: one launch.
struct Group {
    dtype: DType,
    entries: Vec<UnscaleEntry>,
}

/// inputs []; outputs [found_inf (1) F32, grad_0, .., grad_{n-1}].
pub(crate) fn unscale_check(
    d: &CudaDevice,
    inv_scale: f32,
    inputs: &[View],
    outputs: &[&Storage],
) -> Result<()> {
    if !inputs.is_empty() {
        return Err(Error::invalid(
            OP,
            "takes no inputs: the gradients are outputs, updated in place",
        ));
    }
    let (flag, grads) = outputs
        .split_first()
        .ok_or_else(|| Error::invalid(OP, "expects the found_inf flag as the first output"))?;
    check_unscale_operands(flag, grads)?;
    let mut groups: Vec<Group> = Vec::new();
    for g in grads {
        if g.is_empty() {
            continue;
        }
        let entry = UnscaleEntry {
            g: ptr(g)?,
            n: g.len() as i64,
            first_chunk: 0,
        };
        match groups.iter_mut().find(|gr| gr.dtype == g.dtype()) {
            Some(gr) => gr.entries.push(entry),
            None => groups.push(Group {
                dtype: g.dtype(),
                entries: vec![entry],
            }),
        }
    }
    let found_inf = ptr(flag)?;
    for g in &mut groups {
        launch(d, g, inv_scale, found_inf)?;
    }
    Ok(())
}

/// Numbers the chunks of the group's gradients; the total.
fn number_chunks(entries: &mut [UnscaleEntry]) -> usize {
    let mut total = 0usize;
    for e in entries {
        e.first_chunk = total as i64;
        total += (e.n as usize).div_ceil(CHUNK);
    }
    total
}

fn launch(d: &CudaDevice, group: &mut Group, inv_scale: f32, found_inf: u64) -> Result<()> {
    let chunks = number_chunks(&mut group.entries);
    if chunks == 0 {
        return Ok(());
    }
    let count = i32::try_from(group.entries.len())
        .map_err(|_| Error::invalid(OP, "more than 2^31 gradients in one call"))?;
    let words: Vec<u64> = group
        .entries
        .iter()
        .flat_map(|e| [e.g, e.n as u64, e.first_chunk as u64])
        .collect();
    let table = crate::memory::allocator(Device::Cuda(d.ordinal()))?.malloc(
        words.len() * 8,
        Category::Temporary,
        "unscale_table",
    )?;
    d.copy_to_device(table.addr(), bytemuck::cast_slice(&words))?;
    let name = format!("unscale_check_{}", suffix(group.dtype));
    let f = d.function(MODULE, SRC, &name)?;
    let (tab, chunks64) = (table.addr(), chunks as i64);
    let cfg = LaunchConfig {
        grid_dim: (chunks.min(MAX_BLOCKS) as u32, 1, 1),
        block_dim: (BLOCK, 1, 1),
        shared_mem_bytes: 0,
    };
    let mut b = d.stream().launch_builder(&f);
    b.arg(&tab)
        .arg(&count)
        .arg(&chunks64)
        .arg(&inv_scale)
        .arg(&found_inf);
    // SAFETY: unscale_check_*(const UnscaleEntry*, int, i64, float, float*) with the table
    // just uploaded (count entries, chunk numbers below `chunks`); every address in it is a
    // live block of the entry's dtype holding n elements, and found_inf is a live one-element
    // f32 block (checked in `check_unscale_operands`). The table is freed after the launch is
    // queued: later users of the block are ordered after it on this device's single stream.
    unsafe { b.launch(cfg) }.map_err(|e| d.err(&format!("launching {name}"), e))?;
    Ok(())
}

fn suffix(dtype: DType) -> &'static str {
    match dtype {
        DType::F64 => "f64",
        DType::F16 => "f16",
        DType::BF16 => "bf16",
        _ => "f32",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry_of(n: i64) -> UnscaleEntry {
        UnscaleEntry {
            g: 0,
            n,
            first_chunk: -1,
        }
    }

    #[test]
    fn chunks_are_numbered_across_gradients() {
        let mut e: Vec<UnscaleEntry> = [1, 4096, 4097, 10_000].into_iter().map(entry_of).collect();
        let total = number_chunks(&mut e);
        let firsts: Vec<i64> = e.iter().map(|e| e.first_chunk).collect();
        assert_eq!(firsts, vec![0, 1, 2, 4]);
        assert_eq!(total, 4 + 3);
    }

    #[test]
    fn table_layout_matches_the_kernel() {
        assert_eq!(std::mem::size_of::<UnscaleEntry>(), 24);
    }
}
