//! Data-parallel training on the in-process group (ranks as threads): the collectives, DDP
//! and ZeRO-1 against one process stepping on the whole batch, PyTorch's bucket assignment
//! (fixture from tools/make_ddp_bucket_fixture.py), and the bytes gradients and sharded
//! optimizer state take. Every test takes `LOCK`: the CPU allocator is shared by all threads,
//! and the byte counts below must see only their own ranks.

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use ferrograd::autograd::no_grad;
use ferrograd::dist::{
    BucketItem, Ddp, DdpConfig, InProcessGroup, ProcessGroup, ReduceOp, Zero1, bucket_assignment,
};
use ferrograd::memory::{self, Category};
use ferrograd::nn::{Linear, Module, Relu, Sequential};
use ferrograd::optim::{Adam, AdamConfig, AdamState, Optimizer, Sgd, SgdConfig};
use ferrograd::train::{MicroBatch, Trainer, TrainerConfig};
use ferrograd::{DType, Device, Generator, Result, Tensor};

static LOCK: Mutex<()> = Mutex::new(());

fn lock() -> MutexGuard<'static, ()> {
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

const CPU: Device = Device::Cpu;
/// Rows of the whole batch: every world size tested divides it.
const BATCH: usize = 8;
const IN: usize = 5;
const OUT: usize = 3;

// ---- models and data ------------------------------------------------------------------

/// Every parameter tensor's values, in the module's order.
type Params = Vec<Vec<f64>>;

/// Linear(5, 16) → ReLU → Linear(16, 7) → ReLU → Linear(7, 3): parameters of mixed sizes.
fn mlp(dtype: DType, seed: u64) -> Sequential {
    let mut g = Generator::new(seed);
    let mut lin = |i, o| Linear::new_with_dtype(i, o, true, dtype, CPU, &mut g).unwrap();
    Sequential::new()
        .push(lin(IN, 16))
        .push(Relu)
        .push(lin(16, 7))
        .push(Relu)
        .push(lin(7, OUT))
}

/// The whole batch: x (BATCH, IN), target (BATCH, OUT), fixed values.
fn batch(dtype: DType) -> (Tensor, Tensor) {
    let mut g = Generator::new(99);
    let x = Tensor::randn_with(&[BATCH, IN], dtype, CPU, &mut g).unwrap();
    let t = Tensor::randn_with(&[BATCH, OUT], dtype, CPU, &mut g).unwrap();
    (x, t)
}

/// Rows [rank·n, (rank+1)·n) of `t` with n = rows / parts, as an owned tensor.
fn rows(t: &Tensor, part: usize, parts: usize) -> Tensor {
    let n = t.shape()[0] / parts;
    t.narrow(0, part * n, n).unwrap().contiguous().unwrap()
}

fn values(m: &dyn Module) -> Params {
    m.parameters()
        .iter()
        .map(|p| p.to_vec::<f64>().unwrap())
        .collect()
}

fn sgd(m: &dyn Module) -> Sgd {
    let cfg = SgdConfig {
        lr: 0.1,
        ..SgdConfig::default()
    };
    Sgd::new(m.parameters(), cfg).unwrap()
}

/// One process, one step of `opt` on the whole batch (x, t), gradients cleared after it.
fn whole_batch_step(model: &dyn Module, opt: &mut dyn Optimizer, x: &Tensor, t: &Tensor) {
    let loss = model.forward(x).unwrap().mse_loss(t).unwrap();
    loss.backward().unwrap();
    opt.step().unwrap();
    opt.zero_grad().unwrap();
}

/// One process, one SGD step on the whole batch: the parameters before and after.
fn single_sgd_step(dtype: DType) -> (Params, Params) {
    let model = mlp(dtype, 0);
    let before = values(&model);
    let (x, t) = batch(dtype);
    let mut opt = sgd(&model);
    whole_batch_step(&model, &mut opt, &x, &t);
    (before, values(&model))
}

// ---- comparisons ----------------------------------------------------------------------

/// Every rank holds bitwise the same parameters.
fn assert_identical_on_ranks(per_rank: &[Params]) {
    for (r, p) in per_rank.iter().enumerate().skip(1) {
        assert!(
            p == &per_rank[0],
            "rank {r}'s parameters differ from rank 0's"
        );
    }
}

/// |got − want| ≤ rtol · max(|want|, mean |want| of the tensor), per parameter tensor.
fn assert_close(what: &str, got: &[Vec<f64>], want: &[Vec<f64>], rtol: f64) {
    assert_eq!(got.len(), want.len(), "{what}: parameter count");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let scale = w.iter().map(|v| v.abs()).sum::<f64>() / w.len() as f64;
        for (k, (a, b)) in g.iter().zip(w).enumerate() {
            let tol = rtol * b.abs().max(scale);
            assert!(
                (a - b).abs() <= tol,
                "{what}: parameter {i}[{k}] is {a}, want {b} (|diff| {:e} > {tol:e})",
                (a - b).abs()
            );
        }
    }
}

fn minus(a: &[Vec<f64>], b: &[Vec<f64>]) -> Params {
    a.iter()
        .zip(b)
        .map(|(x, y)| x.iter().zip(y).map(|(p, q)| p - q).collect())
        .collect()
}

/// Parameters equal to the single process's (1e-6 relative in f32, 1e-12 in f64: the two
/// sum the batch in different orders, so bitwise equality cannot be expected), and so is
/// the update itself, which is what a missing or doubled reduction would change.
fn assert_matches_single(dtype: DType, per_rank: &[Params], want: &(Params, Params)) {
    assert_identical_on_ranks(per_rank);
    let (rtol, rtol_update) = if dtype == DType::F64 {
        (1e-12, 1e-9)
    } else {
        (1e-6, 1e-4)
    };
    assert_close("parameters", &per_rank[0], &want.1, rtol);
    let (got_update, want_update) = (minus(&per_rank[0], &want.0), minus(&want.1, &want.0));
    assert_close("update", &got_update, &want_update, rtol_update);
}

// ---- the collectives ------------------------------------------------------------------

fn filled(values: Vec<f64>, dtype: DType) -> Tensor {
    let n = values.len();
    Tensor::from_vec_as(values, &[n], dtype, CPU).unwrap()
}

