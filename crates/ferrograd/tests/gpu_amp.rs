//! Autocast on cuda:0 against the CPU and PyTorch: the three op chains of the autocast
//! fixtures (linear → GELU → linear → MSE; matmul → softmax → matmul; LayerNorm → linear →
//! cross-entropy) under bf16 and f16, with the dtype of every intermediate, f32 master
//! gradients that stay on the GPU, and a tiny GPT step under bf16. Needs a CUDA device:
//! without one every test fails.
#![cfg(feature = "gpu-tests")]

mod amp_chains;
mod common;

use amp_chains::{
    CHAINS, assert_close, assert_steps_agree, case_name, chains_match_pytorch, gpt_step, run_chain,
    tol,
};
use common::assert_same_bits;
use ferrograd::amp::AmpDType;
use ferrograd::{DType, Device, Generator, Tensor};

const GPU: Device = Device::Cuda(0);
const CPU: Device = Device::Cpu;

#[test]
fn chains_match_pytorch_bf16() {
    chains_match_pytorch(AmpDType::BF16, GPU);
}

#[test]
fn chains_match_pytorch_f16() {
    chains_match_pytorch(AmpDType::F16, GPU);
}

/// Every chain on the GPU against the same chain on the CPU (same policy, same dtypes).
fn chains_match_the_cpu(amp: AmpDType) {
    let t = tol(amp.dtype());
    for (chain, f) in CHAINS {
        let case = case_name(chain, amp.dtype());
        let (gpu_outs, gpu_grads) = run_chain(f, &case, amp, GPU);
        let (cpu_outs, cpu_grads) = run_chain(f, &case, amp, CPU);
        for ((name, g), (_, c)) in gpu_outs.iter().zip(&cpu_outs) {
            assert_eq!(g.dtype(), c.dtype(), "{case}.{name}: dtype on the CPU");
            assert_close(&format!("{case}.{name} GPU vs CPU"), g, c, t);
        }
        assert_eq!(gpu_grads.len(), cpu_grads.len(), "{case}: gradients");
        for (name, g) in &gpu_grads {
            let c = &cpu_grads[name];
            assert_close(&format!("{case}.grad.{name} GPU vs CPU"), g, c, t);
        }
    }
}

/// The multi-tensor cast (one launch per dtype pair) gives the CPU's casts bit for bit: sizes
/// around its 4096-element chunks, a strided view (cast one at a time), f16 and bf16.
#[test]
fn to_dtype_many_equals_the_cpus_casts() {
    for dt in [DType::BF16, DType::F16] {
        let mut rng = Generator::new(31);
        let shapes: [&[usize]; 7] = [
            &[1],
            &[4095],
            &[4096],
            &[4097],
            &[3 * 4096 + 5],
            &[10_000],
            &[33, 65],
        ];
        let cpu: Vec<Tensor> = shapes
            .iter()
            .map(|s| Tensor::randn_with(s, DType::F32, CPU, &mut rng).unwrap())
            .collect();
        let mut gpu: Vec<Tensor> = cpu.iter().map(|t| t.to_device(GPU).unwrap()).collect();
        let last = gpu.len() - 1;
        gpu[last] = gpu[last].transpose(0, 1).unwrap();
        let want: Vec<Tensor> = cpu
            .iter()
            .enumerate()
            .map(|(k, t)| match k == last {
                true => t.transpose(0, 1).unwrap().to_dtype(dt).unwrap(),
                false => t.to_dtype(dt).unwrap(),
            })
            .collect();
        let got = Tensor::to_dtype_many(&gpu, dt).unwrap();
        for (k, (g, w)) in got.iter().zip(&want).enumerate() {
            assert_eq!(g.device(), GPU);
            assert_same_bits(&format!("{dt} tensor {k}"), &g.to_device(CPU).unwrap(), w);
        }
    }
}

#[test]
fn chains_match_the_cpu_bf16() {
    chains_match_the_cpu(AmpDType::BF16);
}

#[test]
fn chains_match_the_cpu_f16() {
    chains_match_the_cpu(AmpDType::F16);
}

#[test]
fn tiny_gpt_bf16_step_matches_the_cpu() {
    // Both devices round to bf16 at the same places, in another summation order.
    let gpu = gpt_step(Some(AmpDType::BF16), GPU);
    let cpu = gpt_step(Some(AmpDType::BF16), CPU);
    assert_steps_agree(&gpu, &cpu);
}

// ---- parameter gradients in f32, straight from the GEMMs ---------------------------------

/// Bounds for an f32 result of half operands on two devices: the same products, summed in
/// f32 in another order.
const F32_SUMS: (f64, f64) = (1e-4, 1e-5);

