//! The leak detector on each kind of leak it names: a training loop with one mistake, run
//! under `LeakCheck`, must be reported with the right holder (which op made the tensor that
//! holds the graph, in which step) and the right fix; warm-up growth and one-time growth must
//! not be. The clean case for the main job is the soak test (tests/soak.rs).
//!
//! The allocators are process-wide and tests run on parallel threads, so every test here
//! takes `LOCK` first.

use std::sync::{Arc, Mutex, MutexGuard};

use ferrograd::autograd::{
    CustomFunction, FunctionCtx, GraphKind, Holder, LeakCheck, LeakCheckConfig, LeakReport,
    apply_custom,
};
use ferrograd::memory::{Allocator, CachingPolicy, SimulatedDevice};
use ferrograd::optim::{Optimizer, Sgd, SgdConfig};
use ferrograd::{BackwardOptions, Category, DType, Device, Generator, Result, Tensor};

const CPU: Device = Device::Cpu;
const STEPS: usize = 8;
static LOCK: Mutex<()> = Mutex::new(());

fn lock() -> MutexGuard<'static, ()> {
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

/// A two-layer MLP's parameters (16 → 32 → 4) and a batch.
struct Net {
    w1: Tensor,
    w2: Tensor,
    x: Tensor,
    y: Tensor,
}

impl Net {
    fn new() -> Net {
        let mut g = Generator::new(5);
        let mut randn = |s: &[usize]| Tensor::randn_with(s, DType::F32, CPU, &mut g).unwrap();
        Net {
            w1: randn(&[32, 16])
                .mul_scalar(0.2)
                .unwrap()
                .requires_grad_(true)
                .unwrap(),
            w2: randn(&[4, 32])
                .mul_scalar(0.2)
                .unwrap()
                .requires_grad_(true)
                .unwrap(),
            x: randn(&[8, 16]),
            y: randn(&[8, 4]),
        }
    }

    fn hidden(&self, x: &Tensor) -> Result<Tensor> {
        x.linear(&self.w1, None)?.tanh()
    }

    fn loss(&self) -> Result<Tensor> {
        self.hidden(&self.x)?
            .linear(&self.w2, None)?
            .mse_loss(&self.y)
    }

    fn sgd(&self) -> Sgd {
        let cfg = SgdConfig {
            lr: 0.01,
            ..Default::default()
        };
        Sgd::new(vec![self.w1.clone(), self.w2.clone()], cfg).unwrap()
    }
}

/// Runs `STEPS` steps of `step(i)` with a leak check marking each boundary.
fn watch(mut step: impl FnMut(usize)) -> LeakReport {
    let mut check = LeakCheck::new(CPU).unwrap();
    for i in 0..STEPS {
        step(i);
        check.mark_step();
    }
    check.report()
}

/// The single graph holder of `report`.
fn graph_holder(report: &LeakReport) -> &ferrograd::autograd::GraphHolder {
    let graphs: Vec<_> = report
        .leaks
        .iter()
        .filter_map(|l| match &l.holder {
            Holder::Graph(g) => Some(g),
            _ => None,
        })
        .collect();
    assert_eq!(graphs.len(), 1, "{report}");
    graphs[0]
}

#[test]
fn a_clean_loop_reports_nothing() {
    let _l = lock();
    let net = Net::new();
    let mut opt = net.sgd();
    let report = watch(|_| {
        net.loss().unwrap().backward().unwrap();
        opt.step().unwrap();
        opt.zero_grad().unwrap();
    });
    assert!(report.is_clean(), "{report}");
    assert_eq!(report.steps, STEPS);
}

#[test]
fn accumulating_the_loss_keeps_every_graph() {
    let _l = lock();
    let net = Net::new();
    let mut opt = net.sgd();
    let mut total = Tensor::scalar(0.0, DType::F32, CPU).unwrap();
    let mut add_line = 0;
    let report = watch(|_| {
        net.loss().unwrap().backward().unwrap();
        opt.step().unwrap();
        opt.zero_grad().unwrap();
        // A validation loss summed with its graph: nothing ever runs backward through it.
        add_line = line!() + 1;
        total = total.add(&net.loss().unwrap()).unwrap();
    });
    let g = graph_holder(&report);
    assert_eq!(g.kind, GraphKind::NeverBackward);
    assert_eq!(
        (g.root_op, g.root_step, g.first_step),
        ("add", STEPS as u64, 1)
    );
    // The line that built the leaked graph, as the op's caller.
    let site = format!("{}:{add_line}", file!());
    assert_eq!(g.call_site.as_deref(), Some(site.as_str()));
    assert!(report.to_string().contains(&site), "{report}");
    let leak = &report.leaks[0];
    assert_eq!(leak.category, Some(Category::SavedActivation));
    assert!(leak.fix().contains(".item()"), "{report}");
    assert!(
        report.to_string().contains("made by `add` in step 8"),
        "{report}"
    );
}

