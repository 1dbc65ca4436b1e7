//! `gelu_linear`: GELU then a Linear as one op that saves the GELU's input only. Its output
//! and every gradient are the two ops' bit for bit (with and without a bias, a frozen weight,
//! both GELU forms, under bf16 autocast), it holds exactly the GELU output's bytes less
//! between forward and backward, and create_graph through it is a clear error. The fused MLP
//! op that recomputes its GELU output (`mlp_gelu_recomputed`) is likewise the saving op's bit
//! for bit on the CPU, holding exactly that output's bytes less.

use std::sync::{Mutex, MutexGuard};

use ferrograd::amp::{AmpDType, autocast};
use ferrograd::memory::memory_allocated;
use ferrograd::ops::GeluApprox;
use ferrograd::{BackwardOptions, DType, Device, Generator, Tensor};

const CPU: Device = Device::Cpu;
const IN: usize = 24;
const OUT: usize = 10;

/// The allocator is process-wide: each test runs alone so the memory test sees its own bytes.
static LOCK: Mutex<()> = Mutex::new(());

fn lock() -> MutexGuard<'static, ()> {
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

fn leaf(shape: &[usize], dtype: DType, seed: u64, grad: bool) -> Tensor {
    Tensor::randn_with(shape, DType::F32, CPU, &mut Generator::new(seed))
        .unwrap()
        .to_dtype(dtype)
        .unwrap()
        .requires_grad_(grad)
        .unwrap()
}

fn bits(t: &Tensor) -> Vec<u64> {
    let v = t.to_dtype(DType::F64).unwrap().to_vec::<f64>().unwrap();
    v.into_iter().map(f64::to_bits).collect()
}

/// One way of computing the layer; the inputs (pre, weight, bias).
type Layer = fn(&Tensor, &Tensor, Option<&Tensor>, GeluApprox) -> ferrograd::Result<Tensor>;

fn fused(p: &Tensor, w: &Tensor, b: Option<&Tensor>, a: GeluApprox) -> ferrograd::Result<Tensor> {
    p.gelu_linear(a, w, b)
}

fn composed(
    p: &Tensor,
    w: &Tensor,
    b: Option<&Tensor>,
    a: GeluApprox,
) -> ferrograd::Result<Tensor> {
    p.gelu(a)?.linear(w, b)
}

/// The output, then the gradients of pre, weight and bias (empty where there is none).
fn run(layer: Layer, dtype: DType, bias: bool, frozen: bool, approx: GeluApprox) -> Vec<Vec<u64>> {
    let pre = leaf(&[3, 5, IN], dtype, 1, true);
    let w = leaf(&[OUT, IN], dtype, 2, !frozen);
    let b = bias.then(|| leaf(&[OUT], dtype, 3, true));
    let y = layer(&pre, &w, b.as_ref(), approx).unwrap();
    let gy = leaf(&[3, 5, OUT], y.dtype(), 4, false);
    y.backward_with(BackwardOptions {
        gradient: Some(gy),
        ..Default::default()
    })
    .unwrap();
    let grad = |t: Option<&Tensor>| {
        t.and_then(Tensor::grad)
            .map(|g| bits(&g))
            .unwrap_or_default()
    };
    vec![bits(&y), grad(Some(&pre)), grad(Some(&w)), grad(b.as_ref())]
}

#[test]
fn output_and_gradients_are_the_two_ops_bit_for_bit() {
    let _alone = lock();
    for dtype in [DType::F32, DType::BF16, DType::F64] {
        for (bias, frozen) in [(true, false), (false, false), (true, true)] {
            for approx in [GeluApprox::Tanh, GeluApprox::None] {
                let want = run(composed, dtype, bias, frozen, approx);
                let got = run(fused, dtype, bias, frozen, approx);
                let what = format!("{dtype:?} bias {bias} frozen {frozen} {approx:?}");
                for (i, name) in ["output", "pre.grad", "weight.grad", "bias.grad"]
                    .iter()
                    .enumerate()
                {
                    assert_eq!(got[i], want[i], "{what}: {name}");
                }
                assert!(!got[1].is_empty() && frozen == got[2].is_empty(), "{what}");
            }
        }
    }
}

#[test]
fn under_autocast_it_casts_the_weight_as_linear_does() {
    let _alone = lock();
    // A bf16 pre-activation (a Linear's output in the region) with f32 parameters.
    let both = |layer: Layer| {
        let _region = autocast(AmpDType::BF16);
        run(layer, DType::BF16, true, false, GeluApprox::Tanh)
    };
    assert_eq!(both(fused), both(composed));
    // An f32 pre-activation: autocast casts the GELU's output, so the op is the composition.
    let f32_pre = |layer: Layer| {
        let _region = autocast(AmpDType::BF16);
        run(layer, DType::F32, true, false, GeluApprox::Tanh)
    };
    assert_eq!(f32_pre(fused), f32_pre(composed));
}

