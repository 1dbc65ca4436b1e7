//! Index and selection ops against PyTorch: embedding, cat, split, masked_fill, where (golden
//! fixtures from tools/make_fixtures.py), finite-difference gradient checks in f64, dropout's
//! statistics and determinism, and the errors a user can trigger.
//!
//! Only `dropout_default_follows_manual_seed` touches the process-wide generator; every other
//! test draws from its own `Generator`, so tests running in parallel cannot disturb it.

use ferrograd::backend::View;
use ferrograd::backend::index::{IndexAdd, index_add};
use ferrograd::{BackwardOptions, DType, Device, Error, Generator, Tensor, manual_seed, no_grad};

const CPU: Device = Device::Cpu;

// ---- fixture loading ---------------------------------------------------------------------------

#[path = "common/fixture_file.rs"]
mod fixture_file;

fn fixtures() -> &'static fixture_file::FixtureFile {
    fixture_file::open("ops.safetensors", "ferrograd-fixtures", "make_fixtures.py")
}

/// The fixture tensor `key`, or None when the file has no such key.
fn fixture(key: &str) -> Option<Tensor> {
    fixtures().try_get(key)
}

fn assert_close(what: &str, got: &Tensor, want: &Tensor, tol: f64) {
    assert_eq!(got.shape(), want.shape(), "{what}: shape");
    let (g, w) = (got.to_vec::<f64>().unwrap(), want.to_vec::<f64>().unwrap());
    for (i, (a, b)) in g.iter().zip(&w).enumerate() {
        assert!(
            (a - b).abs() <= tol * (1.0 + b.abs()),
            "{what}[{i}]: got {a}, want {b}"
        );
    }
}

/// Case `name`: runs `f` on the fixture inputs (float ones require grad), compares every
/// output and the gradient of Σ out·gout for every float input with PyTorch's.
fn golden(name: &str, f: impl Fn(&[Tensor]) -> Vec<Tensor>) {
    let inputs: Vec<Tensor> = (0..)
        .map_while(|i| fixture(&format!("{name}.in{i}")))
        .map(|t| {
            if t.dtype().is_float() {
                t.requires_grad_(true).unwrap()
            } else {
                t
            }
        })
        .collect();
    assert!(!inputs.is_empty(), "{name}: no inputs in the fixture file");
    let outs = f(&inputs);
    let mut loss: Option<Tensor> = None;
    for (k, out) in outs.iter().enumerate() {
        let suffix = if outs.len() == 1 {
            String::new()
        } else {
            k.to_string()
        };
        let want = fixture(&format!("{name}.out{suffix}"))
            .unwrap_or_else(|| panic!("{name}.out{suffix} missing"));
        assert_close(&format!("{name}.out{suffix}"), out, &want, 1e-5);
        let gout = fixture(&format!("{name}.gout{suffix}")).unwrap();
        let term = out.mul(&gout).unwrap().sum_all().unwrap();
        loss = Some(match loss {
            None => term,
            Some(l) => l.add(&term).unwrap(),
        });
    }
    assert!(
        fixture(&format!("{name}.out{}", outs.len())).is_none(),
        "{name}: PyTorch has more outputs"
    );
    loss.unwrap().backward().unwrap();
    for (i, x) in inputs
        .iter()
        .enumerate()
        .filter(|(_, x)| x.dtype().is_float())
    {
        let want = fixture(&format!("{name}.grad{i}")).unwrap();
        let got = x
            .grad()
            .unwrap_or_else(|| panic!("{name}: input {i} got no gradient"));
        assert_close(&format!("{name}.grad{i}"), &got, &want, 1e-5);
    }
}

#[test]
fn fixture_header_names_the_format() {
    assert_eq!(fixtures().meta("format"), "ferrograd-fixtures");
    assert_eq!(fixtures().meta("version"), "1");
}

#[test]
fn golden_embedding() {
    golden("embedding", |x| vec![x[1].embedding(&x[0]).unwrap()]);
}

#[test]
fn golden_cat() {
    golden("cat", |x| vec![Tensor::cat(x, 1).unwrap()]);
}

#[test]
fn golden_split() {
    golden("split", |x| x[0].split(&[2, 3], 1).unwrap());
}

#[test]
fn golden_masked_fill() {
    golden("masked_fill", |x| {
        vec![x[0].masked_fill(&x[1], -2.0).unwrap()]
    });
}