#[test]
fn keeping_a_graph_after_a_retain_graph_backward() {
    let _l = lock();
    let net = Net::new();
    let mut opt = net.sgd();
    let mut kept = Vec::new();
    let report = watch(|_| {
        let loss = net.loss().unwrap();
        let keep = BackwardOptions {
            retain_graph: true,
            ..Default::default()
        };
        loss.backward_with(keep).unwrap();
        opt.step().unwrap();
        opt.zero_grad().unwrap();
        kept.push(loss);
    });
    let kinds: Vec<_> = report
        .leaks
        .iter()
        .map(|l| match &l.holder {
            Holder::Graph(g) => (g.kind, g.root_op),
            other => panic!("unexpected holder {other}"),
        })
        .collect();
    // One graph per earlier step, each rooted at that step's mse_loss.
    assert_eq!(kinds.len(), STEPS - 1, "{report}");
    assert!(
        kinds
            .iter()
            .all(|&k| k == (GraphKind::Retained, "mse_loss")),
        "{report}"
    );
    assert!(report.leaks[0].fix().contains("retain_graph"), "{report}");
}

#[test]
fn a_hidden_state_carried_across_steps() {
    let _l = lock();
    let net = Net::new();
    let mut opt = net.sgd();
    let u = Tensor::randn_with(&[32, 32], DType::F32, CPU, &mut Generator::new(9))
        .unwrap()
        .mul_scalar(0.1)
        .unwrap();
    let mut h = Tensor::zeros(&[8, 32], DType::F32, CPU).unwrap();
    let report = watch(|_| {
        // h = tanh(x W1ᵀ + h U): the previous step's h is not detached.
        let pre = net
            .x
            .linear(&net.w1, None)
            .unwrap()
            .add(&h.matmul(&u).unwrap())
            .unwrap();
        h = pre.tanh().unwrap();
        let loss = h.linear(&net.w2, None).unwrap().mse_loss(&net.y).unwrap();
        let keep = BackwardOptions {
            retain_graph: true,
            ..Default::default()
        };
        loss.backward_with(keep).unwrap();
        opt.step().unwrap();
        opt.zero_grad().unwrap();
    });
    let g = graph_holder(&report);
    assert_eq!(g.kind, GraphKind::LinkedToCurrentStep, "{report}");
    assert_eq!(
        (g.root_op, g.root_step, g.first_step),
        ("tanh", STEPS as u64, 1)
    );
    assert!(
        report.leaks[0].fix().contains("detach the hidden state"),
        "{report}"
    );
}

#[test]
fn a_create_graph_backward_without_zero_grad() {
    let _l = lock();
    let net = Net::new();
    let report = watch(|_| {
        let create = BackwardOptions {
            create_graph: true,
            ..Default::default()
        };
        net.loss().unwrap().backward_with(create).unwrap();
    });
    let grads: Vec<_> = report
        .leaks
        .iter()
        .filter_map(|l| match &l.holder {
            Holder::GradGraph(g) => Some(g),
            _ => None,
        })
        .collect();
    assert_eq!(grads.len(), 1, "{report}");
    assert_eq!(grads[0].params, 2);
    assert_eq!(grads[0].first_shape.len(), 2);
    assert_eq!(grads[0].steps, STEPS as u64);
    assert!(report.leaks[0].fix().contains("zero_grad"), "{report}");
    // zero_grad frees it: the same loop with it is clean.
    let mut opt = net.sgd();
    opt.zero_grad().unwrap();
    let report = watch(|_| {
        let create = BackwardOptions {
            create_graph: true,
            ..Default::default()
        };
        net.loss().unwrap().backward_with(create).unwrap();
        opt.zero_grad().unwrap();
    });
    assert!(report.is_clean(), "{report}");
}

