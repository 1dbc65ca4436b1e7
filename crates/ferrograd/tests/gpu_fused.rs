//! CUDA fused ops and cuBLAS GEMM against the CPU reference, forward and backward through
//! autograd: softmax / log-softmax along each dim, layer norm with and without affine
//! parameters, cross-entropy with ignored targets, embedding (gather and deterministic
//! scatter-add, strided and repeated ids), cat/split, masked_fill and where with broadcasting,
//! MSE, matmul/linear in every operand layout (transposed, broadcast batch, expanded, empty
//! inner dim) and dtype (f16/bf16 loosely, TF32 on and off), the fused MLP (cuBLASLt
//! epilogues), and SGD with momentum. Needs a
//! CUDA device: without one every test fails.
#![cfg(feature = "gpu-tests")]

mod common;

use std::sync::RwLock;

use common::{assert_close, assert_same_bits, regression_steps};
use ferrograd::backend::cuda::set_allow_tf32;
use ferrograd::optim::{Sgd, SgdConfig};
use ferrograd::{Category, DType, Device, Error, Generator, Result, Tensor, memory};

const GPU: Device = Device::Cuda(0);
const CPU: Device = Device::Cpu;
/// f32 results: the GPU sums in another order (and per-row statistics in f64 on both).
const TOL: (f64, f64) = (1e-5, 1e-5);

/// f32 GEMM tests read the global TF32 switch; the TF32 test flips it under the write lock.
static TF32: RwLock<()> = RwLock::new(());

fn randn(shape: &[usize], seed: u64) -> Tensor {
    Tensor::randn_with(shape, DType::F32, CPU, &mut Generator::new(seed)).unwrap()
}

fn ids(values: &[i64], shape: &[usize]) -> Tensor {
    Tensor::from_vec(values.to_vec(), shape, CPU).unwrap()
}

fn mask(values: &[u8], shape: &[usize]) -> Tensor {
    Tensor::from_vec(values.to_vec(), shape, CPU).unwrap()
}

/// Copies of `inputs` on `device` as fresh leaves; float ones require grad.
fn leaves(inputs: &[Tensor], device: Device) -> Vec<Tensor> {
    inputs
        .iter()
        .map(|t| {
            let t = t
                .to_device(device)
                .unwrap_or_else(|e| panic!("these tests need a CUDA device (cuda:0): {e}"))
                .detach();
            if t.dtype().is_float() {
                t.requires_grad_(true).unwrap()
            } else {
                t
            }
        })
        .collect()
}

fn on_cpu(t: &Tensor) -> Tensor {
    t.to_device(CPU).unwrap()
}

/// Runs `f` on CPU and cuda:0 copies of `inputs`. The outputs must agree within `(atol,
/// rtol)`, and so must the gradient of sum(out · w) (w fixed and random) for every float
/// input.
fn compare(
    name: &str,
    inputs: &[Tensor],
    tol: (f64, f64),
    f: impl Fn(&[Tensor]) -> Result<Tensor>,
) {
    let (cpu, gpu) = (leaves(inputs, CPU), leaves(inputs, GPU));
    let want = f(&cpu).unwrap_or_else(|e| panic!("{name}: CPU forward failed: {e}"));
    let got = f(&gpu).unwrap_or_else(|e| panic!("{name}: GPU forward failed: {e}"));
    assert_eq!(got.device(), GPU, "{name}: the result left the GPU");
    assert_eq!(got.dtype(), want.dtype(), "{name}: dtype");
    assert_close(
        &format!("{name} forward"),
        &on_cpu(&got),
        &want,
        tol.0,
        tol.1,
    );
    let w = Tensor::randn_with(want.shape(), want.dtype(), CPU, &mut Generator::new(99)).unwrap();
    let backward = |out: &Tensor, w: &Tensor| {
        out.mul(w)
            .and_then(|l| l.sum_all())
            .and_then(|l| l.backward())
    };
    backward(&want, &w).unwrap_or_else(|e| panic!("{name}: CPU backward failed: {e}"));
    backward(&got, &w.to_device(GPU).unwrap())
        .unwrap_or_else(|e| panic!("{name}: GPU backward failed: {e}"));
    let mut checked = 0;
    for (i, (c, g)) in cpu.iter().zip(&gpu).enumerate() {
        let (Some(gc), Some(gg)) = (c.grad(), g.grad()) else {
            assert!(
                c.grad().is_none() && g.grad().is_none(),
                "{name}: input {i} has a gradient on one device only"
            );
            continue;
        };
        assert_eq!(gg.device(), GPU, "{name}: gradient {i} left the GPU");
        assert_close(&format!("{name} grad {i}"), &on_cpu(&gg), &gc, tol.0, tol.1);
        checked += 1;
    }
    assert!(checked > 0, "{name}: no gradient was compared");
}

// ---- softmax -------------------------------------------------------------------------------

#[test]
fn softmax_and_log_softmax_along_each_dim() {
    // Rows longer than a block (300 > 256) and short ones; large logits test the max shift.
    let x = randn(&[4, 5, 300], 1).mul_scalar(8.0).unwrap();
    for dim in [-1, 1, 0] {
        compare(
            &format!("softmax dim {dim}"),
            std::slice::from_ref(&x),
            TOL,
            |t| t[0].softmax(dim),
        );
        compare(
            &format!("log_softmax dim {dim}"),
            std::slice::from_ref(&x),
            TOL,
            |t| t[0].log_softmax(dim),
        );
    }
    compare("softmax of one element", &[randn(&[3, 1], 2)], TOL, |t| {
        t[0].softmax(-1)
    });
}

