//! CUDA launcher of the multi-tensor Adam step (kernels in kernels/optim.cu): one launch
//! updates every parameter of a `FusedOp::AdamStep` that shares a dtype (normally all of
//! them). The host checks every operand first, so an error leaves all parameters untouched,
//! then uploads a table of (param, grad, exp_avg, exp_avg_sq, numel, first chunk) for the
//! kernel to walk. The upload waits for the stream (one synchronisation per step).

use cudarc::driver::{DeviceRepr, LaunchConfig, PushKernelArg};

use super::{CudaDevice, ptr};
use crate::backend::ops::AdamScalars;
use crate::backend::{FusedOp, Storage, View};
use crate::error::{Error, Result};
use crate::memory::Category;
use crate::tensor::{DType, Device};

const MODULE: &str = "optim";
const SRC: &str = concat!(
    include_str!("kernels/strided.cuh"),
    include_str!("kernels/optim.cu")
);
const OP: &str = "adam";
/// Threads per block (OPTIM_BLOCK in optim.cu).
const BLOCK: u32 = 256;
/// Elements per chunk (ADAM_CHUNK in optim.cu).
const CHUNK: usize = 4096;
/// Most blocks a launch asks for; further chunks are taken by a grid-stride loop.
const MAX_BLOCKS: usize = 65_535 * 32;

/// One tensor of the list (struct AdamEntry in optim.cu).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct AdamEntry {
    p: u64,
    g: u64,
    m: u64,
    v: u64,
    n: i64,
    first_chunk: i64,
}

/// The step's scalars (struct AdamHyper in optim.cu).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct AdamHyper {
    l2: f64,
    decay: f64,
    w1: f64,
    beta2: f64,
    w2: f64,
    bc2_sqrt: f64,
    neg_step: f64,
    eps: f64,
    has_l2: i32,
    pad: i32,
}

// SAFETY: a #[repr(C)] struct of eight f64 and two i32, laid out as its C++ twin (72 bytes,
// no implicit padding).
unsafe impl DeviceRepr for AdamHyper {}

impl AdamHyper {
    fn of(k: &AdamScalars) -> AdamHyper {
        AdamHyper {
            l2: k.l2,
            decay: k.decay,
            w1: k.w1,
            beta2: k.beta2,
            w2: k.w2,
            bc2_sqrt: k.bc2_sqrt,
            neg_step: k.neg_step_size,
            eps: k.eps,
            // PyTorch adds wd·p only when wd != 0 (0·inf would be NaN).
            has_l2: (k.l2 != 0.0) as i32,
            pad: 0,
        }
    }
}

/// The parameters of one dtype: one launch.
struct Group {
    dtype: DType,
    entries: Vec<AdamEntry>,
}

/// inputs [grad_i]; outputs [param_i, exp_avg_i, exp_avg_sq_i] for i in 0..n.
pub(crate) fn adam(
    d: &CudaDevice,
    op: &FusedOp,
    inputs: &[View],
    outputs: &[&Storage],
) -> Result<()> {
    let k = AdamScalars::of(op).ok_or_else(|| Error::invalid(OP, "not an Adam op"))?;
    if outputs.len() != 3 * inputs.len() {
        return Err(Error::invalid(
            OP,
            format!(
                "{} gradients need {} outputs (param, exp_avg, exp_avg_sq each), got {}",
                inputs.len(),
                3 * inputs.len(),
                outputs.len()
            ),
        ));
    }
    let mut groups: Vec<Group> = Vec::new();
    for (grad, trio) in inputs.iter().zip(outputs.chunks_exact(3)) {
        let (dtype, entry) = entry(grad, trio[0], trio[1], trio[2])?;
        let Some(entry) = entry else { continue };
        match groups.iter_mut().find(|g| g.dtype == dtype) {
            Some(g) => g.entries.push(entry),
            None => groups.push(Group {
                dtype,
                entries: vec![entry],
            }),
        }
    }
    let hyper = AdamHyper::of(&k);
    for g in &mut groups {
        launch(d, g, &hyper)?;
    }
    Ok(())
}