#[test]
fn golden_where() {
    golden("where", |x| {
        vec![Tensor::where_(&x[0], &x[1], &x[2]).unwrap()]
    });
}

// ---- finite differences in f64 -------------------------------------------------------------

fn randn(shape: &[usize], rng: &mut Generator) -> Tensor {
    Tensor::randn_with(shape, DType::F64, CPU, rng).unwrap()
}

fn mask(values: &[u8], shape: &[usize]) -> Tensor {
    Tensor::from_vec(values.to_vec(), shape, CPU).unwrap()
}

fn ids(values: &[i64], shape: &[usize]) -> Tensor {
    Tensor::from_vec(values.to_vec(), shape, CPU).unwrap()
}

/// Checks the gradient of Σ f(xs)·gout for every input against central differences.
fn gradcheck(xs: &[Tensor], f: impl Fn(&[Tensor]) -> Tensor) {
    let mut rng = Generator::new(11);
    let leaves: Vec<Tensor> = xs
        .iter()
        .map(|x| x.detach().requires_grad_(true).unwrap())
        .collect();
    let out = f(&leaves);
    let gout = randn(out.shape(), &mut rng);
    out.mul(&gout)
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    let loss = |vals: &[Vec<f64>]| -> f64 {
        let _g = no_grad();
        let ts: Vec<Tensor> = vals
            .iter()
            .zip(xs)
            .map(|(v, x)| Tensor::from_vec(v.clone(), x.shape(), CPU).unwrap())
            .collect();
        f(&ts)
            .mul(&gout)
            .unwrap()
            .sum_all()
            .unwrap()
            .item()
            .unwrap()
    };
    let base: Vec<Vec<f64>> = xs.iter().map(|x| x.to_vec::<f64>().unwrap()).collect();
    let eps = 1e-6;
    for (i, leaf) in leaves.iter().enumerate() {
        let analytic = leaf.grad().expect("gradient").to_vec::<f64>().unwrap();
        for j in 0..base[i].len() {
            let mut vals = base.clone();
            vals[i][j] += eps;
            let up = loss(&vals);
            vals[i][j] -= 2.0 * eps;
            let numeric = (up - loss(&vals)) / (2.0 * eps);
            assert!(
                (numeric - analytic[j]).abs() < 1e-6,
                "input {i}[{j}]: numeric {numeric}, analytic {}",
                analytic[j]
            );
        }
    }
}

#[test]
fn gradcheck_cat() {
    let mut rng = Generator::new(1);
    let xs = [
        randn(&[2, 1], &mut rng),
        randn(&[2, 3], &mut rng),
        randn(&[2, 2], &mut rng),
    ];
    gradcheck(&xs, |x| Tensor::cat(x, -1).unwrap());
    // A transposed (strided) input along dim 0.
    let xs = [randn(&[3, 2], &mut rng), randn(&[1, 3], &mut rng)];
    gradcheck(&xs, |x| {
        Tensor::cat(&[x[0].t().unwrap(), x[1].clone()], 0).unwrap()
    });
}

#[test]
fn gradcheck_where_broadcasts_all_three() {
    let mut rng = Generator::new(2);
    let cond = mask(&[1, 0, 1], &[3, 1]);
    gradcheck(&[randn(&[1, 4], &mut rng), randn(&[4], &mut rng)], |x| {
        Tensor::where_(&cond, &x[0], &x[1]).unwrap()
    });
    let cond = mask(&[1, 0, 0, 1, 1, 0], &[2, 3]);
    gradcheck(&[randn(&[3, 2], &mut rng), randn(&[2, 3], &mut rng)], |x| {
        Tensor::where_(&cond, &x[0].t().unwrap(), &x[1]).unwrap()
    });
}

#[test]
fn gradcheck_masked_fill() {
    let mut rng = Generator::new(3);
    let m = mask(&[0, 1, 1, 0], &[4]);
    gradcheck(&[randn(&[3, 4], &mut rng)], |x| {
        x[0].masked_fill(&m, 7.0).unwrap()
    });
    // The mask is larger than the input: the output broadcasts, the gradient sums back.
    let m = mask(&[0, 1, 1, 0, 1, 0, 0, 0], &[2, 4]);
    gradcheck(&[randn(&[1, 4], &mut rng)], |x| {
        x[0].masked_fill(&m, -1.0).unwrap()
    });
}