/// `shape` drawn on the CPU in `dtype`, then moved to `device` (both devices see the same
/// values).
fn draw(shape: &[usize], dtype: DType, seed: u64, device: Device) -> Tensor {
    let mut g = Generator::new(seed);
    Tensor::randn_with(shape, DType::F32, CPU, &mut g)
        .unwrap()
        .to_dtype(dtype)
        .unwrap()
        .to_device(device)
        .unwrap_or_else(|e| panic!("these tests need a CUDA device (cuda:0): {e}"))
}

/// An f32 leaf that requires grad (a parameter), the same values on every device.
fn param_on(shape: &[usize], seed: u64, device: Device) -> Tensor {
    draw(shape, DType::F32, seed, device)
        .detach()
        .requires_grad_(true)
        .unwrap()
}

fn host(t: &Tensor) -> Tensor {
    t.to_device(CPU).unwrap()
}

fn backend_view(t: &Tensor) -> ferrograd::backend::View<'_> {
    ferrograd::backend::View {
        storage: t.storage(),
        layout: t.layout(),
    }
}

/// The ops that allocated on `device` while `f` ran (the memory recorder's events).
fn ops_allocating(device: Device, f: impl FnOnce()) -> Vec<(&'static str, u64)> {
    use ferrograd::memory::recorder::{self, Action, RecorderConfig};
    recorder::start(RecorderConfig { capacity: 1 << 16 }).unwrap();
    f();
    let rec = recorder::stop().unwrap();
    rec.events
        .iter()
        .filter(|e| e.device == device && e.action == Action::Alloc)
        .map(|e| (e.origin.op, e.requested))
        .collect()
}

/// Asserts `t` (f32) holds some value that bf16 cannot: it was not rounded to bf16.
fn assert_not_bf16_rounded(what: &str, t: &Tensor) {
    assert_eq!(t.dtype(), DType::F32, "{what}");
    let v = host(t).to_vec::<f32>().unwrap();
    assert!(
        v.iter().any(|&x| half::bf16::from_f32(x).to_f32() != x),
        "{what}: every element is a bf16 value"
    );
}

/// cuBLAS and cuBLASLt write f32 outputs of bf16 and f16 operands: the plain product (a
/// transposed operand, a batch with a broadcast operand), the accumulating one (beta 1) and
/// the bias-gradient epilogue (BGRADB, its sums f32): each as the CPU's f32 product of the
/// widened operands, to the order of the sums, and not rounded to half.
#[test]
fn half_gemms_write_f32_outputs_as_the_cpu() {
    use ferrograd::backend::MatmulSpec;
    use ferrograd::backend::matmul::{matmul, matmul_acc, matmul_row_sums};
    let (m, n, k) = (48, 40, 96);
    for half in [DType::BF16, DType::F16] {
        let run = |device: Device| {
            // a read transposed: (k, m) storage.
            let at = draw(&[k, m], half, 1, device);
            let a = at.t().unwrap();
            let b = draw(&[k, n], half, 2, device);
            let spec = MatmulSpec { batch: 1, m, n, k };
            let out = Tensor::zeros(&[m, n], DType::F32, device).unwrap();
            matmul(&spec, backend_view(&a), backend_view(&b), out.storage()).unwrap();
            let acc = out.mul_scalar(1.0).unwrap();
            matmul_acc(
                &spec,
                backend_view(&a),
                backend_view(&b),
                acc.storage(),
                1.0,
            )
            .unwrap();
            let fused = Tensor::zeros(&[m, n], DType::F32, device).unwrap();
            let sums = Tensor::zeros(&[m], DType::F32, device).unwrap();
            let (va, vb) = (backend_view(&a), backend_view(&b));
            let did = matmul_row_sums(&spec, va, vb, fused.storage(), sums.storage()).unwrap();
            // A batch of 3 with b broadcast (stride 0).
            let a3 = draw(&[3, m, k], half, 3, device);
            let b3 = b.unsqueeze(0).unwrap().expand(&[3, k, n]).unwrap();
            let batched = Tensor::zeros(&[3, m, n], DType::F32, device).unwrap();
            let spec3 = MatmulSpec { batch: 3, m, n, k };
            let (va3, vb3) = (backend_view(&a3), backend_view(&b3));
            matmul(&spec3, va3, vb3, batched.storage()).unwrap();
            (out, acc, (did, fused, sums), batched)
        };
        let (gpu, cpu) = (run(GPU), run(CPU));
        assert!(
            gpu.2.0,
            "{half}: cuBLASLt took no BGRADB algorithm for an f32 output"
        );
        assert!(!cpu.2.0, "the CPU does not fuse the row sums");
        assert_close(&format!("{half} product"), &host(&gpu.0), &cpu.0, F32_SUMS);
        assert_not_bf16_rounded(&format!("{half} product"), &gpu.0);
        let twice = cpu.0.mul_scalar(2.0).unwrap();
        assert_close(
            &format!("{half} accumulated"),
            &host(&gpu.1),
            &twice,
            F32_SUMS,
        );
        assert_close(
            &format!("{half} fused product"),
            &host(&gpu.2.1),
            &cpu.0,
            F32_SUMS,
        );
        let a = draw(&[k, m], half, 1, CPU).to_dtype(DType::F32).unwrap();
        let want_sums = a.sum(&[0], false).unwrap();
        assert_close(
            &format!("{half} row sums"),
            &host(&gpu.2.2),
            &want_sums,
            F32_SUMS,
        );
        assert_not_bf16_rounded(&format!("{half} row sums"), &gpu.2.2);
        assert_close(&format!("{half} batched"), &host(&gpu.3), &cpu.3, F32_SUMS);
    }
}