fn check_collectives(world: usize, dtype: DType) {
    let out = InProcessGroup::run(world, |g| {
        let r = g.rank() as f64;
        let sum = filled(vec![r + 1.0, 2.0 * r], dtype);
        g.all_reduce(&sum, ReduceOp::Sum)?;
        let avg = filled(vec![r + 1.0, 2.0 * r], dtype);
        g.all_reduce(&avg, ReduceOp::Avg)?;
        let b = filled(vec![r, r], dtype);
        g.broadcast(&b, world - 1)?;
        let input = filled(
            (0..2 * world).map(|i| i as f64 * (r + 1.0)).collect(),
            dtype,
        );
        let shard = filled(vec![0.0; 2], dtype);
        g.reduce_scatter(&input, &shard, ReduceOp::Sum)?;
        let gathered = filled(vec![0.0; 2 * world], dtype);
        g.all_gather(&filled(vec![r, -r], dtype), &gathered)?;
        g.barrier()?;
        Ok([sum, avg, b, shard, gathered].map(|t| t.to_vec::<f64>().unwrap()))
    })
    .unwrap();
    let w = world as f64;
    let tri = w * (w + 1.0) / 2.0;
    for (r, [sum, avg, b, shard, gathered]) in out.iter().enumerate() {
        assert_eq!(
            sum,
            &vec![tri, (w - 1.0) * w],
            "{dtype} all_reduce sum, rank {r}"
        );
        assert_eq!(
            avg,
            &vec![tri / w, (w - 1.0)],
            "{dtype} all_reduce avg, rank {r}"
        );
        assert_eq!(b, &vec![w - 1.0; 2], "{dtype} broadcast, rank {r}");
        let chunk: Vec<f64> = (2 * r..2 * r + 2).map(|i| i as f64 * tri).collect();
        assert_eq!(shard, &chunk, "{dtype} reduce_scatter, rank {r}");
        let all: Vec<f64> = (0..world).flat_map(|q| [q as f64, -(q as f64)]).collect();
        assert_eq!(gathered, &all, "{dtype} all_gather, rank {r}");
    }
}

#[test]
fn collectives_give_exact_results_in_every_float_dtype() {
    let _l = lock();
    for world in [1, 2, 4] {
        for dtype in [DType::F16, DType::BF16, DType::F32, DType::F64] {
            check_collectives(world, dtype);
        }
    }
}

/// f32 sums are rounded in rank order, as one thread adding the ranks' values in turn:
/// bitwise the same on every rank and from run to run.
#[test]
fn all_reduce_sums_in_rank_order() {
    let _l = lock();
    let vals = [1.0f32, 1e-8, -1.0, 3e-8];
    let want = ((vals[0] + vals[1]) + vals[2]) + vals[3];
    for _ in 0..3 {
        let out = InProcessGroup::run(4, |g| {
            let t = Tensor::from_vec(vec![vals[g.rank()]], &[1], CPU)?;
            g.all_reduce(&t, ReduceOp::Sum)?;
            t.to_vec::<f32>()
        })
        .unwrap();
        assert!(
            out.iter().all(|v| v[0].to_bits() == want.to_bits()),
            "{out:?} vs {want}"
        );
    }
}

#[test]
fn a_rank_that_fails_stops_the_others_with_its_error() {
    let _l = lock();
    let err = InProcessGroup::run(3, |g| {
        if g.rank() == 1 {
            return Err(ferrograd::Error::InvalidArgument {
                op: "test",
                detail: "rank one gave up".into(),
            });
        }
        g.barrier()
    })
    .unwrap_err()
    .to_string();
    assert!(err.contains("rank one gave up"), "{err}");
}

#[test]
fn a_rank_that_never_arrives_is_a_timeout_naming_it() {
    let _l = lock();
    let err = InProcessGroup::run_with_timeout(3, Duration::from_millis(300), |g| {
        if g.rank() != 2 {
            g.barrier()?;
        }
        // Rank 2 waits elsewhere (not at the barrier) until the others have given up.
        std::thread::sleep(Duration::from_millis(600));
        Ok(())
    })
    .unwrap_err()
    .to_string();
    assert!(err.contains("timed out") && err.contains("[2]"), "{err}");
}

#[test]
fn mismatched_buffers_are_an_error_on_every_rank() {
    let _l = lock();
    let err = InProcessGroup::run(2, |g| {
        let t = Tensor::zeros(&[1 + g.rank()], DType::F32, CPU)?;
        g.all_reduce(&t, ReduceOp::Sum)
    })
    .unwrap_err()
    .to_string();
    assert!(err.contains("different collectives"), "{err}");
}

// ---- DDP ------------------------------------------------------------------------------

/// One DDP step with SGD on `world` ranks, each rank's model built from another seed (DDP's
/// broadcast makes rank 0's the start of all). Small caps make several buckets.
fn ddp_sgd_step(world: usize, dtype: DType, cfg: DdpConfig) -> Vec<Params> {
    let (x, t) = batch(dtype);
    InProcessGroup::run(world, |g| {
        let r = g.rank();
        let ddp = Ddp::with_config(mlp(dtype, r as u64), g, cfg.clone())?;
        let mut opt = sgd(&ddp);
        let loss = ddp
            .forward(&rows(&x, r, world))?
            .mse_loss(&rows(&t, r, world))?;
        loss.backward()?;
        ddp.finish()?;
        opt.step()?;
        Ok(values(&ddp))
    })
    .unwrap()
}

fn small_buckets() -> DdpConfig {
    DdpConfig {
        first_bucket_bytes: 64,
        bucket_cap_bytes: 256,
        ..DdpConfig::default()
    }
}

#[test]
fn ddp_f32_matches_one_process_on_the_whole_batch() {
    let _l = lock();
    let want = single_sgd_step(DType::F32);
    for world in [2, 4] {
        assert_matches_single(
            DType::F32,
            &ddp_sgd_step(world, DType::F32, DdpConfig::default()),
            &want,
        );
        assert_matches_single(
            DType::F32,
            &ddp_sgd_step(world, DType::F32, small_buckets()),
            &want,
        );
        let copies = DdpConfig {
            gradient_as_bucket_view: false,
            ..small_buckets()
        };
        assert_matches_single(DType::F32, &ddp_sgd_step(world, DType::F32, copies), &want);
    }
}