#[test]
fn softmax_in_half_precision() {
    for dt in [DType::F16, DType::BF16] {
        let x = randn(&[6, 70], 3).to_dtype(dt).unwrap();
        compare(
            &format!("softmax {dt}"),
            std::slice::from_ref(&x),
            (1e-2, 1e-2),
            |t| t[0].softmax(-1),
        );
        compare(&format!("log_softmax {dt}"), &[x], (2e-2, 1e-2), |t| {
            t[0].log_softmax(-1)
        });
    }
}

// ---- layer norm ----------------------------------------------------------------------------

#[test]
fn layer_norm_with_and_without_affine() {
    // An offset mean checks the two-pass variance; 384 columns span two blocks' worth.
    let x = randn(&[6, 7, 384], 4).add_scalar(3.0).unwrap();
    let (w, b) = (randn(&[384], 5), randn(&[384], 6));
    compare(
        "layer_norm affine",
        &[x.clone(), w.clone(), b.clone()],
        TOL,
        |t| t[0].layer_norm(&[384], Some(&t[1]), Some(&t[2]), 1e-5),
    );
    compare("layer_norm weight only", &[x.clone(), w], TOL, |t| {
        t[0].layer_norm(&[384], Some(&t[1]), None, 1e-5)
    });
    compare("layer_norm bias only", &[x.clone(), b], TOL, |t| {
        t[0].layer_norm(&[384], None, Some(&t[1]), 1e-5)
    });
    compare("layer_norm plain", std::slice::from_ref(&x), TOL, |t| {
        t[0].layer_norm(&[384], None, None, 1e-5)
    });
    // Two normalised dims, and many rows (the weight gradient sums over several chunks).
    let (w2, b2) = (randn(&[7, 384], 7), randn(&[7, 384], 8));
    compare("layer_norm 2 dims", &[x, w2, b2], TOL, |t| {
        t[0].layer_norm(&[7, 384], Some(&t[1]), Some(&t[2]), 1e-5)
    });
    let tall = randn(&[3000, 8], 9);
    let (w3, b3) = (randn(&[8], 10), randn(&[8], 11));
    compare("layer_norm tall", &[tall, w3, b3], (1e-5, 1e-4), |t| {
        t[0].layer_norm(&[8], Some(&t[1]), Some(&t[2]), 1e-5)
    });
}

/// The tolerance of a layer norm over `rows` with an output of `out` against the CPU. The
/// GPU's warp kernels compute in f32 and the CPU in f64, so an f16 output of f32 rows may round
/// to the neighbouring f16 where the two straddle a rounding boundary (two of 6,912 values did
/// so here): one f16 step, 2^-10 of the value at most. A bf16 output's step is eight times
/// coarser and these inputs meet no boundary, so it is held to f32's tolerance; half rows are
/// held to half precision's.
fn half_out_tol(rows: DType, out: DType) -> (f64, f64) {
    match (rows, out) {
        (DType::F32, DType::F16) => (1e-5, 1e-3),
        (DType::F32, _) => TOL,
        _ => (2e-2, 2e-2),
    }
}

/// A norm on a residual stream: x's gradient from the other path (created after the norm, so
/// pending when the norm's backward runs) is folded into the norm's gradient kernel — in
/// place when only x holds it (mul's gradient), read from a shared buffer when another input
/// holds it too (add's gradient with c requiring grad) — through the warp kernels (768) and
/// the block kernels (1100), with f32 rows and a bf16 or f16 output, and in bf16 and f16.
#[test]
fn layer_norm_folds_the_residual_gradient() {
    for (n, rows_dtype, out) in [
        (768, DType::F32, DType::F32),
        (1100, DType::F32, DType::F32),
        (768, DType::F32, DType::BF16),
        (768, DType::F32, DType::F16),
        (768, DType::BF16, DType::BF16),
        (768, DType::F16, DType::F16),
    ] {
        let x = randn(&[9, n], 50).to_dtype(rows_dtype).unwrap();
        let (w, b) = (randn(&[n], 51), randn(&[n], 52));
        let c = randn(&[9, n], 53).to_dtype(rows_dtype).unwrap();
        let [w, b] = [w, b].map(|p| p.to_dtype(rows_dtype).unwrap());
        let tol = half_out_tol(rows_dtype, out);
        let norm = move |t: &[Tensor]| {
            t[0].layer_norm_to(&[n], Some(&t[1]), Some(&t[2]), 1e-5, out)?
                .to_dtype(rows_dtype)
        };
        let name = format!("layer_norm + x·c, n={n} {rows_dtype:?}->{out:?}");
        compare(
            &name,
            &[x.clone(), w.clone(), b.clone(), c.clone()],
            tol,
            |t| norm(t)?.add(&t[0].mul(&t[3])?),
        );
        let name = format!("layer_norm + (x + c), n={n} {rows_dtype:?}->{out:?}");
        compare(&name, &[x, w, b, c], tol, |t| {
            norm(t)?.add(&t[0].add(&t[3])?)
        });
    }
}