#[test]
fn gradcheck_embedding() {
    let mut rng = Generator::new(4);
    let i = ids(&[1, 3, 1, 0, 4, 3], &[2, 3]);
    gradcheck(&[randn(&[5, 3], &mut rng)], |x| x[0].embedding(&i).unwrap());
    // A strided weight, and a gradient that reaches the backward permuted (not collapsible).
    gradcheck(&[randn(&[3, 5], &mut rng)], |x| {
        x[0].t()
            .unwrap()
            .embedding(&i)
            .unwrap()
            .transpose(0, 1)
            .unwrap()
    });
    // 0-dim ids give one row.
    let one = ids(&[2], &[]);
    gradcheck(&[randn(&[5, 3], &mut rng)], |x| {
        x[0].embedding(&one).unwrap()
    });
}

// ---- embedding, where and chunk specifics --------------------------------------------------

#[test]
fn embedding_gradient_of_a_sum_counts_ids() {
    // sum() hands back an expanded (all strides 0) gradient: the kernel reads it without a copy.
    let w = Tensor::zeros(&[5, 2], DType::F32, CPU)
        .unwrap()
        .requires_grad_(true)
        .unwrap();
    let out = w.embedding(&ids(&[1, 3, 1, 0, 4, 3], &[2, 3])).unwrap();
    assert_eq!(out.shape(), &[2, 3, 2]);
    out.sum_all().unwrap().backward().unwrap();
    let g = w.grad().unwrap().to_vec::<f32>().unwrap();
    assert_eq!(g, vec![1.0, 1.0, 2.0, 2.0, 0.0, 0.0, 2.0, 2.0, 1.0, 1.0]);
}

/// The gradient rows added in id order in f64, rounded once: what the kernel promises.
fn reference_index_add(g: &[f32], ids: &[i64], v: usize, d: usize) -> Vec<f32> {
    let mut acc = vec![0.0f64; v * d];
    for (p, &id) in ids.iter().enumerate() {
        for c in 0..d {
            acc[id as usize * d + c] += g[p * d + c] as f64;
        }
    }
    acc.into_iter().map(|x| x as f32).collect()
}

#[test]
fn embedding_backward_is_deterministic_when_parallel() {
    let (v, d, n) = (50, 8, 20_000);
    let mut rng = Generator::new(5);
    let id_values: Vec<i64> = rng
        .uniform(n, 0.0, v as f64)
        .into_iter()
        .map(|x| x as i64)
        .collect();
    let i = ids(&id_values, &[n]);
    let gout = Tensor::randn_with(&[n, d], DType::F32, CPU, &mut rng).unwrap();
    let want = reference_index_add(&gout.to_vec::<f32>().unwrap(), &id_values, v, d);
    for _ in 0..2 {
        let w = Tensor::zeros(&[v, d], DType::F32, CPU)
            .unwrap()
            .requires_grad_(true)
            .unwrap();
        let out = w.embedding(&i).unwrap();
        out.backward_with(BackwardOptions {
            gradient: Some(gout.clone()),
            ..Default::default()
        })
        .unwrap();
        assert_eq!(w.grad().unwrap().to_vec::<f32>().unwrap(), want);
    }
}

#[test]
fn index_add_kernel_rejects_bad_ids_before_writing() {
    let g = Tensor::ones(&[2, 3], DType::F32, CPU).unwrap();
    let bad = ids(&[0, 7], &[2]);
    let out = Tensor::zeros(&[4, 3], DType::F32, CPU).unwrap();
    let err = index_add(&IndexAdd {
        grad: View {
            storage: g.storage(),
            layout: g.layout(),
        },
        ids: View {
            storage: bad.storage(),
            layout: bad.layout(),
        },
        out: out.storage(),
    })
    .unwrap_err();
    match err {
        Error::Index { detail, .. } => assert!(
            detail.contains("index 7") && detail.contains("position 1"),
            "{detail}"
        ),
        other => panic!("expected an index error, got {other}"),
    }
    assert_eq!(out.to_vec::<f32>().unwrap(), vec![0.0; 12]);
}

#[test]
fn where_selects_integer_tensors_too() {
    let c = mask(&[1, 0, 1], &[3]);
    let out = Tensor::where_(&c, &ids(&[1, 2, 3], &[3]), &ids(&[-1], &[1])).unwrap();
    assert_eq!(out.to_vec::<i64>().unwrap(), vec![1, -1, 3]);
}