#[test]
fn ddp_f64_matches_one_process_on_the_whole_batch() {
    let _l = lock();
    let want = single_sgd_step(DType::F64);
    for world in [2, 4] {
        assert_matches_single(
            DType::F64,
            &ddp_sgd_step(world, DType::F64, small_buckets()),
            &want,
        );
    }
}

/// Without the all-reduce each rank would step on its own rows: the comparison above must
/// be able to tell.
#[test]
fn ranks_stepping_alone_do_not_match() {
    let _l = lock();
    let want = single_sgd_step(DType::F64);
    let (x, t) = batch(DType::F64);
    let model = mlp(DType::F64, 0);
    let mut opt = sgd(&model);
    let loss = model
        .forward(&rows(&x, 0, 2))
        .unwrap()
        .mse_loss(&rows(&t, 0, 2))
        .unwrap();
    loss.backward().unwrap();
    opt.step().unwrap();
    let alone = values(&model);
    let failed = std::panic::catch_unwind(|| {
        assert_matches_single(DType::F64, &[alone], &want);
    });
    assert!(failed.is_err());
}

/// Accumulation: two micro-batches per rank, the first inside no_sync (gradients stay local
/// and differ between ranks), the second reduces the sum.
#[test]
fn ddp_no_sync_accumulates_locally_then_reduces_the_sum() {
    let _l = lock();
    let dtype = DType::F64;
    let want = single_sgd_step(dtype);
    let (x, t) = batch(dtype);
    for world in [2, 4] {
        let out = InProcessGroup::run(world, |g| {
            let r = g.rank();
            let ddp = Ddp::with_config(mlp(dtype, 0), g, small_buckets())?;
            let mut opt = sgd(&ddp);
            let (xr, tr) = (rows(&x, r, world), rows(&t, r, world));
            let half = |i| -> Result<Tensor> {
                ddp.forward(&rows(&xr, i, 2))?
                    .mse_loss(&rows(&tr, i, 2))?
                    .mul_scalar(0.5)
            };
            let local = {
                let _quiet = ddp.no_sync();
                half(0)?.backward()?;
                ddp.finish()?;
                ddp.parameters()[0]
                    .grad()
                    .map(|g| g.to_vec::<f64>())
                    .transpose()?
            };
            half(1)?.backward()?;
            ddp.finish()?;
            opt.step()?;
            Ok((local, values(&ddp)))
        })
        .unwrap();
        let (locals, params): (Vec<_>, Vec<_>) = out.into_iter().unzip();
        assert!(
            locals[0] != locals[1],
            "no_sync must leave each rank's own gradient"
        );
        assert_matches_single(dtype, &params, &want);
    }
}

/// What a Trainer step left on one rank.
struct Stepped {
    params: Params,
    stepped: bool,
    scale: Option<f64>,
}

/// One Trainer step with SGD: on one process over the whole batch (`world` None), or on
/// `world` ranks with the DDP sync handle, each over its rows.
fn trainer_step(
    world: Option<usize>,
    dtype: DType,
    config: TrainerConfig,
    x: &Tensor,
    t: &Tensor,
) -> Vec<Stepped> {
    trainer_step_scaled(world, dtype, config, (x, t), false)
}

/// `trainer_step`; `staged`: each rank's GradScaler decides on its device (as on a GPU).
fn trainer_step_scaled(
    world: Option<usize>,
    dtype: DType,
    config: TrainerConfig,
    (x, t): (&Tensor, &Tensor),
    staged: bool,
) -> Vec<Stepped> {
    let run = |model: &dyn Module, rank: usize, parts: usize, sync| -> Result<Stepped> {
        let mut trainer = Trainer::new(sgd(model), config.clone(), CPU)?;
        if let (true, Some(s)) = (staged, trainer.scaler_mut()) {
            s.stage_on(CPU)?;
        }
        if let Some(s) = sync {
            trainer = trainer.with_grad_sync(s)?;
        }
        let accum = config.accum;
        let (xr, tr) = (rows(x, rank, parts), rows(t, rank, parts));
        let report = trainer.step(|i| {
            let loss = model
                .forward(&rows(&xr, i, accum))?
                .mse_loss(&rows(&tr, i, accum))?;
            Ok(MicroBatch { loss, tokens: 1 })
        })?;
        Ok(Stepped {
            params: values(model),
            stepped: report.stepped()?,
            scale: report.scale()?,
        })
    };
    match world {
        None => vec![run(&mlp(dtype, 0), 0, 1, None).unwrap()],
        Some(world) => InProcessGroup::run(world, |g| {
            let ddp = Ddp::with_config(mlp(dtype, g.rank() as u64), g.clone(), small_buckets())?;
            run(&ddp, g.rank(), world, Some(ddp.grad_sync()))
        })
        .unwrap(),
    }
}

fn params_of(out: &[Stepped]) -> Vec<Params> {
    out.iter().map(|o| o.params.clone()).collect()
}

#[test]
fn ddp_trainer_with_accumulation_and_clipping_matches_one_process() {
    let _l = lock();
    let dtype = DType::F64;
    let (x, t) = batch(dtype);
    let before = values(&mlp(dtype, 0));
    for config in [
        TrainerConfig {
            accum: 2,
            ..TrainerConfig::default()
        },
        // A norm well below the gradients' so that clipping acts.
        TrainerConfig {
            clip: Some(0.05),
            ..TrainerConfig::default()
        },
        TrainerConfig {
            accum: 2,
            clip: Some(0.05),
            ..TrainerConfig::default()
        },
    ] {
        let single = TrainerConfig {
            accum: 1,
            ..config.clone()
        };
        let want = (
            before.clone(),
            params_of(&trainer_step(None, dtype, single, &x, &t))[0].clone(),
        );
        for world in [2, 4] {
            let got = params_of(&trainer_step(Some(world), dtype, config.clone(), &x, &t));
            assert_matches_single(dtype, &got, &want);
        }
    }
}