#[test]
fn it_holds_the_gelu_outputs_bytes_less_until_backward() {
    let _alone = lock();
    let held = |layer: Layer| {
        let pre = leaf(&[3, 5, IN], DType::F32, 1, true);
        let w = leaf(&[OUT, IN], DType::F32, 2, true);
        let base = memory_allocated(CPU).unwrap();
        let y = layer(&pre, &w, None, GeluApprox::Tanh).unwrap();
        let bytes = memory_allocated(CPU).unwrap() - base;
        drop(y);
        bytes
    };
    let gelu_out = (3 * 5 * IN * 4) as u64;
    assert_eq!(held(composed) - held(fused), gelu_out);
}

#[test]
fn create_graph_through_it_is_an_error_naming_it() {
    let _alone = lock();
    let pre = leaf(&[2, IN], DType::F32, 1, true);
    let w = leaf(&[OUT, IN], DType::F32, 2, true);
    let loss = pre
        .gelu_linear(GeluApprox::Tanh, &w, None)
        .unwrap()
        .sum_all()
        .unwrap();
    let err = loss
        .backward_with(BackwardOptions {
            create_graph: true,
            ..Default::default()
        })
        .unwrap_err()
        .to_string();
    assert!(err.contains("gelu_linear"), "{err}");
}

/// The fused MLP's hidden width.
const HIDDEN: usize = 32;

/// The MLP op's output, then the gradients of x, w_fc, b_fc, w_proj and b_proj.
fn mlp_run(recompute: bool, dtype: DType) -> Vec<Vec<u64>> {
    let x = leaf(&[3, 5, IN], dtype, 1, true);
    let p = [
        leaf(&[HIDDEN, IN], dtype, 2, true),
        leaf(&[HIDDEN], dtype, 3, true),
        leaf(&[OUT, HIDDEN], dtype, 4, true),
        leaf(&[OUT], dtype, 5, true),
    ];
    let y = if recompute {
        x.mlp_gelu_recomputed(&p[0], &p[1], &p[2], &p[3])
    } else {
        x.mlp_gelu(&p[0], &p[1], &p[2], &p[3])
    }
    .unwrap();
    let gy = leaf(&[3, 5, OUT], y.dtype(), 6, false);
    y.backward_with(BackwardOptions {
        gradient: Some(gy),
        ..Default::default()
    })
    .unwrap();
    let mut out = vec![bits(&y)];
    for t in std::iter::once(&x).chain(&p) {
        out.push(bits(&t.grad().expect("every input has a gradient")));
    }
    out
}

#[test]
fn the_mlp_op_recomputing_its_gelu_output_matches_the_saving_one_bit_for_bit() {
    let _alone = lock();
    for dtype in [DType::F32, DType::BF16, DType::F64] {
        let (got, want) = (mlp_run(true, dtype), mlp_run(false, dtype));
        assert_eq!(got, want, "{dtype:?}");
    }
    // f32 parameters cast by the region, as a GPT's under autocast.
    let region = |recompute| {
        let _region = autocast(AmpDType::BF16);
        mlp_run(recompute, DType::F32)
    };
    assert_eq!(region(true), region(false));
}

#[test]
fn the_recomputing_mlp_op_holds_the_gelu_outputs_bytes_less_until_backward() {
    let _alone = lock();
    let held = |recompute: bool| {
        let x = leaf(&[3, 5, IN], DType::F32, 1, true);
        let w_fc = leaf(&[HIDDEN, IN], DType::F32, 2, true);
        let b_fc = leaf(&[HIDDEN], DType::F32, 3, true);
        let w_proj = leaf(&[OUT, HIDDEN], DType::F32, 4, true);
        let b_proj = leaf(&[OUT], DType::F32, 5, true);
        let base = memory_allocated(CPU).unwrap();
        let y = if recompute {
            x.mlp_gelu_recomputed(&w_fc, &b_fc, &w_proj, &b_proj)
        } else {
            x.mlp_gelu(&w_fc, &b_fc, &w_proj, &b_proj)
        }
        .unwrap();
        let bytes = memory_allocated(CPU).unwrap() - base;
        drop(y);
        bytes
    };
    let gelu_out = (3 * 5 * HIDDEN * 4) as u64;
    assert_eq!(held(false) - held(true), gelu_out);
}
