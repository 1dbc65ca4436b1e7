//! A language model's head and loss as one op: `x.linear(w, None)?.cross_entropy(targets,
//! ignore_index)` without ever holding the whole (N, V) logits. Rows go through in chunks of
//! at most `CHUNK_BYTES` of logits; each chunk's logits are made, give the chunk's loss, are
//! overwritten by their own gradient, and give the chunk's rows of dx and its share of dw —
//! then the next chunk reuses nothing of them. The (B·T, 50257) logits of GPT-2, the largest
//! block of a step, shrink to one chunk's.
//!
//! The gradients are therefore computed in the forward, for a loss gradient of 1, and kept
//! (dx (N, C), dw (V, C) or the GPU's padded (Vp, C) block, counted as saved activations);
//! backward multiplies them by the loss's actual gradient, in place where nothing else holds
//! them. Each chunk's loss is its mean over its counted targets, weighed by its share of all
//! counted targets (computed on the device: nothing is read back); its gradient uses the same
//! share. With one chunk (most small models) the loss and both
//! gradients are the composition's bit for bit under a loss gradient of 1; with several, dw
//! sums the chunks' products (a different order of the same sums) and is equal to rounding.
//! Not differentiable twice (create_graph through it is the engine's error naming it). f16
//! runs the composition: unscaled f16 gradients would underflow.

use super::aligned_gemm::{PaddedWeight, first_rows};
use super::binary::binary_forward;
use super::matmul::{matmul_acc_into, matmul_forward};
use super::{autocast, check_float, check_same_device, stats_dtype};
use crate::autograd::{SavedTensor, no_grad, record, saved_values_released_after_this_backward};
use crate::backend::BinaryOp;
use crate::backend::loss::{self, CrossEntropy, CrossEntropyWithGrad};
use crate::base::{Error, Result};
use crate::tensor::{DType, Tensor};

/// The most bytes of logits one chunk holds (a quarter of GPT-2's at B 8, T 1024).
pub const CHUNK_BYTES: usize = 256 << 20;

impl Tensor {
    /// Mean cross-entropy of `self.linear(weight, None)` against `targets`: self (N, C) or
    /// (B, T, C), weight (V, C), targets I64 (N) or (B, T), targets equal to `ignore_index`
    /// not counted (all ignored: NaN). The loss and its dtype are `cross_entropy`'s (f32 under
    /// autocast); gradients flow to self and weight.
    #[track_caller]
    pub fn linear_cross_entropy(
        &self,
        weight: &Tensor,
        targets: &Tensor,
        ignore_index: i64,
    ) -> Result<Tensor> {
        let _site = crate::memory::recorder::CallSite::enter();
        self.linear_cross_entropy_in_chunks(weight, targets, ignore_index, CHUNK_BYTES)
    }

    /// `linear_cross_entropy` with chunks of at most `chunk_bytes` of logits (at least one
    /// row each).
    #[track_caller]
    pub fn linear_cross_entropy_in_chunks(
        &self,
        weight: &Tensor,
        targets: &Tensor,
        ignore_index: i64,
        chunk_bytes: usize,
    ) -> Result<Tensor> {
        let _site = crate::memory::recorder::CallSite::enter();
        if let Some([Some(x), Some(w)]) = autocast::cast_lower_opt([Some(self), Some(weight)])? {
            return x.linear_cross_entropy_in_chunks(&w, targets, ignore_index, chunk_bytes);
        }
        if self.dtype() == DType::F16 {
            // The gradients made for a loss gradient of 1 would underflow in f16 (GradScaler
            // exists for that): the composition, whose logits' gradient is made already scaled.
            return self
                .linear(weight, None)?
                .cross_entropy(targets, ignore_index);
        }
        let (rows, k) = check_args(self, weight, targets)?;
        let half = matches!(self.dtype(), DType::F16 | DType::BF16);
        let loss_dtype = match crate::amp::autocast_dtype() {
            Some(_) if half => DType::F32,
            _ => self.dtype(),
        };
        let wants_grad = crate::autograd::should_record(&[self, weight]);
        let head = Head {
            x: self.detached_contiguous()?.reshape(&[rows, k])?,
            w: PaddedWeight::new(weight)?,
            targets: targets.detached_contiguous()?.reshape(&[rows])?,
            ignore_index,
            loss_dtype,
        };
        let row_bytes = head.w.padded_width() * self.dtype().size_in_bytes();
        let chunk = chunk_rows(rows, row_bytes, chunk_bytes);
        let (loss, grads) = {
            let _inside = no_grad();
            head.run(chunk, wants_grad)?
        };
        let Some((dx, dw)) = grads else {
            return Ok(loss);
        };
        let (x_shape, w_rows) = (self.shape().to_vec(), weight.shape()[0]);
        Ok(record(
            "linear_cross_entropy",
            &[self, weight],
            loss,
            |_, _| {
                let (dx, dw) = (SavedTensor::new(&dx), SavedTensor::new(&dw));
                move |g: &Tensor, n: &[bool]| {
                    let scale = |t: &Tensor| scaled(t, g);
                    Ok(vec![
                        n[0].then(|| scale(dx.get())?.reshape(&x_shape))
                            .transpose()?,
                        // Scaled over the whole padded block: in place where it may be.
                        n[1].then(|| first_rows(scale(dw.get())?, w_rows))
                            .transpose()?,
                    ])
                }
            },
        ))
    }
}