/// f16 autocast with a GradScaler: the same step as one process (f16 rounding of each
/// rank's partial products differs from the whole batch's, hence the looser tolerance), and
/// an overflow on one rank makes every rank skip the step and back off the scale.
#[test]
fn ddp_f16_loss_scaling_skips_on_every_rank_when_one_overflows() {
    let _l = lock();
    let config = TrainerConfig {
        amp: Some(DType::F16),
        ..TrainerConfig::default()
    };
    let (x, t) = batch(DType::F32);
    let before = values(&mlp(DType::F32, 0));
    let single = trainer_step(None, DType::F32, config.clone(), &x, &t);
    for world in [2, 4] {
        let got = trainer_step(Some(world), DType::F32, config.clone(), &x, &t);
        assert!(
            got.iter().all(|o| o.stepped && o.scale == single[0].scale),
            "stepped, same scale"
        );
        assert_identical_on_ranks(&params_of(&got));
        let (got_update, want_update) = (
            minus(&got[0].params, &before),
            minus(&single[0].params, &before),
        );
        assert_close("f16 update", &got_update, &want_update, 2e-2);
    }
    // 1e5 overflows f16 (max 65504) in the last rank's rows only.
    let mut xs = x.to_vec::<f32>().unwrap();
    let last = xs.len() - 1;
    xs[last] = 1e5;
    let x_bad = Tensor::from_vec(xs, &[BATCH, IN], CPU).unwrap();
    for world in [2, 4] {
        let got = trainer_step(Some(world), DType::F32, config.clone(), &x_bad, &t);
        for (r, o) in got.iter().enumerate() {
            assert!(!o.stepped, "rank {r} must skip the step");
            assert_eq!(o.scale, Some(32768.0), "rank {r} backs off the scale");
            assert!(o.params == before, "rank {r}'s parameters must not move");
        }
    }
    // Each rank deciding on its device (as on a GPU, nothing read back) steps, skips and
    // scales as the host path does, bit for bit.
    for (x, world) in [(&x, 2), (&x_bad, 2), (&x, 4), (&x_bad, 4)] {
        let host = trainer_step_scaled(Some(world), DType::F32, config.clone(), (x, &t), false);
        let device = trainer_step_scaled(Some(world), DType::F32, config.clone(), (x, &t), true);
        for (r, (d, h)) in device.iter().zip(&host).enumerate() {
            assert_eq!(
                (d.stepped, d.scale),
                (h.stepped, h.scale),
                "rank {r} of {world}"
            );
            assert!(d.params == h.params, "rank {r} of {world}: parameters");
        }
    }
}

/// A parameter outside the loss is an error naming it, on every rank, not a hang.
struct HalfUsed {
    used: Linear,
    unused: Linear,
}

impl Module for HalfUsed {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.used.forward(x)
    }
    fn named_parameters(&self) -> Vec<(String, Tensor)> {
        let mut v: Vec<(String, Tensor)> = self.used.named_parameters();
        v.extend(
            self.unused
                .named_parameters()
                .into_iter()
                .map(|(n, p)| (format!("unused.{n}"), p)),
        );
        v
    }
}

#[test]
fn a_parameter_without_gradient_is_an_error_naming_it() {
    let _l = lock();
    let (x, t) = batch(DType::F32);
    let err = InProcessGroup::run_with_timeout(2, Duration::from_secs(20), |g| {
        let mut rng = Generator::new(0);
        let model = HalfUsed {
            used: Linear::new(IN, OUT, true, CPU, &mut rng)?,
            unused: Linear::new(IN, OUT, true, CPU, &mut rng)?,
        };
        let ddp = Ddp::new(model, g.clone())?;
        let r = g.rank();
        ddp.forward(&rows(&x, r, 2))?
            .mse_loss(&rows(&t, r, 2))?
            .backward()?;
        ddp.finish()
    })
    .unwrap_err()
    .to_string();
    assert!(
        err.contains("unused.weight") && err.contains("unused.bias"),
        "{err}"
    );
    assert!(
        !err.contains(" weight,") && !err.contains("timed out"),
        "{err}"
    );
}

/// Two layers listed in the opposite order of their use: `late` (used second) comes first
/// in the parameters, so its gradients arrive first although the reverse parameter order
/// expects them last.
struct Listed {
    early: Linear,
    late: Linear,
}

impl Listed {
    fn new(dtype: DType) -> Listed {
        let mut g = Generator::new(0);
        Listed {
            early: Linear::new_with_dtype(IN, 16, true, dtype, CPU, &mut g).unwrap(),
            late: Linear::new_with_dtype(16, OUT, true, dtype, CPU, &mut g).unwrap(),
        }
    }
}

impl Module for Listed {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.late.forward(&self.early.forward(x)?.relu()?)
    }
    fn named_parameters(&self) -> Vec<(String, Tensor)> {
        let named = |prefix: &str, l: &Linear| {
            l.named_parameters()
                .into_iter()
                .map(|(n, p)| (format!("{prefix}.{n}"), p))
                .collect::<Vec<_>>()
        };
        [named("late", &self.late), named("early", &self.early)].concat()
    }
}

/// After the first step the buckets follow the order gradients arrived in, the same on every
/// rank, and training goes on matching the single process.
#[test]
fn buckets_are_rebuilt_after_the_first_step_the_same_on_every_rank() {
    let _l = lock();
    let dtype = DType::F64;
    let (x, t) = batch(dtype);
    let out = InProcessGroup::run(2, |g| {
        let r = g.rank();
        let ddp = Ddp::with_config(Listed::new(dtype), g, small_buckets())?;
        let mut opt = sgd(&ddp);
        let initial = ddp.bucket_names();
        for _ in 0..2 {
            ddp.forward(&rows(&x, r, 2))?
                .mse_loss(&rows(&t, r, 2))?
                .backward()?;
            ddp.finish()?;
            opt.step()?;
            opt.zero_grad()?;
        }
        Ok((
            initial,
            ddp.bucket_names(),
            ddp.buckets_rebuilt(),
            values(&ddp),
        ))
    })
    .unwrap();
    assert!(out.iter().all(|o| o.2), "rebuilt");
    assert_eq!(out[0].1, out[1].1);
    // Expected order: early.bias (128 B) closes the 64-byte first bucket, then early.weight
    // (640 B). Arrived: late's gradients first (bias 24 B + weight 384 B close the first
    // bucket), then early's.
    let names = |v: &[&[&str]]| -> Vec<Vec<String>> {
        v.iter()
            .map(|b| b.iter().map(|s| s.to_string()).collect())
            .collect()
    };
    assert_eq!(
        out[0].0,
        names(&[
            &["early.bias"],
            &["early.weight"],
            &["late.bias", "late.weight"]
        ])
    );
    // Which of a layer's weight and bias is ready first varies from run to run (both become
    // ready together): late's two come first either way.
    let rebuilt: Vec<String> = out[0].1.concat();
    assert!(
        rebuilt[..2].iter().all(|n| n.starts_with("late.")),
        "{rebuilt:?}"
    );
    assert!(
        rebuilt[2..].iter().all(|n| n.starts_with("early.")),
        "{rebuilt:?}"
    );
    let model = Listed::new(dtype);
    let mut opt = sgd(&model);
    for _ in 0..2 {
        whole_batch_step(&model, &mut opt, &x, &t);
    }
    let params: Vec<_> = out.iter().map(|o| o.3.clone()).collect();
    assert_identical_on_ranks(&params);
    assert_close("after two steps", &params[0], &values(&model), 1e-12);
}