/// The residual add and the norm after it in one kernel (`add_layer_norm_to`): s and y and
/// every gradient against the CPU, through the warp kernels (768) and the block kernels
/// (1100), for an f32 stream with an f32, bf16 or f16 branch and output, and all in bf16 or f16.
#[test]
fn residual_add_and_layer_norm_in_one_kernel() {
    for (n, stream, half) in [
        (768, DType::F32, DType::F32),
        (1100, DType::F32, DType::F32),
        (768, DType::F32, DType::BF16),
        (1100, DType::F32, DType::BF16),
        (768, DType::F32, DType::F16),
        (768, DType::BF16, DType::BF16),
        (768, DType::F16, DType::F16),
    ] {
        let x = randn(&[9, n], 60).to_dtype(stream).unwrap();
        let h = randn(&[9, n], 61).to_dtype(half).unwrap();
        let [w, b] = [randn(&[n], 62), randn(&[n], 63)].map(|p| p.to_dtype(stream).unwrap());
        let tol = half_out_tol(stream, half);
        let step = move |t: &[Tensor]| {
            t[0].add_layer_norm_to(&t[1], &[n], Some(&t[2]), Some(&t[3]), 1e-5, half)
        };
        // Both outputs reach the loss: y through a cast to the stream's dtype, s directly.
        compare(
            &format!("add + layer_norm n={n} {stream:?}+{half:?}"),
            &[x, h, w, b],
            tol,
            |t| {
                let (s, y) = step(t)?;
                s.add(&y.to_dtype(stream)?)
            },
        );
    }
}

/// Under autocast, a residual branch that ends in a Linear (f32 parameters, bf16 output) gets
/// its bias gradient from the norm's backward kernel, which sums the half gradient's columns
/// as it writes them (a third row of partials beside the weight's and bias's); every gradient
/// against the CPU, which reduces that gradient instead. 67 rows: partials of 17 blocks.
/// The Linear's inputs are multiples of 1/2, 1/8 and 1/4 small enough that its bf16 output is
/// exact on both devices, whatever order the GEMMs add in: a rounding flip there would move
/// the sums it feeds by more than any tolerance on the kernels.
#[test]
fn a_linear_branch_takes_its_bias_gradient_from_the_norm_kernel() {
    use ferrograd::amp::{AmpDType, autocast};
    let n = 768;
    let exact = |shape: &[usize], f: fn(usize) -> f32| {
        let len = shape.iter().product();
        Tensor::from_vec((0..len).map(f).collect(), shape, CPU).unwrap()
    };
    let x = randn(&[67, n], 70);
    let z = exact(&[67, 64], |i| ((i * 37 + 11) % 5) as f32 / 2.0 - 1.0);
    let wl = exact(&[n, 64], |i| ((i * 53 + 5) % 3) as f32 / 8.0 - 0.125);
    let bl = exact(&[n], |i| ((i * 29 + 3) % 9) as f32 / 4.0 - 1.0);
    let [w, b] = [randn(&[n], 74), randn(&[n], 75)];
    compare(
        "add + layer_norm of a Linear's bf16 output",
        &[x, z, wl, bl, w, b],
        (2e-2, 2e-2),
        |t| {
            let _amp = autocast(AmpDType::BF16);
            let h = t[1].linear(&t[2], Some(&t[3]))?;
            let (s, y) =
                t[0].add_layer_norm_to(&h, &[n], Some(&t[4]), Some(&t[5]), 1e-5, DType::BF16)?;
            s.add(&y.to_dtype(DType::F32)?)
        },
    );
}

/// Rows up to 1024 wide are held in a warp's registers (8, 16, 24 or 32 per lane); wider
/// ones take a block per row. Each width at a slot boundary matches the CPU, as do rows that
/// start one element past a vector's bytes: the warp kernels move groups of four elements as
/// one vector only where every row's groups are aligned, and element by element otherwise
/// (also at widths that are not a multiple of four).
#[test]
fn layer_norm_at_every_row_width_boundary() {
    for n in [31, 256, 257, 768, 1024, 1025] {
        let x = randn(&[37, n], 40 + n as u64).add_scalar(1.5).unwrap();
        let (w, b) = (randn(&[n], 41), randn(&[n], 42));
        compare(&format!("layer_norm n={n}"), &[x, w, b], TOL, |t| {
            t[0].layer_norm(&[n], Some(&t[1]), Some(&t[2]), 1e-5)
        });
        let flat = randn(&[37 * n + 1], 43 + n as u64);
        let (w, b) = (randn(&[n], 44), randn(&[n], 45));
        compare(
            &format!("layer_norm n={n}, one in"),
            &[flat, w, b],
            TOL,
            |t| {
                let x = t[0].narrow(0, 1, 37 * n)?.reshape(&[37, n])?;
                x.layer_norm(&[n], Some(&t[1]), Some(&t[2]), 1e-5)
            },
        );
    }
}

#[test]
fn layer_norm_in_half_precision() {
    for dt in [DType::F16, DType::BF16] {
        let x = randn(&[5, 96], 12).to_dtype(dt).unwrap();
        let (w, b) = (
            randn(&[96], 13).to_dtype(dt).unwrap(),
            randn(&[96], 14).to_dtype(dt).unwrap(),
        );
        compare(&format!("layer_norm {dt}"), &[x, w, b], (5e-2, 2e-2), |t| {
            t[0].layer_norm(&[96], Some(&t[1]), Some(&t[2]), 1e-5)
        });
    }
}

/// The output of `f` on fresh cuda:0 leaves copied from `inputs`, then each leaf's gradient
/// after a backward from `gy` (the output's shape and dtype), all copied to the CPU.
fn gpu_output_and_grads(
    inputs: &[Tensor],
    gy: &Tensor,
    f: impl Fn(&[Tensor]) -> Result<Tensor>,
) -> Vec<Tensor> {
    let leaves = leaves(inputs, GPU);
    let y = f(&leaves).unwrap();
    assert_eq!(y.device(), GPU, "the result left the GPU");
    let opts = ferrograd::autograd::BackwardOptions {
        gradient: Some(gy.to_device(GPU).unwrap()),
        ..Default::default()
    };
    y.backward_with(opts).unwrap();
    let grads = leaves.iter().map(|t| on_cpu(&t.grad().unwrap()));
    std::iter::once(on_cpu(&y.detach())).chain(grads).collect()
}

