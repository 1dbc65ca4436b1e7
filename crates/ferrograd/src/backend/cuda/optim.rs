//! CUDA launchers of the optimizer family (backend/optim.rs; kernels in kernels/optim.cu):
//! the SGD step (one elementwise launch), the multi-tensor Adam step and the mixed-precision
//! unscale (one launch per dtype over a table of tensors, multi_tensor.rs), and the
//! one-thread updates of Adam's device step count and of a GradScaler's scale. Arguments arrive
//! validated, so an error leaves every parameter untouched; a table's upload is queued in
//! stream order, without waiting for the device. Versions are bumped by the entry functions.

use cudarc::driver::LaunchConfig;

use super::launch::{Arg, Module, addr, i64_of, launch, suffix};
use super::multi_tensor::{Groups, Row, Table};
use super::{CudaDevice, ptr};
use crate::backend::Storage;
use crate::backend::optim::{
    AdamParam, AdamScalars, AdamStep, CountStep, OptimKernels, SgdStep, UnscaleCheck, UpdateScale,
};
use crate::base::DType;
use crate::base::Result;

pub(super) static KERNELS: Module = Module::new("optim", include_str!("kernels/optim.cu"));
/// One parameter's addresses, in the order of struct AdamEntry in optim.cu.
type AdamRow = Row<4>;

impl OptimKernels for CudaDevice {
    fn sgd_step(&self, a: &SgdStep) -> Result<()> {
        sgd(self, a)
    }
    fn adam_step(&self, a: &AdamStep) -> Result<()> {
        adam(self, a)
    }
    fn unscale_check(&self, a: &UnscaleCheck) -> Result<()> {
        unscale_check(self, a)
    }
    fn stage_adam_scalars(&self, a: &AdamStep, slot: &Storage) -> Result<()> {
        stage(self, a, slot)
    }
    fn count_step(&self, a: &CountStep) -> Result<()> {
        let skip = a.skip_if.as_ref().map(addr).transpose()?.unwrap_or(0);
        let args = [Arg::Ptr(ptr(a.count)?), Arg::Ptr(skip)];
        launch(self, &KERNELS, "adam_count_step", one_thread(), &args)
    }
    fn update_scale(&self, a: &UpdateScale) -> Result<()> {
        let report = a.report.map(ptr).transpose()?.unwrap_or(0);
        let args = [
            Arg::Ptr(ptr(a.state)?),
            Arg::Ptr(addr(&a.found_inf)?),
            Arg::Ptr(report),
            Arg::F64(a.growth_factor),
            Arg::F64(a.backoff_factor),
            Arg::F64(a.growth_interval as f64),
        ];
        launch(self, &KERNELS, "amp_update_scale", one_thread(), &args)
    }
}

/// One block of one thread: the scalar updates.
fn one_thread() -> LaunchConfig {
    LaunchConfig {
        grid_dim: (1, 1, 1),
        block_dim: (1, 1, 1),
        shared_mem_bytes: 0,
    }
}

// ---- SGD ----------------------------------------------------------------------------------------

/// One SGD step in place (the addresses of the momentum buffer, the staged rate, the skip
/// flag and the step count are 0 when absent).
fn sgd(d: &CudaDevice, a: &SgdStep) -> Result<()> {
    let s = suffix("sgd", a.param.dtype())?;
    let n = a.param.len();
    let (g, p) = (addr(&a.grad)?, ptr(a.param)?);
    let buf = a.momentum_buf.map(ptr).transpose()?.unwrap_or(0);
    let lr_at = a.lr_at.as_ref().map(addr).transpose()?.unwrap_or(0);
    let skip = a.skip_if.as_ref().map(addr).transpose()?.unwrap_or(0);
    let count = a.count_at.as_ref().map(addr).transpose()?.unwrap_or(0);
    let h = [a.lr, a.weight_decay, a.momentum, 1.0 - a.dampening];
    let (nesterov, first) = (a.nesterov, a.first_step);
    if n == 0 {
        return Ok(());
    }
    let args = [
        Arg::Ptr(g),
        Arg::Ptr(p),
        Arg::Ptr(buf),
        i64_of(n),
        Arg::F64(h[0]),
        Arg::F64(h[1]),
        Arg::F64(h[2]),
        Arg::F64(h[3]),
        Arg::I32(nesterov as i32),
        Arg::I32(first as i32),
        Arg::Ptr(lr_at),
        Arg::Ptr(skip),
        Arg::Ptr(count),
    ];
    launch(
        d,
        &KERNELS,
        &format!("sgd_step_{s}"),
        CudaDevice::grid_1d(n),
        &args,
    )
}

// ---- Adam --------------------------------------------------------------------------------------

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
    /// For the bias corrections of a count kept on the device (`AdamStep::count_at`).
    lr: f64,
    beta1: f64,
    has_l2: i32,
    pad: i32,
}

// SAFETY: #[repr(C)], ten f64 then two i32: 88 bytes, no padding, every bit pattern valid.
unsafe impl bytemuck::Zeroable for AdamHyper {}
// SAFETY: as above.
unsafe impl bytemuck::Pod for AdamHyper {}

impl AdamHyper {
    fn of(a: &AdamStep) -> AdamHyper {
        let k = AdamScalars::of(a);
        AdamHyper {
            l2: k.l2,
            decay: k.decay,
            w1: k.w1,
            beta2: k.beta2,
            w2: k.w2,
            bc2_sqrt: k.bc2_sqrt,
            neg_step: k.neg_step_size,
            eps: k.eps,
            lr: a.lr,
            beta1: a.beta1,
            has_l2: (k.l2 != 0.0) as i32,
            pad: 0,
        }
    }
}

