//! CUDA launcher of the mixed-precision gradient unscale (`FusedOp::UnscaleCheck`, kernels in
//! kernels/amp.cu): one launch per dtype unscales every gradient of that dtype in place and
//! raises the shared found_inf flag on any inf or NaN. The host checks every operand first, so
//! an error leaves all gradients untouched, then uploads a table of (grad, numel, first chunk)
//! for the kernel to walk, as the Adam launch (optim.rs) does. The upload waits for the stream;
//! the flag stays on the device for the caller to read once.

use cudarc::driver::PushKernelArg;

use super::multi_tensor::{Groups, Row, Table, suffix};
use super::{CudaDevice, ptr};
use crate::backend::cpu::unscale_operands;
use crate::backend::{Storage, View};
use crate::base::DType;
use crate::base::Result;

const MODULE: &str = "amp";
const SRC: &str = concat!(
    include_str!("kernels/strided.cuh"),
    include_str!("kernels/amp.cu")
);
/// inputs []; outputs [found_inf (1) F32, grad_0, .., grad_{n-1}].
pub(crate) fn unscale_check(
    d: &CudaDevice,
    inv_scale: f32,
    inputs: &[View],
    outputs: &[&Storage],
) -> Result<()> {
    let (flag, grads) = unscale_operands(inputs, outputs)?;
    let mut groups = Groups::new();
    for g in grads.iter().filter(|g| !g.is_empty()) {
        groups.push(
            g.dtype(),
            Row {
                addrs: [ptr(g)?],
                n: g.len(),
            },
        );
    }
    let found_inf = ptr(flag)?;
    for (dtype, rows) in groups.iter() {
        launch(d, *dtype, rows, inv_scale, found_inf)?;
    }
    Ok(())
}

/// One launch over the gradients of one dtype (rows as struct UnscaleEntry in amp.cu).
fn launch(
    d: &CudaDevice,
    dtype: DType,
    rows: &[Row<1>],
    inv_scale: f32,
    found_inf: u64,
) -> Result<()> {
    let Some(table) = Table::upload(d, rows, "unscale_table")? else {
        return Ok(());
    };
    let name = format!("unscale_check_{}", suffix(dtype));
    let f = d.function(MODULE, SRC, &name)?;
    let mut b = d.stream().launch_builder(&f);
    b.arg(&table.addr)
        .arg(&table.count)
        .arg(&table.chunks)
        .arg(&inv_scale)
        .arg(&found_inf);
    // SAFETY: unscale_check_*(const UnscaleEntry*, int, i64, float, float*) with the table
    // just uploaded (count rows, chunk numbers below `chunks`); every address in it is a live
    // block of the row's dtype holding n elements, and found_inf is a live one-element f32
    // block (checked in `unscale_operands`). The table's block is freed after the
    // launch is queued: later users of it are ordered after the launch on this device's
    // single stream.
    unsafe { b.launch(table.config()) }.map_err(|e| d.err(&format!("launching {name}"), e))?;
    Ok(())
}
