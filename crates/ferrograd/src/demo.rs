//! The classic gradient-memory demo: `Sequential(Linear(d,d), ReLU, Linear(d,d))` on an input
//! (B, d), forward, then `output.sum().backward()`, with every byte accounted for.
//!
//! With P = parameter bytes = 2·(d² + d)·4 and A = one (B, d) f32 activation = B·d·4:
//!   before backward = P + input A + saved ReLU output A + output A          = P + 3A
//!   after backward  = P + gradients P + input A + output A                   = 2P + 2A
//!   peak            = P + gradients P + input A + output A + dReLU A + loss   = 2P + 3A + 4
//! (the ReLU-input gradient is still alive while the first layer's weight gradient is made,
//! and so is the 4-byte scalar loss that backward started from).

use std::path::PathBuf;

use serde::Serialize;

use crate::base::{Error, Result};
use crate::io::memory_trace::{check_trace_dir, write_memory_trace};
use crate::memory::recorder::{self, Phase, RecorderConfig};
use crate::memory::{self, Category, format_size};
use crate::nn::{Linear, Module, Relu, Sequential};
use crate::plan::{Plan, PlanOptions};
use crate::tensor::{DType, Device, Generator, Tensor};

#[derive(Clone, Debug)]
pub struct DemoConfig {
    pub dim: usize,
    pub batch: usize,
    pub device: Device,
    pub seed: u64,
    /// Record the demo with the memory recorder and write the trace files into this folder.
    pub memory_trace: Option<PathBuf>,
}

impl Default for DemoConfig {
    fn default() -> Self {
        DemoConfig {
            dim: 10_000,
            batch: 1_000,
            device: Device::Cpu,
            seed: 0,
            memory_trace: None,
        }
    }
}

/// What the demo measured (bytes above the allocator's level when it started).
#[derive(Clone, Debug, Serialize)]
pub struct DemoReport {
    pub dim: usize,
    pub batch: usize,
    pub device: String,
    pub parameter_bytes: u64,
    pub activation_bytes: u64,
    pub before_backward_bytes: u64,
    pub after_backward_bytes: u64,
    pub peak_bytes: u64,
    /// The planner's peak for the demo, made on the meta device before it ran.
    pub planned_peak_bytes: u64,
    pub reserved_bytes: u64,
    pub by_category_before: std::collections::BTreeMap<String, u64>,
    pub by_category: std::collections::BTreeMap<String, u64>,
    /// The memory trace written (with `memory_trace`): the files, then the recorder's summary.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub memory_trace: Option<Vec<String>>,
}

impl DemoReport {
    /// P + 3A: what must be alive before backward.
    pub fn expected_before(&self) -> u64 {
        self.parameter_bytes + 3 * self.activation_bytes
    }
    /// 2P + 2A
    pub fn expected_after(&self) -> u64 {
        2 * self.parameter_bytes + 2 * self.activation_bytes
    }
    /// 2P + 3A + the f32 scalar loss
    pub fn expected_peak(&self) -> u64 {
        2 * self.parameter_bytes + 3 * self.activation_bytes + 4
    }
}

/// Bytes of the parameters and of one activation for a configuration.
fn sizes(cfg: &DemoConfig) -> Result<(u64, u64)> {
    let d = cfg.dim as u64;
    let p = d.checked_mul(d).and_then(|dd| (dd + d).checked_mul(8));
    let a = (cfg.batch as u64)
        .checked_mul(d)
        .and_then(|x| x.checked_mul(4));
    match (p, a) {
        (Some(p), Some(a)) => Ok((p, a)),
        _ => Err(Error::invalid(
            "demo",
            "--dim and --batch are too large to even count the bytes",
        )),
    }
}

/// The demo planned for `cfg.device` on the meta device: nothing is allocated where it will
/// run.
pub fn plan(cfg: &DemoConfig) -> Result<Plan> {
    let (p, a) = sizes(cfg)?;
    let target = crate::job::target_of(cfg.device)?;
    crate::plan::plan(target, PlanOptions::default(), |device| {
        let on_meta = DemoConfig {
            device,
            memory_trace: None,
            ..cfg.clone()
        };
        measure(&on_meta, p, a).map(drop)
    })
}

/// Runs the demo and measures it.
pub fn run(cfg: &DemoConfig) -> Result<DemoReport> {
    if cfg.dim == 0 || cfg.batch == 0 {
        return Err(Error::invalid(
            "demo",
            "--dim and --batch must be at least 1",
        ));
    }
    let (p, a) = sizes(cfg)?;
    let planned = plan(cfg)?;
    planned.check_fits(
        cfg.device,
        format!("the demo with --dim {} --batch {}", cfg.dim, cfg.batch),
        "use a smaller --dim (memory grows with dim²) or --batch",
    )?;
    if let Some(dir) = &cfg.memory_trace {
        check_trace_dir(dir)?;
        recorder::start(RecorderConfig::default())?;
    }
    let measured = measure(cfg, p, a).map(|r| DemoReport {
        planned_peak_bytes: planned.peak_allocated,
        ..r
    });
    let Some(dir) = &cfg.memory_trace else {
        return measured;
    };
    let rec = recorder::stop()?;
    let mut report = measured?;
    let mut lines: Vec<String> = write_memory_trace(dir, &rec, cfg.device)?
        .iter()
        .map(|f| f.display().to_string())
        .collect();
    lines.push(rec.summary());
    report.memory_trace = Some(lines);
    Ok(report)
}