#[test]
fn chunk_matches_torch() {
    let x = Tensor::arange(0.0, 7.0, 1.0, DType::F32, CPU).unwrap();
    let sizes: Vec<usize> = x.chunk(3, 0).unwrap().iter().map(|t| t.numel()).collect();
    assert_eq!(sizes, vec![3, 3, 1]);
    let sizes: Vec<usize> = x
        .narrow(0, 0, 6)
        .unwrap()
        .chunk(4, 0)
        .unwrap()
        .iter()
        .map(|t| t.numel())
        .collect();
    assert_eq!(sizes, vec![2, 2, 2]);
    let pieces = x.chunk(3, 0).unwrap();
    assert_eq!(pieces[1].to_vec::<f32>().unwrap(), vec![3.0, 4.0, 5.0]);
    assert!(pieces[1].shares_storage(&x), "chunks are views");
}

// ---- dropout -------------------------------------------------------------------------------------

fn ones(n: usize, dtype: DType) -> Tensor {
    Tensor::ones(&[n], dtype, CPU).unwrap()
}

#[test]
fn dropout_same_seed_same_mask() {
    let x = ones(1000, DType::F32);
    let a = x
        .dropout(0.5, true, &mut Generator::new(42))
        .unwrap()
        .to_vec::<f32>()
        .unwrap();
    let b = x
        .dropout(0.5, true, &mut Generator::new(42))
        .unwrap()
        .to_vec::<f32>()
        .unwrap();
    let c = x
        .dropout(0.5, true, &mut Generator::new(43))
        .unwrap()
        .to_vec::<f32>()
        .unwrap();
    assert_eq!(a, b);
    assert_ne!(a, c);
}

#[test]
fn dropout_zeroes_a_fraction_p_and_scales_the_rest_exactly() {
    let n = 200_000;
    for (p, dtype) in [
        (0.1, DType::F32),
        (0.3, DType::F32),
        (0.5, DType::F64),
        (0.9, DType::F64),
    ] {
        let out = ones(n, dtype)
            .dropout(p, true, &mut Generator::new(7))
            .unwrap()
            .to_vec::<f64>()
            .unwrap();
        let zeros = out.iter().filter(|&&v| v == 0.0).count() as f64 / n as f64;
        // 6 standard deviations of a binomial fraction at n = 200k.
        assert!(
            (zeros - p).abs() < 6.0 * (p * (1.0 - p) / n as f64).sqrt(),
            "p={p}: zero fraction {zeros}"
        );
        let scale = if dtype == DType::F32 {
            (1.0 / (1.0 - p)) as f32 as f64
        } else {
            1.0 / (1.0 - p)
        };
        assert!(
            out.iter().all(|&v| v == 0.0 || v == scale),
            "p={p}: a kept value is not 1/(1-p)"
        );
    }
}

#[test]
fn dropout_gradient_is_the_mask() {
    let mut rng = Generator::new(9);
    let x = ones(64, DType::F32).requires_grad_(true).unwrap();
    let out = x.dropout(0.25, true, &mut rng).unwrap();
    let gout = Tensor::randn_with(&[64], DType::F32, CPU, &mut rng).unwrap();
    out.backward_with(BackwardOptions {
        gradient: Some(gout.clone()),
        ..Default::default()
    })
    .unwrap();
    // x = 1, so out is the mask itself.
    let mask = out.to_vec::<f32>().unwrap();
    let want: Vec<f32> = mask
        .iter()
        .zip(gout.to_vec::<f32>().unwrap())
        .map(|(m, g)| m * g)
        .collect();
    assert_eq!(x.grad().unwrap().to_vec::<f32>().unwrap(), want);
    assert!(mask.contains(&0.0) && mask.contains(&(1.0 / 0.75)));
}

#[test]
fn dropout_identity_and_all_zero_cases() {
    let mut rng = Generator::new(10);
    let x = Tensor::randn_with(&[3, 4], DType::F32, CPU, &mut rng).unwrap();
    assert!(x.dropout(0.0, true, &mut rng).unwrap().shares_storage(&x));
    assert!(x.dropout(0.7, false, &mut rng).unwrap().shares_storage(&x));
    let leaf = x.detach().requires_grad_(true).unwrap();
    let out = leaf.dropout(1.0, true, &mut rng).unwrap();
    assert_eq!(out.to_vec::<f32>().unwrap(), vec![0.0; 12]);
    out.sum_all().unwrap().backward().unwrap();
    assert_eq!(leaf.grad().unwrap().to_vec::<f32>().unwrap(), vec![0.0; 12]);
}