/// `layer_norm_to` writes f16/bf16 from f32 rows in the norm's own kernels (a warp per row at
/// each register count, a block per row past 1024 columns, the two-stage parameter
/// gradients) and reads the half gradient back in them: equal bit for bit to the GPU's f32
/// norm followed by its cast kernels, forward and every gradient, and close to the CPU.
#[test]
fn layer_norm_to_equals_the_norm_then_cast_bit_for_bit() {
    let cases: [(&[usize], usize); 6] = [
        (&[6, 7, 40], 40),
        (&[6, 7, 384], 384),
        (&[6, 7, 768], 768),
        (&[6, 7, 1000], 1000),
        (&[6, 7, 1500], 1500),
        (&[3000, 8], 8),
    ];
    for dt in [DType::BF16, DType::F16] {
        for (i, (shape, n)) in cases.into_iter().enumerate() {
            let x = randn(shape, 60 + i as u64).add_scalar(3.0).unwrap();
            let (w, b) = (randn(&[n], 70 + i as u64), randn(&[n], 80 + i as u64));
            let gy = randn(shape, 90 + i as u64).to_dtype(dt).unwrap();
            for (name, inputs) in [
                ("affine", vec![x.clone(), w.clone(), b.clone()]),
                ("weight only", vec![x.clone(), w.clone()]),
                ("plain", vec![x.clone()]),
            ] {
                let what = format!("layer_norm_to {dt} {shape:?} {name}");
                let (pw, pb) = (inputs.len() > 1, inputs.len() > 2);
                let params = |t: &[Tensor]| (pw.then(|| t[1].clone()), pb.then(|| t[2].clone()));
                let fused = gpu_output_and_grads(&inputs, &gy, |t| {
                    let (w, b) = params(t);
                    t[0].layer_norm_to(&[n], w.as_ref(), b.as_ref(), 1e-5, dt)
                });
                let composed = gpu_output_and_grads(&inputs, &gy, |t| {
                    let (w, b) = params(t);
                    t[0].layer_norm(&[n], w.as_ref(), b.as_ref(), 1e-5)?
                        .to_dtype(dt)
                });
                for (k, (g, c)) in fused.iter().zip(&composed).enumerate() {
                    assert_same_bits(&format!("{what}: output {k}"), g, c);
                }
                // Against the CPU: the f32 norms differ in the last f32 bits, which can move
                // a half rounding by one step.
                compare(&what, &inputs, (2e-2, 2e-2), |t| {
                    let (w, b) = params(t);
                    t[0].layer_norm_to(&[n], w.as_ref(), b.as_ref(), 1e-5, dt)
                });
            }
        }
    }
}

// ---- cross-entropy -------------------------------------------------------------------------

#[test]
fn cross_entropy_with_ignored_targets() {
    let logits = randn(&[2, 9, 300], 15).mul_scalar(3.0).unwrap();
    let t: Vec<i64> = (0..18)
        .map(|i| if i % 4 == 1 { -100 } else { (i * 37) % 300 })
        .collect();
    compare(
        "cross_entropy",
        &[logits.clone(), ids(&t, &[2, 9])],
        TOL,
        |x| x[0].cross_entropy(&x[1], -100),
    );
    // A custom ignore index, (N, C) logits.
    let l2 = randn(&[7, 5], 16);
    compare(
        "cross_entropy (N, C)",
        &[l2, ids(&[0, 4, 2, 2, 3, 1, 2], &[7])],
        TOL,
        |x| x[0].cross_entropy(&x[1], 2),
    );
    // Every target ignored: NaN, as PyTorch's mean over nothing.
    let all = ids(&[-100; 18], &[2, 9]);
    let loss = logits
        .to_device(GPU)
        .unwrap()
        .cross_entropy(&all.to_device(GPU).unwrap(), -100)
        .unwrap();
    assert!(loss.item().unwrap().is_nan());
}

#[test]
fn cross_entropy_rejects_a_bad_target_on_the_gpu() {
    let logits = randn(&[3, 4], 17).to_device(GPU).unwrap();
    let t = ids(&[1, 4, 0], &[3]).to_device(GPU).unwrap();
    match logits.cross_entropy(&t, -100) {
        Err(Error::Index { detail, .. }) => {
            assert!(detail.contains("target 4 at position 1"), "{detail}")
        }
        other => panic!("expected an index error, got {other:?}"),
    }
}

/// The fused classifier against the CPU: loss, dx and dw over several chunks, in bf16 (the
/// loss and the logits' gradient in one kernel per chunk), f32 and f64 (the forward and
/// backward kernels); vocabularies of whole 16-byte vectors (1024) and not (1100: a tail, and
/// a row stride padded past it); ignored targets, among them chunks of nothing else.
#[test]
fn linear_cross_entropy_in_chunks_matches_the_cpu() {
    let rows = 40;
    for v in [1024usize, 1100] {
        let t: Vec<i64> = (0..rows as i64)
            .map(|r| match r {
                8..24 => -100,
                _ if r % 5 == 2 => -100,
                _ => (r * 131 + 7) % v as i64,
            })
            .collect();
        for (dt, tol) in [
            (DType::BF16, (1e-3, 3e-2)),
            (DType::F32, (1e-5, 1e-5)),
            (DType::F64, TOL),
        ] {
            let x = randn(&[rows, 48], 40).to_dtype(dt).unwrap();
            let w = randn(&[v, 48], 41).mul_scalar(0.3).unwrap();
            // Chunks of at most 10 rows' logits (8 where the stride is padded).
            let chunk = 10 * v * dt.size_in_bytes();
            compare(
                &format!("linear_cross_entropy {dt} V {v}"),
                &[x, w.to_dtype(dt).unwrap(), ids(&t, &[rows])],
                tol,
                |a| a[0].linear_cross_entropy_in_chunks(&a[1], &a[2], -100, chunk),
            );
        }
    }
}

