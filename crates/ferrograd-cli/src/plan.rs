//! `ferrograd plan`: the run `train` would make with the same flags, planned on the meta
//! device for the device it names — the breakdown at the peak, the peak of each phase, a table
//! of alternatives, and with `--budget` the largest batch of each strategy set that fits. Also
//! `train --fit-budget`, which picks a configuration under a budget and runs it.

use clap::{Args, ValueEnum};
use ferrograd::job::{self, Alternative, BatchSteps, FIT_RULE, Fitted, TrainJob};
use ferrograd::memory::{Category, format_size};
use ferrograd::plan::{Plan, PlanOptions, Target};
use ferrograd::{DType, Device};

use crate::train::TrainArgs;

#[derive(Args, Debug)]
pub struct PlanArgs {
    #[command(flatten)]
    train: TrainArgs,
    /// The GPU memory to plan for, e.g. 80GiB (default: the free memory of the GPU that
    /// --device names; needed where there is no GPU).
    #[arg(long, value_name = "SIZE", value_parser = parse_size)]
    device_memory: Option<u64>,
    /// List what fits in this much memory: the largest batch of each strategy set.
    #[arg(long, value_name = "SIZE", value_parser = parse_size)]
    budget: Option<u64>,
    /// The batch sizes --budget tries: powers of two, or any integer.
    #[arg(long, default_value = "pow2")]
    batch_steps: Steps,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Steps {
    Pow2,
    Any,
}

/// `80GiB`, `24GB`, `512MiB`, `1.5TiB` or a plain number of bytes.
pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let factor: f64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "kib" | "k" => 1024.0,
        "mib" | "m" => 1024f64.powi(2),
        "gib" | "g" => 1024f64.powi(3),
        "tib" | "t" => 1024f64.powi(4),
        "kb" => 1e3,
        "mb" => 1e6,
        "gb" => 1e9,
        "tb" => 1e12,
        _ => {
            return Err(format!(
                "'{s}' is not a size: use e.g. 80GiB, 24GB or 512MiB"
            ));
        }
    };
    let value: f64 = num
        .parse()
        .map_err(|_| format!("'{s}' is not a size: use e.g. 80GiB, 24GB or 512MiB"))?;
    let bytes = value * factor;
    if !(bytes >= 1.0 && bytes < u64::MAX as f64) {
        return Err(format!(
            "'{s}' is not a usable size: give at least one byte"
        ));
    }
    Ok(bytes as u64)
}

/// The planner's target for `device`: a GPU of `device_memory` bytes when given.
fn target(device: Device, device_memory: Option<u64>) -> anyhow::Result<Target> {
    match (device, device_memory) {
        (Device::Cuda(_), Some(capacity)) => Ok(Target::Cuda { capacity }),
        (Device::Cuda(_), None) => job::target_of(device).map_err(|e| {
            anyhow::anyhow!(
                "{e}\nto plan for a GPU without one here, give its memory: --device-memory 80GiB"
            )
        }),
        (_, Some(_)) => {
            anyhow::bail!("--device-memory is the memory of a GPU: use it with --device cuda")
        }
        (d, None) => Ok(job::target_of(d)?),
    }
}

pub fn run(a: PlanArgs) -> anyhow::Result<()> {
    if a.train.fit_budget.is_some() {
        anyhow::bail!("--fit-budget is for `train`; `plan --budget SIZE` lists what fits");
    }
    let job = a.train.to_job()?;
    let target = target(job.device, a.device_memory)?;
    let plan = job::plan_job(&job, target, PlanOptions { record: true })?;
    if let (Some(dir), Some(rec)) = (&a.train.memory_trace, &plan.recording) {
        ferrograd::io::memory_trace::write_memory_trace(dir, rec, Device::Meta)?;
    }
    let alternatives = job::alternatives(&job, target, &plan)?;
    let steps = match a.batch_steps {
        Steps::Pow2 => BatchSteps::PowersOfTwo,
        Steps::Any => BatchSteps::Any,
    };
    let budget = a
        .budget
        .map(|b| job::fit_budget(&job, target, b, steps))
        .transpose()?;
    if a.train.json {
        let out = serde_json::json!({
            "plan": plan.summary(),
            "alternatives": alternatives,
            "budget": budget,
        });
        println!("{out}");
        return Ok(());
    }
    print!("{}", render_plan(&job, &plan));
    print!("{}", render_alternatives(&alternatives));
    if let (Some(b), Some(rows)) = (a.budget, &budget) {
        print!("{}", render_budget(b, rows));
    }
    if let Some(dir) = &a.train.memory_trace {
        println!(
            "memory trace of the planned run written to {}",
            dir.display()
        );
    }
    Ok(())
}