/// `t · g` for the 0-dim loss gradient g, in t's dtype: in place when the graph frees t after
/// this backward and nothing else holds it.
fn scaled(t: &Tensor, g: &Tensor) -> Result<Tensor> {
    let g = g.detach().to_dtype(t.dtype())?;
    if saved_values_released_after_this_backward() && t.owns_its_storage_alone() {
        t.mul_(&g)?;
        return Ok(t.clone());
    }
    t.mul(&g)
}

/// The most chunks one call makes: a batch so large that its chunks would be more goes in
/// larger ones (each step is a few kernels; the planner walks absurd batches too).
const MAX_CHUNKS: usize = 1024;

/// Rows per chunk: the fewest chunks that keep each under `chunk_bytes` of logits, then
/// balanced (GPT-2's 8192 rows go as four of 2048); at most MAX_CHUNKS.
fn chunk_rows(rows: usize, row_bytes: usize, chunk_bytes: usize) -> usize {
    let bytes = rows.saturating_mul(row_bytes);
    let chunks = bytes.div_ceil(chunk_bytes.max(1)).clamp(1, MAX_CHUNKS);
    rows.div_ceil(chunks).max(1)
}

/// The op's inputs, flattened: x (N, C), the weight (V, C) ready for the padded head GEMM,
/// targets (N).
struct Head {
    x: Tensor,
    w: PaddedWeight,
    targets: Tensor,
    ignore_index: i64,
    loss_dtype: DType,
}

impl Head {
    /// The loss and, when `wants_grad`, (dx, dw) for a loss gradient of 1; dw over the
    /// padded block `weight_grad_rows` makes (its first V rows are the weight's).
    fn run(&self, chunk: usize, wants_grad: bool) -> Result<(Tensor, Option<(Tensor, Tensor)>)> {
        let rows = self.x.shape()[0];
        let device = self.x.device();
        // 1.0 where a target is ignored: the counts below are sums of it, on the device.
        let t = self.targets.to_dtype(DType::F32)?;
        let ignore = Tensor::scalar(self.ignore_index as f64, DType::F32, device)?;
        let ignored = binary_forward(BinaryOp::Eq, &t, &ignore, "linear_cross_entropy")?;
        let count = counted(&ignored, rows)?;
        let mut total = Tensor::zeros(&[], self.loss_dtype, device)?;
        let dx = wants_grad
            .then(|| {
                Tensor::output_uninit(
                    self.x.shape(),
                    self.x.dtype(),
                    device,
                    "linear_cross_entropy",
                )
            })
            .transpose()?;
        let mut dw: Option<Tensor> = None;
        let zero = Tensor::scalar(0.0, DType::F32, device)?;
        for r0 in (0..rows).step_by(chunk) {
            let n = chunk.min(rows - r0);
            let (x, t) = (self.x.narrow(0, r0, n)?, self.targets.narrow(0, r0, n)?);
            let logits = self.w.forward(&x)?;
            // The chunk's share of the counted targets weighs its mean, and its gradient.
            let count_c = counted(&ignored.narrow(0, r0, n)?, n)?;
            let share = count_c.div(&count)?;
            let loss = match dx {
                Some(_) => self.chunk_loss_and_grad(&logits, &t, &share)?,
                None => self.chunk_loss(&logits, &t)?,
            };
            let empty = binary_forward(BinaryOp::Eq, &count_c, &zero, "linear_cross_entropy")?
                .to_dtype(DType::U8)?;
            // An empty chunk's mean is NaN; it adds nothing.
            let term = loss
                .mul(&share.to_dtype(self.loss_dtype)?)?
                .masked_fill(&empty, 0.0)?;
            total = total.add(&term)?;
            let Some(dx) = &dx else { continue };
            dx.narrow(0, r0, n)?.copy_(&self.w.input_grad(&logits)?)?;
            let gt = self.w.weight_grad_rows(&logits)?;
            match &dw {
                None => dw = Some(matmul_forward(&gt, &x)?),
                Some(dw) => matmul_acc_into(&gt, &x, dw, 1.0)?,
            }
        }
        // count / count: exactly 1, or NaN when no target counts (the composition's mean).
        let total = total.mul(&count.div(&count)?.to_dtype(self.loss_dtype)?)?;
        Ok((total, dx.zip(dw)))
    }