/// Whether every parameter's gradient lives in one of the buckets' storages (as many
/// distinct storages as buckets, each counted as gradient).
fn grads_live_in_buckets<M: Module>(ddp: &Ddp<M>) -> bool {
    let grads: Vec<Tensor> = ddp.parameters().iter().filter_map(Tensor::grad).collect();
    let mut storages: Vec<Tensor> = Vec::new();
    for g in &grads {
        if !storages.iter().any(|s| s.shares_storage(g)) {
            storages.push(g.clone());
        }
    }
    grads.len() == ddp.parameters().len()
        && storages.len() == ddp.bucket_names().len()
        && grads
            .iter()
            .all(|g| g.category() == Some(Category::Gradient))
}

/// What one rank reports after its backward.
struct RankBytes {
    /// Every .grad lives in a bucket.
    views: bool,
    param_bytes: usize,
    bucket_bytes: usize,
    /// The rank's own gradient bytes, from its memory scope.
    scoped_gradient: u64,
}

/// The gradient bytes on the device after one backward on every rank, and what each rank
/// reports.
fn gradient_bytes(world: usize, cfg: DdpConfig) -> (u64, Vec<RankBytes>) {
    let (x, t) = batch(DType::F32);
    let base = memory::memory_by_category(CPU)
        .unwrap()
        .get(Category::Gradient);
    let bytes = Mutex::new(0);
    let out = InProcessGroup::run(world, |g| {
        let r = g.rank();
        let scoped = || -> Result<u64> {
            let m = memory::scope_memory(CPU, r as u16)?;
            Ok(m.by_category.get(Category::Gradient))
        };
        let scoped_base = scoped()?;
        let ddp = Ddp::with_config(mlp(DType::F32, 0), g.clone(), cfg.clone())?;
        ddp.forward(&rows(&x, r, world))?
            .mse_loss(&rows(&t, r, world))?
            .backward()?;
        ddp.finish()?;
        // Every rank has finished its backward before one reads the device's bytes.
        g.barrier()?;
        if r == 0 {
            *bytes.lock().unwrap() =
                memory::memory_by_category(CPU)?.get(Category::Gradient) - base;
        }
        g.barrier()?;
        Ok(RankBytes {
            views: grads_live_in_buckets(&ddp),
            param_bytes: ddp.parameter_bytes(),
            bucket_bytes: ddp.bucket_bytes(),
            scoped_gradient: scoped()? - scoped_base,
        })
    })
    .unwrap();
    (bytes.into_inner().unwrap(), out)
}

/// gradient_as_bucket_view: every .grad is a slice of a bucket, and the gradient bytes on
/// the device are exactly the parameters' (no second copy), for each rank. Without it, the
/// gradients and the buckets each take the parameters' bytes.
#[test]
fn gradients_are_bucket_views_and_take_exactly_the_parameter_bytes() {
    let _l = lock();
    for world in [2, 4] {
        let (bytes, out) = gradient_bytes(world, small_buckets());
        for o in out {
            assert!(o.views);
            assert_eq!(o.bucket_bytes, o.param_bytes);
            assert_eq!(
                o.scoped_gradient, o.param_bytes as u64,
                "the rank's own gradients"
            );
            assert_eq!(
                bytes,
                (world * o.param_bytes) as u64,
                "all ranks' gradients"
            );
        }
        let copies = DdpConfig {
            gradient_as_bucket_view: false,
            ..small_buckets()
        };
        let (bytes, out) = gradient_bytes(world, copies);
        for o in out {
            assert!(!o.views);
            assert_eq!(o.scoped_gradient, 2 * o.param_bytes as u64);
            assert_eq!(
                bytes,
                (2 * world * o.param_bytes) as u64,
                "gradients and buckets"
            );
        }
    }
}

/// A group that logs its all-reduces next to the test's own events.
struct Logged {
    inner: Arc<dyn ProcessGroup>,
    log: Arc<Mutex<Vec<String>>>,
}

impl ProcessGroup for Logged {
    fn rank(&self) -> usize {
        self.inner.rank()
    }
    fn world_size(&self) -> usize {
        self.inner.world_size()
    }
    fn backend_name(&self) -> &'static str {
        "logged"
    }
    fn all_reduce(&self, x: &Tensor, op: ReduceOp) -> Result<()> {
        self.log
            .lock()
            .unwrap()
            .push(format!("all_reduce {}", x.numel()));
        self.inner.all_reduce(x, op)
    }
    fn broadcast(&self, x: &Tensor, root: usize) -> Result<()> {
        self.inner.broadcast(x, root)
    }
    fn reduce_scatter(&self, input: &Tensor, output: &Tensor, op: ReduceOp) -> Result<()> {
        self.inner.reduce_scatter(input, output, op)
    }
    fn all_gather(&self, input: &Tensor, output: &Tensor) -> Result<()> {
        self.inner.all_gather(input, output)
    }
    fn barrier(&self) -> Result<()> {
        self.inner.barrier()
    }
}

/// Two layers whose forward logs when backward reaches the first layer's output: the
/// moment the second layer's gradients are complete and the first layer's are not begun.
struct Marked {
    a: Linear,
    b: Linear,
    log: Arc<Mutex<Vec<String>>>,
}