/// Checks one parameter's operands; its table entry (None when it is empty).
fn entry(grad: &View, p: &Storage, m: &Storage, v: &Storage) -> Result<(DType, Option<AdamEntry>)> {
    let dtype = p.dtype();
    if !matches!(dtype, DType::F32 | DType::F64 | DType::F16 | DType::BF16) {
        return Err(Error::UnsupportedDType {
            op: OP,
            dtype,
            hint: "parameters must be floating point",
        });
    }
    for s in [grad.storage, m, v] {
        if s.dtype() != dtype {
            return Err(Error::DType {
                op: OP,
                expected: dtype,
                got: s.dtype(),
            });
        }
    }
    let n = p.len();
    let l = grad.layout;
    if !l.is_contiguous() || l.numel() != n || l.offset() + n > grad.storage.len() {
        return Err(Error::invalid(
            OP,
            format!(
                "each gradient must be contiguous with its parameter's {n} elements, got shape {:?}",
                l.shape()
            ),
        ));
    }
    if m.len() != n || v.len() != n {
        return Err(Error::shape(
            OP,
            format!(
                "state of {} and {} elements for a parameter of {n}",
                m.len(),
                v.len()
            ),
        ));
    }
    let all = [grad.storage, p, m, v];
    for (i, a) in all.iter().enumerate() {
        if all[i + 1..].iter().any(|b| std::ptr::eq(*a, *b)) {
            return Err(Error::invalid(
                OP,
                "gradient, parameter and state buffers must be distinct storages",
            ));
        }
    }
    if n == 0 {
        return Ok((dtype, None));
    }
    let g = ptr(grad.storage)? + (l.offset() * dtype.size_in_bytes()) as u64;
    let entry = AdamEntry {
        p: ptr(p)?,
        g,
        m: ptr(m)?,
        v: ptr(v)?,
        n: n as i64,
        first_chunk: 0,
    };
    Ok((dtype, Some(entry)))
}

/// Numbers the chunks of the group's tensors; the total.
fn number_chunks(entries: &mut [AdamEntry]) -> usize {
    let mut total = 0usize;
    for e in entries {
        e.first_chunk = total as i64;
        total += (e.n as usize).div_ceil(CHUNK);
    }
    total
}

fn launch(d: &CudaDevice, group: &mut Group, hyper: &AdamHyper) -> Result<()> {
    let chunks = number_chunks(&mut group.entries);
    if chunks == 0 {
        return Ok(());
    }
    let count = i32::try_from(group.entries.len())
        .map_err(|_| Error::invalid(OP, "more than 2^31 parameters in one step"))?;
    let words: Vec<u64> = group
        .entries
        .iter()
        .flat_map(|e| [e.p, e.g, e.m, e.v, e.n as u64, e.first_chunk as u64])
        .collect();
    let table = crate::memory::allocator(Device::Cuda(d.ordinal()))?.malloc(
        words.len() * 8,
        Category::Temporary,
        "adam_table",
    )?;
    d.copy_to_device(table.addr(), bytemuck::cast_slice(&words))?;
    let name = format!("adam_multi_{}", suffix(group.dtype));
    let f = d.function(MODULE, SRC, &name)?;
    let (tab, chunks64) = (table.addr(), chunks as i64);
    let cfg = LaunchConfig {
        grid_dim: (chunks.min(MAX_BLOCKS) as u32, 1, 1),
        block_dim: (BLOCK, 1, 1),
        shared_mem_bytes: 0,
    };
    let mut b = d.stream().launch_builder(&f);
    b.arg(&tab).arg(&count).arg(&chunks64).arg(hyper);
    // SAFETY: adam_multi_*(const AdamEntry*, int, i64, AdamHyper) with the table just
    // uploaded (count entries, chunk numbers below `chunks`); every address in it is a live
    // block of the entry's dtype holding n elements (checked in `entry`). The table is freed
    // after the launch is queued: later users of the block are ordered after it on this
    // device's single stream.
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

    fn entry_of(n: i64) -> AdamEntry {
        AdamEntry {
            p: 0,
            g: 0,
            m: 0,
            v: 0,
            n,
            first_chunk: -1,
        }
    }

    #[test]
    fn chunks_are_numbered_across_tensors() {
        let mut e: Vec<AdamEntry> = [1, 4096, 4097, 10_000].into_iter().map(entry_of).collect();
        let total = number_chunks(&mut e);
        let firsts: Vec<i64> = e.iter().map(|e| e.first_chunk).collect();
        assert_eq!(firsts, vec![0, 1, 2, 4]);
        assert_eq!(total, 4 + 3);
    }

    #[test]
    fn table_layout_matches_the_kernel() {
        assert_eq!(std::mem::size_of::<AdamEntry>(), 48);
        assert_eq!(std::mem::size_of::<AdamHyper>(), 72);
    }
}