/// A linear layer on f32 parameters in a bf16 region: on the GPU dW comes from a GEMM with an
/// f32 output and db from a column sum of g into f32 (or both from one BGRADB GEMM, with
/// `FERROGRAD_BIAS_GRAD_EPILOGUE=1`), with no cast's backward and no bf16 gradient of either
/// allocated, and equal the CPU's f32 gradients to the order of the sums.
#[test]
fn linear_parameter_gradients_are_f32_gemm_outputs_as_the_cpu() {
    let (n, i, o) = (64, 96, 80);
    let run = |device: Device| {
        let x = draw(&[n, i], DType::BF16, 11, device);
        let g = draw(&[n, o], DType::BF16, 12, device);
        let (w, b) = (param_on(&[o, i], 13, device), param_on(&[o], 14, device));
        let _amp = ferrograd::amp::autocast(AmpDType::BF16);
        let y = x.linear(&w, Some(&b)).unwrap();
        let events = ops_allocating(device, || {
            y.backward_with(ferrograd::autograd::BackwardOptions {
                gradient: Some(g.clone()),
                ..Default::default()
            })
            .unwrap()
        });
        (w.grad().unwrap(), b.grad().unwrap(), events)
    };
    let (gpu, cpu) = (run(GPU), run(CPU));
    let events = &gpu.2;
    assert!(
        !events.iter().any(|(op, _)| *op == "to_dtype"),
        "{events:?}"
    );
    for half in [o * i * 2, o * 2] {
        assert!(
            !events.iter().any(|&(_, r)| r == half as u64),
            "a bf16 parameter gradient of {half} bytes: {events:?}"
        );
    }
    for (name, got, want) in [("w", &gpu.0, &cpu.0), ("b", &gpu.1, &cpu.1)] {
        assert_eq!(
            (got.dtype(), got.device()),
            (DType::F32, GPU),
            "{name}.grad"
        );
        assert_close(
            &format!("{name}.grad GPU vs CPU"),
            &host(got),
            want,
            F32_SUMS,
        );
        assert_not_bf16_rounded(&format!("{name}.grad"), got);
    }
}

/// The fused MLP on f32 parameters in a bf16 region on the GPU (GELU and DGELU epilogues,
/// bias gradients summed into f32): every parameter gradient f32, no cast's backward, and the CPU's
/// gradients within bf16 rounding of their largest: the GPU rounds the GELU's input gradient
/// once (in the epilogue) where the CPU rounds the product and then the product times
/// gelu'(pre), so the weight gradients (sums over rows) differ most where terms cancel. The
/// weights are scaled as a trained MLP's are, so the GELU works across its curve.
#[test]
fn fused_mlp_parameter_gradients_are_f32_as_the_cpu() {
    let (rows, c, h) = (64, 64, 256);
    let shapes: [&[usize]; 4] = [&[h, c], &[h], &[c, h], &[c]];
    let run = |device: Device| {
        let x = draw(&[rows, c], DType::BF16, 21, device);
        let g = draw(&[rows, c], DType::BF16, 22, device);
        let scales = [0.2, 1.0, 0.1, 1.0];
        let p: Vec<Tensor> = (0..4)
            .map(|k| {
                draw(shapes[k], DType::F32, 23 + k as u64, device)
                    .mul_scalar(scales[k])
                    .unwrap()
                    .requires_grad_(true)
                    .unwrap()
            })
            .collect();
        let _amp = ferrograd::amp::autocast(AmpDType::BF16);
        let y = x.mlp_gelu(&p[0], &p[1], &p[2], &p[3]).unwrap();
        let events = ops_allocating(device, || {
            y.backward_with(ferrograd::autograd::BackwardOptions {
                gradient: Some(g.clone()),
                ..Default::default()
            })
            .unwrap()
        });
        let grads: Vec<Tensor> = p.iter().map(|t| t.grad().unwrap()).collect();
        (grads, events)
    };
    let (gpu, cpu) = (run(GPU), run(CPU));
    assert!(
        !gpu.1.iter().any(|(op, _)| *op == "to_dtype"),
        "{:?}",
        gpu.1
    );
    let names = ["w_fc", "b_fc", "w_proj", "b_proj"];
    for (k, (got, want)) in gpu.0.iter().zip(&cpu.0).enumerate() {
        assert_eq!(
            (got.dtype(), got.device()),
            (DType::F32, GPU),
            "{}",
            names[k]
        );
        // Rounding differences of bf16 summands scale with the largest gradient, not with the
        // element (a sum that cancels keeps its terms' error): 4% of the largest, twice the
        // 2.1% an H100 showed.
        let largest = want
            .to_vec::<f64>()
            .unwrap()
            .iter()
            .fold(0.0f64, |m, v| m.max(v.abs()));
        assert_close(names[k], &host(got), want, (0.04 * largest, 5e-2));
    }
    assert_not_bf16_rounded("w_proj.grad", &gpu.0[2]);
}