impl Module for Marked {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let h = self.a.forward(x)?;
        let log = self.log.clone();
        h.register_hook(move |_| {
            log.lock().unwrap().push("backward reaches layer a".into());
            Ok(None)
        });
        self.b.forward(&h.relu()?)
    }
    fn named_parameters(&self) -> Vec<(String, Tensor)> {
        let named = |prefix: &str, l: &Linear| {
            l.named_parameters()
                .into_iter()
                .map(|(n, p)| (format!("{prefix}.{n}"), p))
                .collect::<Vec<_>>()
        };
        [named("a", &self.a), named("b", &self.b)].concat()
    }
}

/// Overlap: the second layer's bucket is reduced from the gradient hooks before backward
/// has begun the first layer.
#[test]
fn buckets_are_reduced_during_backward_as_they_complete() {
    let _l = lock();
    let (x, t) = batch(DType::F32);
    let logs = InProcessGroup::run(2, |g| {
        let log: Arc<Mutex<Vec<String>>> = Arc::default();
        let logged: Arc<dyn ProcessGroup> = Arc::new(Logged {
            inner: g.clone(),
            log: log.clone(),
        });
        let mut rng = Generator::new(0);
        let model = Marked {
            a: Linear::new(IN, 16, true, CPU, &mut rng)?,
            b: Linear::new(16, OUT, true, CPU, &mut rng)?,
            log: log.clone(),
        };
        let ddp = Ddp::with_config(model, logged, small_buckets())?;
        let r = g.rank();
        ddp.forward(&rows(&x, r, 2))?
            .mse_loss(&rows(&t, r, 2))?
            .backward()?;
        ddp.finish()?;
        let log = log.lock().unwrap().clone();
        Ok(log)
    })
    .unwrap();
    // Buckets in reverse order: b.* (3 + 48 elements), then a.* (16 + 80).
    let want = ["all_reduce 51", "backward reaches layer a", "all_reduce 96"];
    for log in logs {
        assert_eq!(log, want);
    }
}

// ---- ZeRO-1 ---------------------------------------------------------------------------

fn adam_cfg() -> AdamConfig {
    // A large eps keeps the update sensitive to the gradient's scale (Adam's first steps
    // are nearly lr · sign(g) otherwise, which a wrong average would not change).
    AdamConfig {
        lr: 1e-2,
        eps: 1e-2,
        weight_decay: 0.1,
        ..AdamConfig::default()
    }
}

const ZERO_STEPS: usize = 3;

fn single_adamw(dtype: DType) -> (Params, Params) {
    let model = mlp(dtype, 0);
    let before = values(&model);
    let (x, t) = batch(dtype);
    let mut opt = Adam::adamw(model.parameters(), adam_cfg()).unwrap();
    for _ in 0..ZERO_STEPS {
        whole_batch_step(&model, &mut opt, &x, &t);
    }
    (before, values(&model))
}

#[test]
fn zero1_matches_adamw_in_one_process_and_holds_a_shard_of_the_state() {
    let _l = lock();
    for dtype in [DType::F32, DType::F64] {
        let want = single_adamw(dtype);
        let (x, t) = batch(dtype);
        for world in [2, 4] {
            let base = memory::memory_by_category(CPU)
                .unwrap()
                .get(Category::OptimizerState);
            let out = InProcessGroup::run(world, |g| {
                let r = g.rank();
                let model = mlp(dtype, r as u64);
                let mut opt = Zero1::adamw(model.named_parameters(), adam_cfg(), g.clone())?;
                for _ in 0..ZERO_STEPS {
                    model
                        .forward(&rows(&x, r, world))?
                        .mse_loss(&rows(&t, r, world))?
                        .backward()?;
                    opt.step()?;
                    opt.zero_grad()?;
                }
                g.barrier()?;
                let on_device =
                    memory::memory_by_category(CPU)?.get(Category::OptimizerState) - base;
                g.barrier()?;
                let scoped = memory::scope_memory(CPU, r as u16)?;
                let own = scoped.by_category.get(Category::OptimizerState);
                assert_eq!(
                    own,
                    opt.state_bytes() as u64,
                    "rank {r}'s scope holds its state"
                );
                Ok((
                    values(&model),
                    opt.state_bytes(),
                    opt.padding_elements(),
                    on_device,
                ))
            })
            .unwrap();
            let params: Vec<_> = out.iter().map(|o| o.0.clone()).collect();
            assert_matches_single(dtype, &params, &want);
            let numel: usize = mlp(dtype, 0).parameters().iter().map(Tensor::numel).sum();
            let size = dtype.size_in_bytes();
            let padded = numel.div_ceil(world) * world;
            for (_, state, padding, on_device) in &out {
                assert_eq!(*padding, padded - numel);
                // exp_avg and exp_avg_sq of this rank's shard: (total + padding) / world each.
                assert_eq!(*state, 2 * padded / world * size);
                assert_eq!(
                    *on_device,
                    (world * state) as u64,
                    "all ranks' state on the device"
                );
            }
        }
    }
}

/// f64, whole batch on every rank (the average of equal gradients is exact): `steps` of
/// Zero1 on `world` ranks, starting from `start` when given; rank 0's parameters and the
/// whole state it gathered.
fn zero1_run(
    world: usize,
    steps: usize,
    start: Option<(Params, Vec<(usize, AdamState)>)>,
) -> (Params, Vec<Option<AdamState>>) {
    let (x, t) = batch(DType::F64);
    let mut out = InProcessGroup::run(world, |g| {
        let model = mlp(DType::F64, 0);
        let mut opt = Zero1::adamw(model.named_parameters(), adam_cfg(), g.clone())?;
        if let Some((params, states)) = &start {
            let _g = no_grad();
            for (p, v) in model.parameters().iter().zip(params) {
                p.copy_(&Tensor::from_vec_as(v.clone(), p.shape(), DType::F64, CPU)?)?;
            }
            opt.load_state(states.clone())?;
        }
        for _ in 0..steps {
            model.forward(&x)?.mse_loss(&t)?.backward()?;
            opt.step()?;
            opt.zero_grad()?;
        }
        Ok((values(&model), opt.gather_state()?))
    })
    .unwrap();
    out.swap_remove(0)
}

