//! CUDA launcher of the multi-tensor Adam step (kernels in kernels/optim.cu): one launch
//! updates every parameter of a `FusedOp::AdamStep` that shares a dtype (normally all of
//! them). The host checks every operand first, so an error leaves all parameters untouched,
//! then uploads a table of (param, grad, exp_avg, exp_avg_sq, numel, first chunk) for the
//! kernel to walk. The upload waits for the stream (one synchronisation per step).

use cudarc::driver::{DeviceRepr, PushKernelArg};

use super::multi_tensor::{Groups, Row, Table, suffix};
use super::{CudaDevice, ptr};
use crate::backend::ops::AdamScalars;
use crate::backend::{FusedOp, Storage, View};
use crate::base::DType;
use crate::base::{Error, Result};

const MODULE: &str = "optim";
const SRC: &str = concat!(
    include_str!("kernels/strided.cuh"),
    include_str!("kernels/optim.cu")
);
const OP: &str = "adam";
/// One parameter's addresses, in the order of struct AdamEntry in optim.cu.
type AdamRow = Row<4>;

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
    let mut groups = Groups::new();
    for (grad, trio) in inputs.iter().zip(outputs.chunks_exact(3)) {
        let (dtype, row) = entry(grad, trio[0], trio[1], trio[2])?;
        groups.push(dtype, row);
    }
    let hyper = AdamHyper::of(&k);
    for (dtype, rows) in groups.iter() {
        launch(d, *dtype, rows, &hyper)?;
    }
    Ok(())
}

/// Checks one parameter's operands; its table row.
fn entry(grad: &View, p: &Storage, m: &Storage, v: &Storage) -> Result<(DType, AdamRow)> {
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
        return Ok((dtype, Row { addrs: [0; 4], n }));
    }
    let g = ptr(grad.storage)? + (l.offset() * dtype.size_in_bytes()) as u64;
    let addrs = [ptr(p)?, g, ptr(m)?, ptr(v)?];
    Ok((dtype, Row { addrs, n }))
}

fn launch(d: &CudaDevice, dtype: DType, rows: &[AdamRow], hyper: &AdamHyper) -> Result<()> {
    let Some(table) = Table::upload(d, rows, "adam_table")? else {
        return Ok(());
    };
    let name = format!("adam_multi_{}", suffix(dtype));
    let f = d.function(MODULE, SRC, &name)?;
    let mut b = d.stream().launch_builder(&f);
    b.arg(&table.addr)
        .arg(&table.count)
        .arg(&table.chunks)
        .arg(hyper);
    // SAFETY: adam_multi_*(const AdamEntry*, int, i64, AdamHyper) with the table just
    // uploaded (count rows, chunk numbers below `chunks`); every address in it is a live
    // block of the row's dtype holding n elements (checked in `entry`). The table's block is
    // freed after the launch is queued: later users of it are ordered after the launch on
    // this device's single stream.
    unsafe { b.launch(table.config()) }.map_err(|e| d.err(&format!("launching {name}"), e))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hyper_layout_matches_the_kernel() {
        assert_eq!(std::mem::size_of::<AdamHyper>(), 72);
    }
}