/// The one-pass bf16 loss-and-gradient kernel stages a row in shared memory on Hopper when its
/// vectors fit two blocks per SM (GPT-2's 50257 logits: 100.5 KB) and reads it twice beyond
/// that (60000: 117 KB): both against the CPU.
#[test]
fn linear_cross_entropy_on_rows_staged_and_too_wide_to_stage_matches_the_cpu() {
    let rows = 6;
    for v in [50257usize, 60000] {
        let t: Vec<i64> = [0, v as i64 - 1, -100, 7, 40000, 3].to_vec();
        let x = randn(&[rows, 16], 42).to_dtype(DType::BF16).unwrap();
        let w = randn(&[v, 16], 43).mul_scalar(0.3).unwrap();
        compare(
            &format!("linear_cross_entropy bf16 V {v}"),
            &[x, w.to_dtype(DType::BF16).unwrap(), ids(&t, &[rows])],
            (1e-3, 3e-2),
            |a| a[0].linear_cross_entropy(&a[1], &a[2], -100),
        );
    }
}

/// A training step's ids and targets come from the host: their range checks use the host
/// copy the upload kept, so neither the forward nor the backward waits for the GPU.
#[test]
fn uploaded_ids_and_targets_are_checked_without_waiting_for_the_gpu() {
    let w = randn(&[20, 16], 26)
        .to_device(GPU)
        .unwrap()
        .requires_grad_(true)
        .unwrap();
    let x = ids(&[3, 7, 3, 0, 19, 3], &[2, 3]).to_device(GPU).unwrap();
    let t = ids(&[1, 2, -100, 4, 5, 15], &[2, 3])
        .to_device(GPU)
        .unwrap();
    ferrograd::backend::synchronize(GPU).unwrap();
    ferrograd::backend::cuda::take_host_waits();
    // Positions made by arange on the GPU keep their host copy too.
    let pos = Tensor::arange(0.0, 3.0, 1.0, DType::I64, GPU).unwrap();
    let h = w
        .embedding(&x)
        .unwrap()
        .add(&w.embedding(&pos).unwrap())
        .unwrap();
    let loss = h.cross_entropy(&t, -100).unwrap();
    loss.backward().unwrap();
    let (waits, _) = ferrograd::backend::cuda::take_host_waits();
    assert_eq!(waits, 0, "the step waited for the GPU {waits} times");
    // The same values changed on the device: the host copy is stale, the check reads back
    // and still names the bad id.
    x.fill_(20.0).unwrap();
    match w.embedding(&x) {
        Err(Error::Index { detail, .. }) => assert!(detail.contains("index 20"), "{detail}"),
        other => panic!("expected an index error, got {other:?}"),
    }
    let (waits, _) = ferrograd::backend::cuda::take_host_waits();
    assert!(waits >= 1, "a changed id buffer must be read back");
}

/// A head 1500 wide (unaligned, ≥ 1024) runs at the padded width 1504 on the GPU: the
/// logits, a view with rows 1504 apart, and all gradients equal the CPU's (which pads
/// nothing), through the cross-entropy (the padded input gradient) and through an ordinary
/// consumer (the plain one).
#[test]
fn a_wide_unaligned_head_runs_padded_with_the_cpus_results() {
    let _tf32 = TF32.read().unwrap_or_else(|e| e.into_inner());
    let (x, w) = (randn(&[2, 24, 40], 27), randn(&[1500, 40], 28));
    let targets: Vec<i64> = (0..48).map(|i| (i * 31) % 1500).collect();
    let t = ids(&targets, &[2, 24]);
    let logits = x
        .to_device(GPU)
        .unwrap()
        .linear(&w.to_device(GPU).unwrap(), None)
        .unwrap();
    assert_eq!(logits.strides(), &[24 * 1504, 1504, 1]);
    // The input gradient sums 1500 products in f32 on each side in different orders: where
    // the sum cancels, its rounding reaches ~1e-5 of the summed magnitudes (measured on an
    // H200: 14 of 1920 values beyond 1e-5, the values shown within 2e-6 relative).
    let sum_of_1500 = (2e-4, 1e-4);
    compare(
        "padded head, cross-entropy",
        &[x.clone(), w.clone(), t],
        sum_of_1500,
        |v| v[0].linear(&v[1], None)?.cross_entropy(&v[2], -100),
    );
    // The plain head's input gradient sums the same 1500 products (measured on an H200: 14
    // of 1920 values beyond 1e-5, at most 9.3e-5 on a value of 18.4, 5e-6 relative).
    compare("padded head", &[x, w], sum_of_1500, |v| {
        v[0].linear(&v[1], None)
    });
}