#[test]
fn zero1_state_gathers_whole_and_resumes_resharded() {
    let _l = lock();
    let (x, t) = batch(DType::F64);
    let model = mlp(DType::F64, 0);
    let mut adam = Adam::adamw(model.parameters(), adam_cfg()).unwrap();
    for _ in 0..2 {
        whole_batch_step(&model, &mut adam, &x, &t);
    }
    let (params, whole) = zero1_run(2, 2, None);
    assert_close("parameters", &params, &values(&model), 1e-12);
    for (i, st) in whole.iter().enumerate() {
        let (got, want) = (st.as_ref().unwrap(), adam.state(i).unwrap());
        assert_eq!(got.step, 2);
        assert_eq!(got.exp_avg.shape(), want.exp_avg.shape());
        let read = |t: &Tensor| vec![t.to_vec::<f64>().unwrap()];
        assert_close("exp_avg", &read(&got.exp_avg), &read(&want.exp_avg), 1e-12);
        assert_close(
            "exp_avg_sq",
            &read(&got.exp_avg_sq),
            &read(&want.exp_avg_sq),
            1e-12,
        );
    }
    // Resumed on 4 ranks (other shards), one more step: as plain AdamW's third step.
    let states: Vec<(usize, AdamState)> = whole
        .into_iter()
        .enumerate()
        .map(|(i, s)| (i, s.unwrap()))
        .collect();
    let (resumed, again) = zero1_run(4, 1, Some((params, states.clone())));
    whole_batch_step(&model, &mut adam, &x, &t);
    assert_close("resumed parameters", &resumed, &values(&model), 1e-12);
    assert_eq!(again[0].as_ref().unwrap().step, 3);
    // A state holding some parameters of a dtype only cannot be sharded.
    let err = InProcessGroup::run(2, |g| {
        let model = mlp(DType::F64, 0);
        let mut opt = Zero1::adamw(model.named_parameters(), adam_cfg(), g)?;
        opt.load_state(states[..1].to_vec())
    })
    .unwrap_err()
    .to_string();
    assert!(err.contains("every parameter of a dtype"), "{err}");
}

#[test]
fn zero1_refuses_what_needs_reduced_gradients_before_its_step() {
    let _l = lock();
    let err = InProcessGroup::run(1, |g| {
        let model = mlp(DType::F32, 0);
        let opt = Zero1::adamw(model.named_parameters(), adam_cfg(), g)?;
        let config = TrainerConfig {
            clip: Some(1.0),
            ..TrainerConfig::default()
        };
        Trainer::new(opt, config, CPU).map(drop)
    })
    .unwrap_err()
    .to_string();
    assert!(err.contains("clipping") && err.contains("ZeRO-1"), "{err}");
}

// ---- bucket assignment against PyTorch ------------------------------------------------

fn dtype_of(name: &str) -> DType {
    match name {
        "f32" => DType::F32,
        "f64" => DType::F64,
        "f16" => DType::F16,
        other => panic!("unknown dtype {other} in the fixture"),
    }
}

#[test]
fn bucket_assignment_equals_pytorchs() {
    let _l = lock();
    let path = format!(
        "{}/../../tests/fixtures/ddp_buckets.json",
        env!("CARGO_MANIFEST_DIR")
    );
    let text = std::fs::read_to_string(&path).unwrap();
    let doc: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!(
        doc["format"], "ferrograd-ddp-bucket-fixtures",
        "regenerate with tools/make_ddp_bucket_fixture.py"
    );
    assert_eq!(doc["version"], "1");
    assert_eq!(
        doc["first_bucket_bytes"],
        ferrograd::dist::DEFAULT_FIRST_BUCKET_BYTES
    );
    assert_eq!(
        doc["bucket_cap_bytes"],
        ferrograd::dist::DEFAULT_BUCKET_BYTES_CAP
    );
    let mut checked = 0;
    for case in doc["cases"].as_array().unwrap() {
        let name = case["name"].as_str().unwrap();
        let items: Vec<BucketItem> = doc["models"][case["model"].as_str().unwrap()]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| {
                let dtype = dtype_of(p["dtype"].as_str().unwrap());
                let numel: u64 = p["shape"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|d| d.as_u64().unwrap())
                    .product();
                BucketItem {
                    bytes: numel as usize * dtype.size_in_bytes(),
                    dtype,
                    device: CPU,
                }
            })
            .collect();
        let limits: Vec<usize> = case["limits"]
            .as_array()
            .unwrap()
            .iter()
            .map(|l| l.as_u64().unwrap().min(usize::MAX as u64) as usize)
            .collect();
        let order: Option<Vec<usize>> = case["order"]
            .as_array()
            .map(|o| o.iter().map(|i| i.as_u64().unwrap() as usize).collect());
        let visited: Vec<BucketItem> = match &order {
            Some(o) => o.iter().map(|&i| items[i]).collect(),
            None => items.clone(),
        };
        let got = bucket_assignment(&visited, &limits, order.as_deref()).unwrap();
        let want: Vec<Vec<usize>> = serde_json::from_value(case["buckets"].clone()).unwrap();
        if case["open_order_hashed"].as_bool().unwrap() {
            // The closed buckets come in order; those left open at the end follow PyTorch's
            // hash map: compare them as a set.
            let dtypes = 3;
            let fixed = want.len() - dtypes;
            assert_eq!(got[..fixed], want[..fixed], "{name}");
            let (mut a, mut b) = (got[fixed..].to_vec(), want[fixed..].to_vec());
            a.sort();
            b.sort();
            assert_eq!(a, b, "{name}");
        } else {
            assert_eq!(got, want, "{name}");
        }
        checked += 1;
    }
    assert_eq!(checked, 8);
}

#[test]
fn ddp_starts_with_the_rebuild_assignment_of_the_reverse_order() {
    let _l = lock();
    let out = InProcessGroup::run(1, |g| {
        let ddp = Ddp::with_config(mlp(DType::F32, 0), g, small_buckets())?;
        Ok(ddp.bucket_names())
    })
    .unwrap();
    // Reverse order 4.bias (12 B), 4.weight (84 B) close the 64-byte first bucket; then
    // buckets of at least 256 bytes: 2.bias + 2.weight (28 + 448), 0.bias + 0.weight.
    assert_eq!(
        out[0],
        vec![
            vec!["4.bias", "4.weight"],
            vec!["2.bias", "2.weight"],
            vec!["0.bias", "0.weight"]
        ]
    );
}

// ---- the main job on in-process ranks -------------------------------------------------