#[test]
fn tensors_kept_by_user_code() {
    let _l = lock();
    let net = Net::new();
    let mut opt = net.sgd();
    let mut history = Vec::new();
    let report = watch(|_| {
        let hidden = net.hidden(&net.x).unwrap();
        let loss = hidden
            .linear(&net.w2, None)
            .unwrap()
            .mse_loss(&net.y)
            .unwrap();
        loss.backward().unwrap();
        opt.step().unwrap();
        opt.zero_grad().unwrap();
        history.push(hidden.detach());
    });
    assert_eq!(report.leaks.len(), 1, "{report}");
    let leak = &report.leaks[0];
    assert_eq!(
        leak.holder,
        Holder::UserTensor {
            origin: "tanh",
            bytes: 8 * 32 * 4 * (STEPS as u64 - 2),
            steps: STEPS as u64 - 2,
        }
    );
    assert_eq!(leak.bytes_per_step, 8 * 32 * 4);
    assert!(
        leak.fix().contains("keep .item() or a detached copy"),
        "{report}"
    );
}

/// x ↦ 2x that keeps its output on a struct shared across calls instead of saving through
/// the context.
struct Doubler {
    kept: Arc<Mutex<Vec<Tensor>>>,
}

impl CustomFunction for Doubler {
    fn forward(&mut self, _ctx: &mut FunctionCtx, inputs: &[Tensor]) -> Result<Tensor> {
        let out = inputs[0].mul_scalar(2.0)?;
        self.kept.lock().unwrap().push(out.clone());
        Ok(out)
    }
    fn backward(&mut self, _ctx: &FunctionCtx, g: &Tensor) -> Result<Vec<Option<Tensor>>> {
        Ok(vec![Some(g.mul_scalar(2.0)?)])
    }
}

#[test]
fn a_custom_function_that_keeps_tensors_on_its_struct() {
    let _l = lock();
    let net = Net::new();
    let mut opt = net.sgd();
    let kept = Arc::new(Mutex::new(Vec::new()));
    let report = watch(|_| {
        let h = net.hidden(&net.x).unwrap();
        let h = apply_custom(
            Doubler {
                kept: Arc::clone(&kept),
            },
            &[h],
        )
        .unwrap();
        let loss = h.linear(&net.w2, None).unwrap().mse_loss(&net.y).unwrap();
        loss.backward().unwrap();
        opt.step().unwrap();
        opt.zero_grad().unwrap();
    });
    assert_eq!(report.leaks.len(), 1, "{report}");
    assert!(
        matches!(
            report.leaks[0].holder,
            Holder::UserTensor {
                origin: "mul_scalar",
                ..
            }
        ),
        "{report}"
    );
    assert!(
        report.leaks[0].fix().contains("custom function's struct"),
        "{report}"
    );
}

#[test]
fn warm_up_and_one_time_growth_are_not_leaks() {
    let _l = lock();
    let net = Net::new();
    let mut opt = net.sgd();
    let mut late = None;
    let report = watch(|i| {
        net.loss().unwrap().backward().unwrap();
        opt.step().unwrap();
        opt.zero_grad().unwrap();
        // State made once, mid-run (say an EMA of the weights created late).
        if i == 4 {
            late = Some(net.w1.detach().mul_scalar(1.0).unwrap());
        }
    });
    assert!(report.is_clean(), "{report}");
    assert!(late.is_some());
}

// ---- the allocator's cache -------------------------------------------------------------------

const MIB: usize = 1 << 20;

fn caching_allocator() -> Arc<Allocator> {
    let policy = CachingPolicy::new(SimulatedDevice::new(4096 * MIB as u64));
    Allocator::new(Device::Cuda(0), Box::new(policy))
}

/// Each step allocates a temporary of `mib(step)` MiB and frees it.
fn cache_steps(mib: impl Fn(usize) -> usize) -> LeakReport {
    let a = caching_allocator();
    let _weights = a.malloc(MIB, Category::Parameter, "init").unwrap();
    let mut check = LeakCheck::with_config(Arc::clone(&a), LeakCheckConfig::default()).unwrap();
    for i in 0..STEPS {
        drop(a.malloc(mib(i) * MIB, Category::Temporary, "step").unwrap());
        check.mark_step();
    }
    check.report()
}

#[test]
fn a_cache_that_keeps_growing_is_fragmentation() {
    let _l = lock();
    // A larger batch shape every step: no cached block fits, a new segment each time.
    let report = cache_steps(|i| 21 + 2 * i);
    assert_eq!(report.leaks.len(), 1, "{report}");
    let leak = &report.leaks[0];
    assert_eq!(leak.category, None);
    assert!(
        matches!(leak.holder, Holder::Fragmentation { allocated, .. } if allocated == MIB as u64),
        "{report}"
    );
    assert!(leak.fix().contains("empty_cache"), "{report}");
}

#[test]
fn a_cache_that_fills_then_plateaus_is_warm_up() {
    let _l = lock();
    let report = cache_steps(|i| [21, 23, 25][i.min(2)]);
    assert!(report.is_clean(), "{report}");
}