/// GPT-2's tie on the GPU: the embedding's f32 gradient and the fused classifier's bf16 dw
/// (summed over chunks at a padded vocabulary width, then cast back once: it is held from the
/// forward to backward, and in f32 it would raise the step's peak) add up in the one f32 leaf
/// as on the CPU.
#[test]
fn tied_classifier_weight_gradient_is_the_cpus() {
    let (v, c, rows) = (1100, 64, 48);
    let ids: Vec<i64> = (0..rows as i64).map(|r| (r * 37) % v as i64).collect();
    let targets: Vec<i64> = (0..rows as i64)
        .map(|r| {
            if r % 7 == 3 {
                -100
            } else {
                (r * 11 + 5) % v as i64
            }
        })
        .collect();
    let run = |device: Device| {
        let ids = Tensor::from_vec(ids.clone(), &[rows], device).unwrap();
        let targets = Tensor::from_vec(targets.clone(), &[rows], device).unwrap();
        let wte = param_on(&[v, c], 31, device);
        let _amp = ferrograd::amp::autocast(AmpDType::BF16);
        let h = wte.embedding(&ids).unwrap();
        // Two chunks: dw sums them.
        let chunk = (rows / 2) * 1152 * 2;
        let loss = h
            .linear_cross_entropy_in_chunks(&wte, &targets, -100, chunk)
            .unwrap();
        let events = ops_allocating(device, || loss.backward().unwrap());
        (wte.grad().unwrap(), events)
    };
    let (gpu, cpu) = (run(GPU), run(CPU));
    let casts = |bytes: usize| {
        gpu.1
            .iter()
            .filter(|e| **e == ("to_dtype", bytes as u64))
            .count()
    };
    assert_eq!(casts(v * c * 4), 1, "one cast of dw to f32: {:?}", gpu.1);
    assert_eq!(casts(v * c * 2), 0, "no cast to bf16: {:?}", gpu.1);
    assert_eq!((gpu.0.dtype(), gpu.0.device()), (DType::F32, GPU));
    assert_close(
        "wte.grad GPU vs CPU",
        &host(&gpu.0),
        &cpu.0,
        tol(DType::BF16),
    );
}

/// The residual add fused into the norm after it, f32 stream and bf16 branch, on the GPU: the
/// norm's backward writes the stream's gradient and its bf16 rounding (in the same kernel at
/// rows a warp holds, 768; converted after it at 1100), and the branch's gradient is x.grad
/// rounded, bit for bit, with no cast of its own.
#[test]
fn the_residual_branch_gradient_comes_from_the_norm_backward() {
    for n in [768usize, 1100] {
        let x = param_on(&[9, n], 71, GPU);
        let h = draw(&[9, n], DType::BF16, 72, GPU)
            .requires_grad_(true)
            .unwrap();
        let (w, b) = (param_on(&[n], 73, GPU), param_on(&[n], 74, GPU));
        let c = draw(&[9, n], DType::F32, 75, GPU);
        let (s, y) = x
            .add_layer_norm_to(&h, &[n], Some(&w), Some(&b), 1e-5, DType::BF16)
            .unwrap();
        let loss = y
            .sum_all()
            .unwrap()
            .to_dtype(DType::F32)
            .unwrap()
            .add(&s.mul(&c).unwrap().sum_all().unwrap())
            .unwrap();
        let events = ops_allocating(GPU, || loss.backward().unwrap());
        let half_bytes = (9 * n * 2) as u64;
        assert!(
            !events.contains(&("to_dtype", half_bytes)),
            "n={n}: a cast of the branch's gradient: {events:?}"
        );
        let want = x.grad().unwrap().to_dtype(DType::BF16).unwrap();
        let bits = |t: &Tensor| {
            host(t)
                .to_dtype(DType::F32)
                .unwrap()
                .to_vec::<f32>()
                .unwrap()
        };
        assert_eq!(bits(&h.grad().unwrap()), bits(&want), "n={n}");
    }
}