fn rank_job(ranks: usize) -> ferrograd::job::TrainJob {
    ferrograd::job::TrainJob {
        text: ferrograd::data::default_corpus()
            .chars()
            .take(20_000)
            .collect(),
        model: ferrograd::nn::GptConfig {
            vocab_size: 0,
            block_size: 16,
            n_layer: 1,
            n_head: 2,
            n_embd: 16,
            dropout: 0.0,
            bias: true,
            seed: 0,
        },
        batch_size: 4,
        max_steps: 6,
        warmup_steps: 2,
        eval_every: 0,
        eval_batches: 1,
        sample_chars: 10,
        ranks,
        ..ferrograd::job::TrainJob::default()
    }
}

/// `train --ranks 2`: every rank's peak is measured in its own scope; a rank holds one
/// replica's parameters, its gradients only in the buckets (as many bytes as the
/// parameters) and the AdamW moments (twice).
#[test]
fn the_job_on_two_ranks_reports_each_ranks_peak_by_category() {
    let _l = lock();
    let mut steps = 0;
    let summary = ferrograd::job::run(&rank_job(2), &mut |e| {
        if let ferrograd::job::Event::Step(_) = e {
            steps += 1;
        }
    })
    .unwrap();
    assert_eq!(steps, 6, "rank 0 reports every step once");
    assert!(summary.final_loss < summary.initial_loss);
    assert_eq!(summary.ranks.len(), 2);
    let param_bytes = summary.params as u64 * 4;
    for r in &summary.ranks {
        let at = &r.by_category_at_peak;
        assert_eq!(at["parameter"], param_bytes, "rank {}", r.rank);
        assert_eq!(at["gradient"], param_bytes, "rank {}", r.rank);
        assert_eq!(at["optimizer_state"], 2 * param_bytes, "rank {}", r.rank);
        assert_eq!(r.peak_bytes, at.values().sum::<u64>());
    }
    assert!(summary.peak_bytes >= summary.ranks.iter().map(|r| r.peak_bytes).max().unwrap());
}

/// State saved by a 2-rank run resumes on 1 and on 4 ranks (DDP keeps the whole optimizer
/// state on every rank).
#[test]
fn the_job_saved_on_two_ranks_resumes_on_any_number() {
    let _l = lock();
    let dir = std::env::temp_dir().join(format!("ferrograd-dist-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("state.safetensors");
    let first = ferrograd::job::TrainJob {
        stop_after: Some(3),
        save: Some(path.clone()),
        ..rank_job(2)
    };
    ferrograd::job::run(&first, &mut |_| {}).unwrap();
    for ranks in [1, 4] {
        let next = ferrograd::job::TrainJob {
            resume: Some(path.clone()),
            ..rank_job(ranks)
        };
        let s = ferrograd::job::run(&next, &mut |_| {}).unwrap();
        assert_eq!((s.steps, s.step_reached), (3, 6), "{ranks} ranks");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn the_job_refuses_ranks_where_they_cannot_run() {
    let _l = lock();
    let on_gpu = ferrograd::job::TrainJob {
        device: Device::Cuda(0),
        ..rank_job(2)
    };
    let err = ferrograd::job::run(&on_gpu, &mut |_| {})
        .unwrap_err()
        .to_string();
    assert!(err.contains("NCCL") && err.contains("--ranks"), "{err}");
    let mut in_backward = rank_job(2);
    in_backward.trainer.step_in_backward = true;
    let err = ferrograd::job::run(&in_backward, &mut |_| {})
        .unwrap_err()
        .to_string();
    assert!(err.contains("--step-in-backward"), "{err}");
}

/// Clipping and the GradScaler's unscale write the bucket views in place: after a step with
/// both (gradients zeroed in place, not freed) every .grad still lives in a bucket, so no
/// second copy of the gradients was made.
#[test]
fn clipping_and_unscaling_keep_gradients_in_their_buckets() {
    let _l = lock();
    let (x, t) = batch(DType::F32);
    let config = TrainerConfig {
        clip: Some(0.05),
        amp: Some(DType::F16),
        set_to_none: false,
        ..TrainerConfig::default()
    };
    let out = InProcessGroup::run(2, |g| {
        let r = g.rank();
        let ddp = Ddp::with_config(mlp(DType::F32, 0), g.clone(), small_buckets())?;
        let mut trainer =
            Trainer::new(sgd(&ddp), config.clone(), CPU)?.with_grad_sync(ddp.grad_sync())?;
        let report = trainer.step(|_| {
            let loss = ddp.forward(&rows(&x, r, 2))?.mse_loss(&rows(&t, r, 2))?;
            Ok(MicroBatch { loss, tokens: 1 })
        })?;
        Ok((report.stepped()?, grads_live_in_buckets(&ddp)))
    })
    .unwrap();
    for (stepped, in_buckets) in out {
        assert!(stepped && in_buckets);
    }
}

/// `train --ranks 2 --zero 1` takes the same steps as DDP (the same average of the same
/// batches, AdamW elementwise), with each rank holding half of AdamW's moments.
#[test]
fn the_job_with_zero1_matches_ddp_with_half_the_optimizer_state_per_rank() {
    let _l = lock();
    let ddp = ferrograd::job::run(&rank_job(2), &mut |_| {}).unwrap();
    let zero = ferrograd::job::TrainJob {
        zero: true,
        ..rank_job(2)
    };
    let mut losses = Vec::new();
    let sharded = ferrograd::job::run(&zero, &mut |e| {
        if let ferrograd::job::Event::Step(r) = e {
            losses.push(r.loss.value().unwrap());
        }
    })
    .unwrap();
    assert_eq!(losses.len(), 6);
    let rel = (sharded.final_loss - ddp.final_loss).abs() / ddp.final_loss;
    assert!(rel < 1e-5, "{} vs {}", sharded.final_loss, ddp.final_loss);
    let per_rank = 2 * (sharded.params.div_ceil(2) * 4) as u64;
    for r in &sharded.ranks {
        assert_eq!(
            r.by_category_at_peak["optimizer_state"], per_rank,
            "rank {}",
            r.rank
        );
    }
    let clip = ferrograd::job::TrainJob {
        trainer: TrainerConfig {
            clip: Some(1.0),
            ..TrainerConfig::default()
        },
        ..zero.clone()
    };
    let err = ferrograd::job::run(&clip, &mut |_| {})
        .unwrap_err()
        .to_string();
    assert!(err.contains("clipping"), "{err}");
}