#[test]
fn dropout_default_follows_manual_seed() {
    let x = ones(500, DType::F32);
    manual_seed(123);
    let a = x
        .dropout_default(0.5, true)
        .unwrap()
        .to_vec::<f32>()
        .unwrap();
    let a2 = x
        .dropout_default(0.5, true)
        .unwrap()
        .to_vec::<f32>()
        .unwrap();
    manual_seed(123);
    let b = x
        .dropout_default(0.5, true)
        .unwrap()
        .to_vec::<f32>()
        .unwrap();
    assert_eq!(a, b);
    assert_ne!(a, a2, "the default generator advances between calls");
}

// ---- errors --------------------------------------------------------------------------------------

fn w(shape: &[usize]) -> Tensor {
    Tensor::zeros(shape, DType::F32, CPU).unwrap()
}

#[test]
fn embedding_errors() {
    let weight = w(&[10, 4]);
    match weight.embedding(&ids(&[3, 10], &[2])).unwrap_err() {
        Error::Index { op, detail } => {
            assert_eq!(op, "embedding");
            assert!(
                detail.contains("index 10") && detail.contains("0..10"),
                "{detail}"
            );
        }
        other => panic!("expected an index error, got {other}"),
    }
    assert!(matches!(
        weight.embedding(&ids(&[-1], &[1])).unwrap_err(),
        Error::Index { .. }
    ));
    assert!(matches!(
        weight.embedding(&mask(&[1], &[1])).unwrap_err(),
        Error::UnsupportedDType { .. }
    ));
    assert!(matches!(
        w(&[10]).embedding(&ids(&[1], &[1])).unwrap_err(),
        Error::Shape { .. }
    ));
}

#[test]
fn cat_and_split_errors() {
    assert!(matches!(
        Tensor::cat(&[w(&[2, 3]), w(&[3, 3])], 1).unwrap_err(),
        Error::Shape { .. }
    ));
    assert!(matches!(
        Tensor::cat(&[w(&[2, 3]), w(&[2, 3, 1])], 0).unwrap_err(),
        Error::Shape { .. }
    ));
    assert!(matches!(
        Tensor::cat(&[], 0).unwrap_err(),
        Error::InvalidArgument { .. }
    ));
    assert!(matches!(
        Tensor::cat(&[w(&[2, 3])], 2).unwrap_err(),
        Error::Index { .. }
    ));
    let f64s = Tensor::zeros(&[2, 3], DType::F64, CPU).unwrap();
    assert!(matches!(
        Tensor::cat(&[w(&[2, 3]), f64s], 0).unwrap_err(),
        Error::DType { .. }
    ));
    assert!(matches!(
        w(&[2, 5]).split(&[2, 2], 1).unwrap_err(),
        Error::Shape { .. }
    ));
    assert!(w(&[2, 5]).chunk(0, 1).is_err());
}

#[test]
fn where_and_masked_fill_errors() {
    let float_cond = w(&[3]);
    assert!(matches!(
        Tensor::where_(&float_cond, &w(&[3]), &w(&[3])).unwrap_err(),
        Error::UnsupportedDType { .. }
    ));
    assert!(matches!(
        Tensor::where_(&mask(&[1, 0], &[2]), &w(&[3]), &w(&[3])).unwrap_err(),
        Error::Shape { .. }
    ));
    assert!(matches!(
        w(&[3, 4])
            .masked_fill(&mask(&[1, 0, 1], &[3]), 0.0)
            .unwrap_err(),
        Error::Shape { .. }
    ));
    assert!(matches!(
        w(&[3])
            .masked_fill(&ids(&[1, 0, 1], &[3]), 0.0)
            .unwrap_err(),
        Error::UnsupportedDType { .. }
    ));
}

#[test]
fn dropout_rejects_bad_p() {
    let x = w(&[4]);
    for p in [-0.1, 1.5, f64::NAN] {
        let err = x.dropout(p, true, &mut Generator::new(0)).unwrap_err();
        assert!(matches!(err, Error::InvalidArgument { .. }), "p={p}");
    }
    let int = ids(&[1], &[1]);
    assert!(matches!(
        int.dropout(0.5, true, &mut Generator::new(0)).unwrap_err(),
        Error::UnsupportedDType { .. }
    ));
}