/// `train --fit-budget`: the configuration chosen by `FIT_RULE`, its plan printed (to stderr
/// under --json, so the output stays one JSON object).
pub fn fit_to_budget(job: TrainJob, budget: u64, json: bool) -> anyhow::Result<TrainJob> {
    let target = job::target_of(job.device)?;
    let (chosen, plan) = job::choose_for_budget(&job, target, budget)?;
    let text = format!(
        "fit to {}: --batch-size {} --accum {} --recompute {} (rule: {FIT_RULE}); planned peak {} allocated, {} reserved\n",
        format_size(budget),
        chosen.batch_size,
        chosen.trainer.accum,
        chosen.trainer.recompute,
        format_size(plan.peak_allocated),
        format_size(plan.peak_reserved),
    );
    if json {
        eprint!("{text}");
    } else {
        print!("{text}");
    }
    Ok(chosen)
}

fn describe(job: &TrainJob) -> String {
    let t = &job.trainer;
    let precision = match (t.amp, job.weights) {
        (Some(DType::BF16), _) => "bf16 autocast",
        (Some(DType::F16), _) => "f16 autocast",
        (None, DType::BF16) => "bf16 weights with f32 master copies",
        _ => "f32",
    };
    format!(
        "GPT {} layers × {} wide, {} heads, T {}, batch {} × accum {}, {}, {precision}, recompute {}",
        job.model.n_layer,
        job.model.n_embd,
        job.model.n_head,
        job.model.block_size,
        job.batch_size,
        t.accum,
        job.optimizer,
        t.recompute
    )
}

fn render_plan(job: &TrainJob, p: &Plan) -> String {
    let mut s = format!("plan for {}: {}\n", p.target, describe(job));
    let fits = match (p.fits, p.target) {
        (false, _) => "does NOT fit: the figures are what an unbounded device would need".into(),
        (true, Target::Cuda { capacity }) => format!("fits in {}", format_size(capacity)),
        (true, Target::Cpu) => "on the host (exact bytes)".into(),
    };
    s += &format!(
        "peak allocated {}, peak reserved {} ({fits})\n",
        format_size(p.peak_allocated),
        format_size(p.peak_reserved)
    );
    if let Some(at) = &p.at_peak {
        let module = if at.module.is_empty() {
            String::new()
        } else {
            format!(" in {}", at.module)
        };
        s += &format!(
            "the peak is reached in step {} ({}) by `{}`{module}: a {} {} block{}\n",
            at.step,
            at.phase,
            at.op,
            format_size(at.bytes),
            at.category,
            at.site
                .as_ref()
                .map_or(String::new(), |l| format!(" ({l})"))
        );
    }
    s += "at the peak:\n";
    for c in Category::ALL {
        let b = p.by_category_at_peak.get(c);
        if b > 0 {
            s += &format!("  {:<18} {:>12}\n", c.name(), format_size(b));
        }
    }
    s += "peak of each phase:\n";
    for ph in &p.phases {
        s += &format!(
            "  step {:<3} {:<11} {:>12}\n",
            ph.step,
            ph.phase,
            format_size(ph.peak)
        );
    }
    s
}

/// A row's flags, or "(as given)" for the job unchanged.
fn shown(flags: &str) -> &str {
    if flags.is_empty() {
        "(as given)"
    } else {
        flags
    }
}

fn render_alternatives(rows: &[Alternative]) -> String {
    let mut s = format!(
        "alternatives (each planned the same way):\n  {:<40} {:>6} {:>14} {:>14} {:>8}  fits\n",
        "flags", "batch", "peak alloc", "peak reserved", "change"
    );
    for r in rows {
        s += &format!(
            "  {:<40} {:>6} {:>14} {:>14} {:>+7.1}%  {}\n",
            shown(&r.flags),
            r.batch_size,
            format_size(r.peak_allocated),
            format_size(r.peak_reserved),
            r.change_percent,
            if r.fits { "yes" } else { "no" }
        );
    }
    s
}

fn render_budget(budget: u64, rows: &[Fitted]) -> String {
    let mut s = format!(
        "largest micro-batch within {} (peak reserved):\n  {:<40} {:>6} {:>14} {:>14}\n",
        format_size(budget),
        "flags",
        "batch",
        "peak alloc",
        "peak reserved"
    );
    for r in rows {
        let flags = shown(&r.flags);
        match r.batch_size {
            Some(b) => {
                s += &format!(
                    "  {:<40} {:>6} {:>14} {:>14}\n",
                    flags,
                    b,
                    format_size(r.peak_allocated),
                    format_size(r.peak_reserved)
                )
            }
            None => {
                s += &format!(
                    "  {:<40} {:>6} (batch 1 needs {})\n",
                    flags,
                    "none",
                    format_size(r.peak_reserved.max(r.peak_allocated))
                )
            }
        }
    }
    s
}

#[cfg(test)]
mod tests {
    use super::parse_size;

    #[test]
    fn sizes_parse_in_binary_and_decimal_units() {
        assert_eq!(parse_size("80GiB"), Ok(80 << 30));
        assert_eq!(parse_size("24GB"), Ok(24_000_000_000));
        assert_eq!(parse_size("512 MiB"), Ok(512 << 20));
        assert_eq!(parse_size("1.5GiB"), Ok(3 << 29));
        assert_eq!(parse_size("4096"), Ok(4096));
        assert!(parse_size("lots").is_err());
        assert!(parse_size("0GiB").is_err());
        assert!(parse_size("12parsecs").is_err());
    }
}