    /// The chunk's mean loss over its counted targets (NaN when it has none).
    fn chunk_loss(&self, logits: &Tensor, t: &Tensor) -> Result<Tensor> {
        let device = logits.device();
        let loss = self.loss_out(logits)?;
        let lse = Tensor::output_uninit(
            &[t.numel()],
            stats_dtype(logits.dtype()),
            device,
            "linear_cross_entropy",
        )?;
        loss::cross_entropy(&CrossEntropy {
            logits: logits.view(),
            targets: t.view(),
            loss: loss.storage(),
            lse: lse.storage(),
            ignore_index: self.ignore_index,
        })?;
        Ok(loss)
    }

    /// `chunk_loss`, with the chunk's logits overwritten by their gradient for a loss gradient
    /// of 1 in the same pass: (softmax - onehot) · share / count_c = (softmax - onehot) / count.
    fn chunk_loss_and_grad(&self, logits: &Tensor, t: &Tensor, share: &Tensor) -> Result<Tensor> {
        let loss = self.loss_out(logits)?;
        loss::cross_entropy_with_grad(&CrossEntropyWithGrad {
            logits: logits.view(),
            targets: t.view(),
            loss: loss.storage(),
            gloss: share.view(),
            ignore_index: self.ignore_index,
        })?;
        Ok(loss)
    }

    /// The 0-dim output a chunk's loss is written to.
    fn loss_out(&self, logits: &Tensor) -> Result<Tensor> {
        Tensor::output_uninit(
            &[],
            self.loss_dtype,
            logits.device(),
            "linear_cross_entropy",
        )
    }
}

/// The number of targets counted (not ignored) among `rows`, as a 0-dim f32 on the device.
fn counted(ignored: &Tensor, rows: usize) -> Result<Tensor> {
    ignored.sum_all()?.neg()?.add_scalar(rows as f64)
}

/// Checks dtypes, devices and shapes; returns (N, C).
fn check_args(x: &Tensor, w: &Tensor, targets: &Tensor) -> Result<(usize, usize)> {
    const OP: &str = "linear_cross_entropy";
    check_float(OP, x)?;
    check_same_device(OP, x, w)?;
    check_same_device(OP, x, targets)?;
    if w.dtype() != x.dtype() {
        return Err(Error::DType {
            op: OP,
            expected: x.dtype(),
            got: w.dtype(),
        });
    }
    if targets.dtype() != DType::I64 {
        return Err(Error::DType {
            op: OP,
            expected: DType::I64,
            got: targets.dtype(),
        });
    }
    let shape = x.shape();
    let lead = &shape[..shape.len().saturating_sub(1)];
    let k = shape.last().copied().unwrap_or(0);
    let fits = matches!(shape.len(), 2 | 3)
        && w.dims() == 2
        && w.shape()[1] == k
        && targets.shape() == lead;
    if !fits {
        return Err(Error::shape(
            OP,
            format!(
                "input {shape:?}, weight {:?} and targets {:?} must be (N, C) or (B, T, C), (V, C) and (N) or (B, T)",
                w.shape(),
                targets.shape()
            ),
        ));
    }
    Ok((lead.iter().product(), k))
}