/// Writes step `a`'s scalars into `slot` (in stream order: the previous step's kernels have
/// read theirs by the time the copy lands).
fn stage(d: &CudaDevice, a: &AdamStep, slot: &Storage) -> Result<()> {
    d.copy_to_device(ptr(slot)?, bytemuck::bytes_of(&AdamHyper::of(a)))
}

fn adam(d: &CudaDevice, a: &AdamStep) -> Result<()> {
    let (mut groups, mut masters) = (Groups::new(), Groups::new());
    for p in a.params {
        match p.master {
            Some(w) => {
                let Row {
                    addrs: [pp, g, m, v],
                    n,
                } = adam_row(p)?;
                let w = if n == 0 { 0 } else { ptr(w)? };
                masters.push(
                    p.param.dtype(),
                    Row {
                        addrs: [pp, g, m, v, w],
                        n,
                    },
                );
            }
            None => groups.push(p.param.dtype(), adam_row(p)?),
        }
    }
    let grad_scale = a.grad_scale.as_ref().map(addr).transpose()?.unwrap_or(0);
    let skip = a.skip_if.as_ref().map(addr).transpose()?.unwrap_or(0);
    let count = a.count_at.as_ref().map(addr).transpose()?.unwrap_or(0);
    // The scalars: where the caller staged them, else uploaded with each launch's table.
    let staged = a.staged_scalars.map(ptr).transpose()?;
    let hyper = AdamHyper::of(a);
    let scalars = Scalars {
        staged,
        words: bytemuck::cast_slice(std::slice::from_ref(&hyper)),
        grad_scale,
        skip,
        count,
    };
    for (dtype, rows) in groups.iter() {
        adam_launch(d, "adam_multi", *dtype, rows, &scalars)?;
    }
    for (dtype, rows) in masters.iter() {
        adam_launch(d, "adam_master_multi", *dtype, rows, &scalars)?;
    }
    Ok(())
}

fn adam_row(p: &AdamParam) -> Result<AdamRow> {
    let n = p.param.len();
    if n == 0 {
        return Ok(Row { addrs: [0; 4], n });
    }
    let addrs = [
        ptr(p.param)?,
        addr(&p.grad)?,
        ptr(p.exp_avg)?,
        ptr(p.exp_avg_sq)?,
    ];
    Ok(Row { addrs, n })
}

/// An Adam launch's scalars: staged on the device (`staged_scalars`), or `words` to upload
/// behind its table; the addresses of the gradient scale, the skip flag and the device's
/// step count (0: none).
struct Scalars<'a> {
    staged: Option<u64>,
    words: &'a [u64],
    grad_scale: u64,
    skip: u64,
    count: u64,
}

/// `{stem}_{dtype}` over `rows` (AdamEntry or AdamMasterEntry tables: A = 4 or 5).
fn adam_launch<const A: usize>(
    d: &CudaDevice,
    stem: &str,
    dtype: DType,
    rows: &[Row<A>],
    scalars: &Scalars,
) -> Result<()> {
    let trailer = if scalars.staged.is_some() {
        &[][..]
    } else {
        scalars.words
    };
    let Some(table) = Table::upload_with(d, rows, trailer, "adam_table")? else {
        return Ok(());
    };
    let hyper = scalars.staged.unwrap_or(table.trailer);
    let name = format!("{stem}_{}", suffix("adam", dtype)?);
    // {stem}_*(const Entry*, int, i64, const AdamHyper*, const double*, const float*,
    // const double*): the table just uploaded, the step's scalars, the gradient scale, the
    // skip flag and the step count (null: none).
    let args = [
        Arg::Ptr(table.addr),
        Arg::I32(table.count),
        Arg::I64(table.chunks),
        Arg::Ptr(hyper),
        Arg::Ptr(scalars.grad_scale),
        Arg::Ptr(scalars.skip),
        Arg::Ptr(scalars.count),
    ];
    launch(d, &KERNELS, &name, table.config(), &args)
}

// ---- unscale with inf/NaN check ----------------------------------------------------------------

/// One launch per dtype unscales every gradient of that dtype in place and raises the shared
/// found_inf flag on any inf or NaN.
fn unscale_check(d: &CudaDevice, a: &UnscaleCheck) -> Result<()> {
    let mut groups = Groups::new();
    for g in a.grads.iter().filter(|g| !g.is_empty()) {
        groups.push(
            g.dtype(),
            Row {
                addrs: [ptr(g)?],
                n: g.len(),
            },
        );
    }
    let found_inf = ptr(a.found_inf)?;
    let inv_scale_at = a.inv_scale_at.as_ref().map(addr).transpose()?.unwrap_or(0);
    for (dtype, rows) in groups.iter() {
        let Some(table) = Table::upload(d, rows, "unscale_table")? else {
            continue;
        };
        let name = format!("unscale_check_{}", suffix("unscale_check", *dtype)?);
        // unscale_check_*(const UnscaleEntry*, int, i64, float, const float*, float*)
        let args = [
            Arg::Ptr(table.addr),
            Arg::I32(table.count),
            Arg::I64(table.chunks),
            Arg::F32(a.inv_scale),
            Arg::Ptr(inv_scale_at),
            Arg::Ptr(found_inf),
        ];
        launch(d, &KERNELS, &name, table.config(), &args)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hyper_layout_matches_the_kernel() {
        assert_eq!(std::mem::size_of::<AdamHyper>(), 88);
        const { assert!(88 <= crate::backend::optim::ADAM_SCALAR_BYTES) };
    }
}