/// Builds the model, runs forward and backward, and reads the allocator.
fn measure(cfg: &DemoConfig, p: u64, a: u64) -> Result<DemoReport> {
    let alloc = memory::allocator(cfg.device)?;
    let base = alloc.memory_allocated();
    alloc.reset_peak_memory_stats();
    let mut g = Generator::new(cfg.seed);
    let model = Sequential::new()
        .push(Linear::new(cfg.dim, cfg.dim, true, cfg.device, &mut g)?)
        .push(Relu)
        .push(Linear::new(cfg.dim, cfg.dim, true, cfg.device, &mut g)?);
    let x = Tensor::randn_with(&[cfg.batch, cfg.dim], DType::F32, cfg.device, &mut g)?;
    let out = {
        let _phase = recorder::phase_scope(Phase::Forward);
        model.forward(&x)?
    };
    let before = alloc.memory_allocated() - base;
    let by_category_before = alloc.by_category().to_map();
    {
        let _phase = recorder::phase_scope(Phase::Backward);
        out.sum_all()?.backward()?;
    }
    let report = DemoReport {
        dim: cfg.dim,
        batch: cfg.batch,
        device: cfg.device.to_string(),
        parameter_bytes: p,
        activation_bytes: a,
        before_backward_bytes: before,
        after_backward_bytes: alloc.memory_allocated() - base,
        peak_bytes: alloc.max_memory_allocated() - base,
        planned_peak_bytes: 0,
        reserved_bytes: alloc.memory_reserved(),
        by_category_before,
        by_category: alloc.by_category().to_map(),
        memory_trace: None,
    };
    drop((model, x, out));
    Ok(report)
}

/// The human-readable report: each number with the line that explains it.
pub fn render(r: &DemoReport) -> String {
    let row = |name: &str, v: u64, why: String| {
        format!("{name:<16} {:>14}  {:>11}  {why}\n", v, format_size(v))
    };
    let workspace = r.by_category.get("workspace").copied().unwrap_or(0);
    let check = |got: u64, want: u64| match (got == want, r.device.as_str()) {
        (true, _) => "exact".to_string(),
        (false, "cpu") => format!("expected {want}"),
        // On a GPU the caching allocator rounds every block up to 512 bytes, and the cuBLAS
        // workspace (from the same allocator) counts too.
        (false, _) => format!(
            "formula {want}, +{workspace} cuBLAS workspace, {:+} from 512-byte rounding and kernel scratch",
            got as i64 - want as i64 - workspace as i64
        ),
    };
    let (p, a) = (r.parameter_bytes, r.activation_bytes);
    let mut s = format!(
        "gradient memory demo: Sequential(Linear({d},{d}), ReLU, Linear({d},{d})), input ({b}, {d}) f32 on {dev}\n\
         P = parameters = 2·(d²+d)·4 = {p} bytes; A = one (B, d) activation = B·d·4 = {a} bytes\n\n",
        d = r.dim,
        b = r.batch,
        dev = r.device
    );
    s += &format!("{:<16} {:>14}  {:>11}  how it arises\n", "", "bytes", "");
    s += &row(
        "before backward",
        r.before_backward_bytes,
        format!(
            "= P + input A + saved ReLU output A + output A ({})",
            check(r.before_backward_bytes, r.expected_before())
        ),
    );
    s += &row(
        "after backward",
        r.after_backward_bytes,
        format!(
            "= P + gradients P + input A + output A; the saved ReLU output was freed during backward ({})",
            check(r.after_backward_bytes, r.expected_after())
        ),
    );
    s += &row(
        "peak",
        r.peak_bytes,
        format!(
            "= P + gradients P + input A + output A + ReLU-input gradient A (alive while the first layer's weight gradient is made) + the 4-byte loss ({})",
            check(r.peak_bytes, r.expected_peak())
        ),
    );
    s += &row(
        "planned peak",
        r.planned_peak_bytes,
        format!(
            "the same step run on the meta device before the demo ran ({})",
            if r.planned_peak_bytes == r.peak_bytes {
                "exact".to_string()
            } else {
                format!(
                    "{:+} bytes",
                    r.peak_bytes as i64 - r.planned_peak_bytes as i64
                )
            }
        ),
    );
    s += &row("reserved", r.reserved_bytes, reserved_line(&r.device));
    s += "\nby category      before backward   after backward\n";
    for c in Category::ALL {
        let get =
            |m: &std::collections::BTreeMap<String, u64>| m.get(c.name()).copied().unwrap_or(0);
        s += &format!(
            "  {:<17} {:>14}  {:>14}\n",
            c.name(),
            get(&r.by_category_before),
            get(&r.by_category)
        );
    }
    if let Some(lines) = &r.memory_trace {
        s += "\nmemory trace:\n";
        for l in lines {
            s += &format!("  {l}\n");
        }
    }
    s
}

fn reserved_line(device: &str) -> String {
    if device == "cpu" {
        "= allocated: the host allocator caches nothing, so freed bytes go straight back".into()
    } else {
        "= allocated + blocks the caching allocator keeps for reuse (empty_cache returns them)"
            .into()
    }
}

/// The one-object JSON form (`--json`).
pub fn to_json(r: &DemoReport) -> serde_json::Value {
    serde_json::json!({
        "before_backward_bytes": r.before_backward_bytes,
        "after_backward_bytes": r.after_backward_bytes,
        "peak_bytes": r.peak_bytes,
        "planned_peak_bytes": r.planned_peak_bytes,
        "reserved_bytes": r.reserved_bytes,
        "by_category": r.by_category,
        "by_category_before_backward": r.by_category_before,
        "parameter_bytes": r.parameter_bytes,
        "activation_bytes": r.activation_bytes,
        "dim": r.dim,
        "batch": r.batch,
        "device": r.device,
        "memory_trace": r.memory_trace,
    })
}