/// Rows of 33 classes take the per-element kernels; rows of whole 16-byte vectors (40, and
/// 1504 with a tail: the padded head) take the vector ones.
#[test]
fn cross_entropy_in_half_precision() {
    for dt in [DType::F16, DType::BF16] {
        for c in [33i64, 40, 1504] {
            let logits = randn(&[6, c as usize], 18).to_dtype(dt).unwrap();
            let t = ids(&[0, c - 1, 5, -100, 7, 7], &[6]);
            compare(
                &format!("cross_entropy {dt} C={c}"),
                &[logits, t],
                (2e-2, 2e-2),
                |x| x[0].cross_entropy(&x[1], -100),
            );
        }
        // A head of 1500 classes, computed at the aligned width 1504: rows 1504 apart, the
        // last vector of each row part logit, part padding.
        let (x, w) = (randn(&[2, 3, 40], 27), randn(&[1500, 40], 28));
        let t = ids(&[0, 1499, 5, -100, 700, 7], &[2, 3]);
        compare(
            &format!("padded head, cross-entropy {dt}"),
            &[x.to_dtype(dt).unwrap(), w.to_dtype(dt).unwrap(), t],
            (2e-2, 2e-2),
            |v| v[0].linear(&v[1], None)?.cross_entropy(&v[2], -100),
        );
    }
}

// ---- embedding -----------------------------------------------------------------------------

#[test]
fn embedding_gathers_and_scatters_repeated_ids() {
    let w = randn(&[20, 16], 19);
    let i = ids(&[3, 7, 3, 0, 19, 3, 7, 7, 1, 2, 3, 4, 5, 6, 0], &[3, 5]);
    compare("embedding", &[w.clone(), i.clone()], TOL, |x| {
        x[0].embedding(&x[1])
    });
    // Strided weight (a transposed view) and strided ids (transposed).
    let wt = randn(&[16, 20], 20);
    compare("embedding strided", &[wt, i.clone()], TOL, |x| {
        x[0].transpose(0, 1)?.embedding(&x[1].transpose(0, 1)?)
    });
    // A gradient expanded from a sum reaches the scatter-add with stride 0.
    compare("embedding summed", &[w.clone(), i], TOL, |x| {
        x[0].embedding(&x[1])?.sum_all()
    });
    // Many repeats of one id: the f64 sum in order must match the CPU's exactly.
    let many = ids(&vec![5; 5000], &[5000]);
    compare("embedding repeats", &[w, many], (1e-6, 1e-6), |x| {
        x[0].embedding(&x[1])
    });
}

#[test]
fn embedding_rejects_a_bad_id_on_the_gpu() {
    let w = randn(&[4, 3], 21).to_device(GPU).unwrap();
    let i = ids(&[0, 2, -1], &[3]).to_device(GPU).unwrap();
    match w.embedding(&i) {
        Err(Error::Index { op, detail }) => {
            assert_eq!(op, "embedding");
            assert!(detail.contains("index -1 (at position 2"), "{detail}")
        }
        other => panic!("expected an index error, got {other:?}"),
    }
}

// ---- cat / split / where / masked_fill -----------------------------------------------------

#[test]
fn cat_and_split() {
    let (a, b) = (randn(&[3, 4], 22), randn(&[3, 6], 23));
    compare("cat/split", &[a, b], TOL, |x| {
        let joined = Tensor::cat(&[x[0].clone(), x[1].clone()], 1)?;
        let parts = joined.split(&[5, 5], 1)?;
        Tensor::cat(&[parts[1].mul_scalar(2.0)?, parts[0].clone()], 0)
    });
}

#[test]
fn masked_fill_and_where_broadcast() {
    let x = randn(&[4, 6], 24);
    let m = mask(&[1, 0, 0, 1, 1, 0], &[1, 6]);
    compare("masked_fill", &[x.clone(), m.clone()], TOL, |t| {
        t[0].masked_fill(&t[1], -1e9)?.softmax(-1)
    });
    // cond (4, 1, 5), a (4, 3, 5), b (3, 1): every operand broadcasts somewhere.
    let c = mask(
        &[1, 0, 1, 1, 0, 0, 0, 1, 0, 1, 1, 1, 0, 0, 0, 1, 0, 1, 0, 1],
        &[4, 1, 5],
    );
    let (a, b) = (randn(&[4, 3, 5], 25), randn(&[3, 1], 26));
    compare("where", &[c, a, b], TOL, |t| {
        Tensor::where_(&t[0], &t[1], &t[2])
    });
    // f64 values through the 8-byte kernel.
    let x64 = x.to_dtype(DType::F64).unwrap();
    compare("masked_fill f64", &[x64, m], (1e-12, 1e-12), |t| {
        t[0].masked_fill(&t[1], 2.5)
    });
}

// ---- MSE -------------------------------------------------------------------------------------

#[test]
fn mse_loss_both_sides() {
    let (x, y) = (randn(&[5, 7, 300], 27), randn(&[5, 7, 300], 28));
    compare("mse_loss", &[x.clone(), y.clone()], TOL, |t| {
        t[0].mse_loss(&t[1])
    });
    let (x64, y64) = (
        x.to_dtype(DType::F64).unwrap(),
        y.to_dtype(DType::F64).unwrap(),
    );
    compare("mse_loss f64", &[x64, y64], (1e-12, 1e-12), |t| {
        t[0].mse_loss(&t[1])
    });
    let (xh, yh) = (
        x.to_dtype(DType::BF16).unwrap(),
        y.to_dtype(DType::BF16).unwrap(),
    );
    compare("mse_loss bf16", &[xh, yh], (2e-2, 1e-2), |t| {
        t[0].mse_loss(&t[1])
    });
}

// ---- matmul / linear -----------------------------------------------------------------------

#[test]
fn linear_and_matmul_layouts() {
    let _g = TF32.read().unwrap_or_else(|e| e.into_inner());
    let tol = (1e-4, 1e-5);
    // 2-D linear: x @ w.T + b reads w column-major.
    let (x, w, b) = (randn(&[33, 64], 30), randn(&[48, 64], 31), randn(&[48], 32));
    compare("linear", &[x, w, b], tol, |t| {
        t[0].linear(&t[1], Some(&t[2]))
    });
    // (B, T, k) @ (k, n) folds into one GEMM.
    let (x3, w2) = (randn(&[3, 5, 40], 33), randn(&[40, 29], 34));
    compare("matmul 3-D @ 2-D", &[x3, w2], tol, |t| t[0].matmul(&t[1]));
    // Batched, both operands transposed views.
    let (a, bb) = (randn(&[3, 40, 17], 35), randn(&[3, 29, 40], 36));
    compare(
        "matmul batched transposed",
        &[a.clone(), bb.clone()],
        tol,
        |t| t[0].transpose(-1, -2)?.matmul(&t[1].transpose(-1, -2)?),
    );
    compare(
        "matmul batched",
        &[randn(&[3, 17, 40], 37), randn(&[3, 40, 29], 38)],
        tol,
        |t| t[0].matmul(&t[1]),
    );
    // Broadcast batch dims (2, 1) x (3): the batch loop plus strided-batched calls.
    compare(
        "matmul broadcast batch",
        &[randn(&[2, 1, 17, 40], 39), randn(&[3, 40, 29], 40)],
        tol,
        |t| t[0].matmul(&t[1]),
    );
    // An expanded operand (stride 0 inside the matrix) is copied before the GEMM.
    compare(
        "matmul expanded",
        &[randn(&[17, 1], 41), randn(&[40, 29], 42)],
        tol,
        |t| t[0].expand(&[17, 40])?.matmul(&t[1]),
    );
    // Vectors and a single row.
    compare(
        "matmul vec",
        &[randn(&[40], 43), randn(&[40, 29], 44)],
        tol,
        |t| t[0].matmul(&t[1]),
    );
    compare(
        "matmul mat-vec",
        &[randn(&[17, 40], 45), randn(&[40], 46)],
        tol,
        |t| t[0].matmul(&t[1]),
    );
    // f64.
    let (a64, b64) = (
        a.to_dtype(DType::F64).unwrap(),
        bb.to_dtype(DType::F64).unwrap(),
    );
    compare("matmul f64", &[a64, b64], (1e-12, 1e-12), |t| {
        t[0].transpose(-1, -2)?.matmul(&t[1].transpose(-1, -2)?)
    });
}

#[test]
fn matmul_with_an_empty_inner_dim_is_zero() {
    let a = Tensor::zeros(&[3, 0], DType::F32, GPU).unwrap();
    let b = Tensor::zeros(&[0, 4], DType::F32, GPU).unwrap();
    let out = a.matmul(&b).unwrap();
    assert_eq!(out.shape(), &[3, 4]);
    assert_eq!(on_cpu(&out).to_vec::<f32>().unwrap(), vec![0.0; 12]);
}

/// The fused MLP (cuBLASLt's bias + GELU epilogue forward, the dGELU epilogue and the
/// bias-gradient epilogue backward) against the CPU's composed linear → gelu → linear.
#[test]
fn fused_mlp_matches_the_cpu() {
    let _t = TF32.read().unwrap_or_else(|e| e.into_inner());
    // Hidden width 96 takes the epilogues; 100 (rows of the pre-activation not a multiple of
    // 8 elements, which cuBLASLt's auxiliary matrix needs) the product and the elementwise GELU.
    for hidden in [96usize, 100] {
        let inputs = |dt: DType| -> Vec<Tensor> {
            [
                randn(&[3, 7, 32], 81),
                randn(&[hidden, 32], 82).mul_scalar(0.2).unwrap(),
                randn(&[hidden], 83),
                randn(&[40, hidden], 84).mul_scalar(0.1).unwrap(),
                randn(&[40], 85),
            ]
            .iter()
            .map(|t| t.to_dtype(dt).unwrap())
            .collect()
        };
        let mlp = |t: &[Tensor]| t[0].mlp_gelu(&t[1], &t[2], &t[3], &t[4]);
        compare(
            &format!("mlp_gelu f32 H{hidden}"),
            &inputs(DType::F32),
            (1e-4, 1e-4),
            mlp,
        );
        // In half precision the GPU rounds the GELU's input gradient once (in the epilogue)
        // where the CPU rounds the product and then the product times gelu'(pre): the weight
        // gradients (sums over rows) differ by a few units in the last place where terms
        // cancel.
        compare(
            &format!("mlp_gelu bf16 H{hidden}"),
            &inputs(DType::BF16),
            (1e-1, 5e-2),
            mlp,
        );
        compare(
            &format!("mlp_gelu f16 H{hidden}"),
            &inputs(DType::F16),
            (2e-2, 1e-2),
            mlp,
        );
        // Recomputing the GELU output in backward: the GPU rebuilds it from the rounded
        // pre-activation, the epilogue's came from the unrounded sum, so w_proj's gradient
        // may differ by a rounding more, inside the same tolerances.
        let recomputed = |t: &[Tensor]| t[0].mlp_gelu_recomputed(&t[1], &t[2], &t[3], &t[4]);
        for (dt, tol) in [(DType::F32, (1e-4, 1e-4)), (DType::BF16, (1e-1, 5e-2))] {
            let what = format!("mlp_gelu_recomputed {dt:?} H{hidden}");
            compare(&what, &inputs(dt), tol, recomputed);
        }
    }
}

#[test]
fn linear_in_half_precision() {
    for (dt, tol) in [(DType::F16, (1e-2, 1e-2)), (DType::BF16, (3e-2, 3e-2))] {
        let x = randn(&[9, 64], 47).to_dtype(dt).unwrap();
        let w = randn(&[24, 64], 48)
            .mul_scalar(0.125)
            .unwrap()
            .to_dtype(dt)
            .unwrap();
        let b = randn(&[24], 49).to_dtype(dt).unwrap();
        // The reference: the same rounded inputs in f32 on the CPU, rounded to dt at the end.
        let (cpu, gpu) = (
            leaves(&[x.clone(), w.clone(), b.clone()], CPU),
            leaves(&[x, w, b], GPU),
        );
        let f32s: Vec<Tensor> = cpu
            .iter()
            .map(|t| t.to_dtype(DType::F32).unwrap())
            .collect();
        let want = f32s[0].linear(&f32s[1], Some(&f32s[2])).unwrap();
        let got = gpu[0].linear(&gpu[1], Some(&gpu[2])).unwrap();
        assert_eq!(got.dtype(), dt);
        let got32 = on_cpu(&got).to_dtype(DType::F32).unwrap();
        assert_close(&format!("linear {dt}"), &got32, &want, tol.0, tol.1);
        want.sum_all().unwrap().backward().unwrap();
        got.to_dtype(DType::F32)
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        for (i, (c, g)) in cpu.iter().zip(&gpu).enumerate() {
            let gg = on_cpu(&g.grad().unwrap()).to_dtype(DType::F32).unwrap();
            let gc = c.grad().unwrap().to_dtype(DType::F32).unwrap();
            assert_close(&format!("linear {dt} grad {i}"), &gg, &gc, tol.0, tol.1);
        }
    }
}

/// Turns TF32 back off when dropped, even if the test fails.
struct Tf32Off;
impl Drop for Tf32Off {
    fn drop(&mut self) {
        set_allow_tf32(false);
    }
}

#[test]
fn tf32_switch() {
    let _g = TF32.write().unwrap_or_else(|e| e.into_inner());
    let (a, b) = (randn(&[256, 512], 50), randn(&[512, 256], 51));
    let want = a.matmul(&b).unwrap();
    let (ga, gb) = (a.to_device(GPU).unwrap(), b.to_device(GPU).unwrap());
    let exact = on_cpu(&ga.matmul(&gb).unwrap());
    assert_close("f32 GEMM, TF32 off", &exact, &want, 1e-4, 1e-5);
    let _off = Tf32Off;
    set_allow_tf32(true);
    let fast = on_cpu(&ga.matmul(&gb).unwrap());
    // TF32 keeps 10 mantissa bits: about 1e-3 relative per product, averaging out over k.
    assert_close("f32 GEMM, TF32 on", &fast, &want, 2e-2, 2e-2);
    let (e, f) = (
        exact.to_vec::<f32>().unwrap(),
        fast.to_vec::<f32>().unwrap(),
    );
    let largest = e
        .iter()
        .zip(&f)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0f32, f32::max);
    assert!(
        largest > 1e-4,
        "TF32 on gave the exact f32 result (max difference {largest}): is the switch used?"
    );
}

#[test]
fn cublas_workspace_counts_as_workspace() {
    let _g = TF32.read().unwrap_or_else(|e| e.into_inner());
    let a = randn(&[8, 8], 52).to_device(GPU).unwrap();
    a.matmul(&a).unwrap();
    let ws = memory::memory_by_category(GPU)
        .unwrap()
        .get(Category::Workspace);
    assert!(ws >= 32 << 20, "workspace bytes: {ws}");
}

// ---- SGD -------------------------------------------------------------------------------------

/// Three SGD steps of a small regression on `device`; returns the final parameters and
/// momentum buffers on the CPU.
fn sgd_run(device: Device, cfg: &SgdConfig) -> Vec<Tensor> {
    let params = leaves(&[randn(&[8, 16], 60), randn(&[8], 61)], device);
    let (x, y) = (
        randn(&[32, 16], 62).to_device(device).unwrap(),
        randn(&[32, 8], 63).to_device(device).unwrap(),
    );
    let mut opt = Sgd::new(params.clone(), cfg.clone()).unwrap();
    regression_steps(&params, &x, &y, &mut opt);
    let mut out: Vec<Tensor> = params.iter().map(|p| on_cpu(&p.detach())).collect();
    out.extend((0..2).filter_map(|i| opt.momentum_buffer(i)).map(on_cpu));
    out
}

#[test]
fn sgd_momentum_steps_match() {
    let _g = TF32.read().unwrap_or_else(|e| e.into_inner());
    let configs = [
        SgdConfig {
            lr: 0.1,
            momentum: 0.9,
            dampening: 0.1,
            weight_decay: 0.01,
            nesterov: false,
        },
        SgdConfig {
            lr: 0.05,
            momentum: 0.9,
            dampening: 0.0,
            weight_decay: 0.0,
            nesterov: true,
        },
        SgdConfig {
            lr: 0.1,
            ..SgdConfig::default()
        },
    ];
    for (k, cfg) in configs.iter().enumerate() {
        let (want, got) = (sgd_run(CPU, cfg), sgd_run(GPU, cfg));
        assert_eq!(want.len(), got.len(), "config {k}: momentum buffers");
        assert_eq!(got.len(), if cfg.momentum > 0.0 { 4 } else { 2 });
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert_close(&format!("sgd config {k} tensor {i}"), g, w, 1e-5, 1e-5);
        }
    }
}
