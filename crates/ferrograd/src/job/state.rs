//! Training state of the main job in one safetensors file: weights (`model.*`), the
//! optimizer's state (AdamW: `optim.{i}.exp_avg`, `optim.{i}.exp_avg_sq`, `optim.{i}.step`,
//! and with bf16 weights the f32 master copy `optim.{i}.master`; SGD:
//! `optim.{i}.momentum_buffer`), the loss scaler (`scaler.*`), and in the metadata the
//! optimizer, the step, the model's shape, the vocabulary, which parameters train, and every
//! random stream (batches, dropout, the default generator) — so a resumed run continues
//! exactly as if it had never stopped. A file without an `optimizer` entry is AdamW's (the
//! only optimizer before SGD was offered).
//!
//! The metadata also records the mixed-precision mode (`amp`), the weight precision
//! (`weights`; a file without it is f32's, from before bf16 weights were offered) and which
//! parameters have optimizer state (`optimizer_state`: `none` before the first step, `all`, or
//! their indices), so the file's tensors form a manifest that reading checks completely.
//!
//! Writing is atomic and checksummed (see `io::save_state`). Reading checks everything before
//! changing anything: the format version, every tensor's checksum, the optimizer, the model's
//! shape, the vocabulary, the trainable set, the mixed-precision mode, that every expected
//! tensor is present with its dtype and shape and nothing else is, and the values themselves
//! (finite weights and moments, non-negative second moments, step counts within the run's).
//! The first difference is a `BadFile` error that names it and says what to do.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use super::{JobOptimizer, OptimizerChoice};
use crate::backend::HostValues;
use crate::base::{Error, Result};
use crate::data::CharTokenizer;
use crate::io::{CHECKSUM_KEY, load_state, save_state};
use crate::nn::{Gpt, GptConfig, Module, load_named};
use crate::optim::{Adam, AdamState, Optimizer, Sgd};
use crate::tensor::{DType, Device, Generator, Tensor, get_rng_state, set_rng_state};
use crate::train::Trainer;

/// The `format` metadata value of files this version writes (and the only one it reads).
/// Version 2 added checksums, the `amp` mode and the `optimizer_state` manifest.
pub const STATE_FORMAT: &str = "ferrograd-train-state-2";

/// The most steps a state may record: past 2^53 a step count no longer fits the schedule's
/// f64 arithmetic, and no run takes that many.
const MAX_STEP: u64 = 1 << 53;

/// Writes the state of a run after `trainer.step_index()` steps to `path`, atomically.
pub fn save_training_state(
    path: &Path,
    model: &Gpt,
    trainer: &mut Trainer<JobOptimizer>,
    data_rng: &Generator,
    tokenizer: &CharTokenizer,
) -> Result<()> {
    let mut tensors: Vec<(String, Tensor)> = model
        .named_parameters()
        .into_iter()
        .map(|(n, p)| (format!("model.{n}"), p))
        .collect();
    tensors.extend(trainer.with_optimizer(optimizer_tensors)??);
    if let Some(s) = trainer.scaler() {
        tensors.extend(s.state_tensors()?);
    }
    let dropouts: Vec<String> = model
        .dropouts()
        .iter()
        .map(|d| rng_string(&d.generator_state()))
        .collect();
    let choice = trainer.with_optimizer(|o| o.choice())?;
    let with_state = trainer.with_optimizer(state_indices)?;
    let n_params = trainer.with_optimizer(|o| o.params().len())?;
    let optimizer_state = if with_state.is_empty() {
        "none".to_string()
    } else if with_state.len() == n_params {
        "all".to_string()
    } else {
        let v: Vec<String> = with_state.iter().map(usize::to_string).collect();
        v.join(",")
    };
    let meta = BTreeMap::from([
        ("amp".to_string(), amp_name(trainer.config().amp)),
        ("weights".to_string(), weights_name(model)),
        ("optimizer_state".to_string(), optimizer_state),
        ("format".to_string(), STATE_FORMAT.to_string()),
        ("optimizer".to_string(), choice.to_string()),
        ("step".to_string(), trainer.step_index().to_string()),
        ("model".to_string(), to_json(&model.config)?),
        ("vocab".to_string(), tokenizer.vocab()),
        ("trainable".to_string(), trainable_names(model).join(",")),
        ("rng.data".to_string(), rng_string(data_rng)),
        ("rng.dropout".to_string(), dropouts.join(";")),
        ("rng.default".to_string(), rng_string(&get_rng_state())),
    ]);
    save_state(path, &tensors, meta)
}

/// Restores a state written by `save_training_state` into a freshly built run. Fails, with
/// nothing changed, when the file is not such a state or belongs to another model.
pub fn load_training_state(
    path: &Path,
    model: &Gpt,
    trainer: &mut Trainer<JobOptimizer>,
    data_rng: &mut Generator,
    tokenizer: &CharTokenizer,
) -> Result<()> {
    let (tensors, meta) = load_state(path)?;
    let bad = |detail: String| Error::BadFile {
        path: path.display().to_string(),
        detail,
    };
    let get = |key: &str| {
        meta.get(key).ok_or_else(|| {
            bad(format!(
                "no '{key}' entry: not a training state saved by `ferrograd train`"
            ))
        })
    };
    let format = get("format")?;
    if format != STATE_FORMAT {
        let what = if format.starts_with("ferrograd-train-state-") {
            "another format version"
        } else {
            "an unknown format"
        };
        return Err(bad(format!(
            "it is {what}, '{format}', and this ferrograd reads '{STATE_FORMAT}' only: resume it with the ferrograd that wrote it, or start without --resume"
        )));
    }
    if !meta.contains_key(CHECKSUM_KEY) {
        return Err(bad(
            "it has no checksums, so its data cannot be trusted: it was altered; use another file"
                .into(),
        ));
    }
    check_optimizer(path, &meta, trainer.with_optimizer(|o| o.choice())?)?;
    check_weights(path, &meta, model)?;
    let saved: GptConfig = serde_json::from_str(get("model")?)
        .map_err(|e| bad(format!("unreadable model shape: {e}")))?;
    if saved != model.config {
        return Err(bad(format!(
            "it holds another model shape: saved {}, this run {}; pass the same model flags as the saved run, or start without --resume",
            to_json(&saved)?,
            to_json(&model.config)?
        )));
    }
    if get("vocab")? != &tokenizer.vocab() {
        return Err(bad(
            "it was trained on text with another character set; use the same text as the saved run"
                .into(),
        ));
    }
    if get("trainable")? != &trainable_names(model).join(",") {
        return Err(bad(
            "it was saved with other frozen parameters; pass the same --freeze patterns".into(),
        ));
    }
    let amp = amp_name(trainer.config().amp);
    if get("amp")? != &amp {
        return Err(bad(format!(
            "it was saved with --amp {} and this run uses --amp {amp}: resume with --amp {} (the file holds that mode's state), or start without --resume",
            get("amp")?,
            get("amp")?
        )));
    }
    let step: u64 = parse(get("step")?, "step", &bad)?;
    if step > MAX_STEP {
        return Err(bad(format!(
            "its step {step} is more than any run takes (at most 2^53): the file is corrupt; use another file"
        )));
    }
    let with_state = parse_state_indices(get("optimizer_state")?, trainer, &bad)?;
    let choice = trainer.with_optimizer(|o| o.choice())?;
    if choice == OptimizerChoice::AdamW && step > 0 && with_state.is_empty() {
        return Err(bad(format!(
            "it records step {step} but no AdamW state (a state without it is one saved before the first step): the file is incomplete; use a complete state, or start without --resume"
        )));
    }
    check_manifest(
        &tensors,
        &expected_tensors(model, trainer, &with_state)?,
        &bad,
    )?;
    check_values(&tensors, step, &bad)?;
    let data = parse_rng(get("rng.data")?, &bad)?;
    let default_rng = parse_rng(get("rng.default")?, &bad)?;
    let dropouts = get("rng.dropout")?
        .split(';')
        .map(|s| parse_rng(s, &bad))
        .collect::<Result<Vec<_>>>()?;
    if dropouts.len() != model.dropouts().len() {
        return Err(bad("the dropout streams do not match the model".into()));
    }
    let device = model.wte.weight.device();
    let weights: HashMap<String, Tensor> = tensors
        .iter()
        .filter_map(|(k, t)| k.strip_prefix("model.").map(|n| (n.to_string(), t.clone())))
        .collect();
    let states = trainer.with_optimizer(|o| optimizer_states(o, &tensors, device, &bad))??;
    // Everything is checked; from here on the run is overwritten.
    load_named(model, &weights)?;
    trainer.with_optimizer(|o| restore(o, states))??;
    if let Some(s) = trainer.scaler_mut()
        && tensors.keys().any(|k| k.starts_with("scaler."))
    {
        let scaler: Vec<(String, Tensor)> = tensors
            .iter()
            .filter(|(k, _)| k.starts_with("scaler."))
            .map(|(k, t)| (k.clone(), t.clone()))
            .collect();
        s.load_state_tensors(&scaler)?;
    }
    for (d, g) in model.dropouts().iter().zip(dropouts) {
        d.set_generator_state(g);
    }
    *data_rng = data;
    set_rng_state(default_rng);
    trainer.set_step_index(step);
    Ok(())
}

/// A file saved with another weight precision cannot be resumed: its weights, moments and
/// master copies have other dtypes (or are absent). Files from before the weight precision was
/// recorded are f32's.
fn check_weights(path: &Path, meta: &BTreeMap<String, String>, model: &Gpt) -> Result<()> {
    let saved = meta.get("weights").map_or("f32", String::as_str);
    let requested = weights_name(model);
    if saved == requested {
        return Ok(());
    }
    Err(Error::WeightsMismatch {
        path: path.display().to_string(),
        saved: saved.to_string(),
        requested,
    })
}

/// The dtype the model's parameters are kept in ("f32", "bf16").
fn weights_name(model: &Gpt) -> String {
    model.wte.weight.dtype().to_string()
}

/// A file saved by another optimizer cannot be resumed by this one: its state means nothing
/// here. Files from before the optimizer was recorded are AdamW's.
fn check_optimizer(
    path: &Path,
    meta: &BTreeMap<String, String>,
    requested: OptimizerChoice,
) -> Result<()> {
    let saved = meta.get("optimizer").map_or("adamw", String::as_str);
    if saved == requested.to_string() {
        return Ok(());
    }
    Err(Error::OptimizerMismatch {
        path: path.display().to_string(),
        saved: saved.to_string(),
        requested: requested.to_string(),
    })
}

fn optimizer_tensors(o: &mut JobOptimizer) -> Result<Vec<(String, Tensor)>> {
    match o {
        JobOptimizer::AdamW(a) => adam_tensors(a),
        JobOptimizer::Sgd(s) => Ok(sgd_tensors(s)),
        // A collective: the other ranks gather with rank 0 (`gather_for_save`).
        JobOptimizer::Zero1(z) => {
            let whole = z.gather_state()?;
            adam_state_tensors(whole.iter().map(Option::as_ref))
        }
    }
}

/// What a rank other than 0 does while rank 0 saves: its part of the collectives that make
/// the whole state (ZeRO-1's shards gathered); nothing for a replicated optimizer.
pub fn gather_for_save(trainer: &mut Trainer<JobOptimizer>) -> Result<()> {
    trainer.with_optimizer(|o| match o {
        JobOptimizer::Zero1(z) => z.gather_state().map(drop),
        _ => Ok(()),
    })?
}

fn adam_tensors(o: &Adam) -> Result<Vec<(String, Tensor)>> {
    adam_state_tensors((0..o.params().len()).map(|i| o.state(i)))
}

/// AdamW's moments, master copies and step counts, by parameter index (a sharded AdamW's
/// gathered whole).
fn adam_state_tensors<'a>(
    states: impl Iterator<Item = Option<&'a AdamState>>,
) -> Result<Vec<(String, Tensor)>> {
    let mut v = Vec::new();
    for (i, s) in states.enumerate() {
        if let Some(s) = s {
            v.push((format!("optim.{i}.exp_avg"), s.exp_avg.clone()));
            v.push((format!("optim.{i}.exp_avg_sq"), s.exp_avg_sq.clone()));
            if let Some(w) = &s.master {
                v.push((format!("optim.{i}.master"), w.clone()));
            }
            let step = Tensor::from_vec(vec![s.step as i64], &[], Device::Cpu)?;
            v.push((format!("optim.{i}.step"), step));
        }
    }
    Ok(v)
}

fn sgd_tensors(o: &Sgd) -> Vec<(String, Tensor)> {
    (0..o.params().len())
        .filter_map(|i| {
            let b = o.momentum_buffer(i)?;
            Some((format!("optim.{i}.momentum_buffer"), b.clone()))
        })
        .collect()
}

/// The saved state of either optimizer, checked, ready to restore.
enum SavedStates {
    AdamW(Vec<(usize, AdamState)>),
    Sgd(Vec<(usize, Tensor)>),
}

fn optimizer_states(
    o: &mut JobOptimizer,
    tensors: &HashMap<String, Tensor>,
    device: Device,
    bad: &dyn Fn(String) -> Error,
) -> Result<SavedStates> {
    let master = o.master_weights();
    Ok(match o {
        JobOptimizer::AdamW(a) => {
            SavedStates::AdamW(adam_states(a.params(), master, tensors, device, bad)?)
        }
        JobOptimizer::Sgd(s) => SavedStates::Sgd(momentum_buffers(s, tensors, bad)?),
        JobOptimizer::Zero1(z) => {
            SavedStates::AdamW(adam_states(z.params(), master, tensors, device, bad)?)
        }
    })
}

fn restore(o: &mut JobOptimizer, states: SavedStates) -> Result<()> {
    match (o, states) {
        (JobOptimizer::AdamW(a), SavedStates::AdamW(v)) => {
            v.into_iter().try_for_each(|(i, s)| a.set_state(i, s))
        }
        (JobOptimizer::Zero1(z), SavedStates::AdamW(v)) => z.load_state(v),
        (JobOptimizer::Sgd(s), SavedStates::Sgd(v)) => v
            .into_iter()
            .try_for_each(|(i, b)| s.set_momentum_buffer(i, &b)),
        _ => Err(Error::invalid(
            "load_training_state",
            "the saved state belongs to another optimizer",
        )),
    }
}

/// Every parameter's saved momentum buffer, checked against the parameter.
fn momentum_buffers(
    o: &Sgd,
    tensors: &HashMap<String, Tensor>,
    bad: &dyn Fn(String) -> Error,
) -> Result<Vec<(usize, Tensor)>> {
    let mut out = Vec::new();
    for (i, p) in o.params().iter().enumerate() {
        let Some(b) = tensors.get(&format!("optim.{i}.momentum_buffer")) else {
            continue;
        };
        if b.shape() != p.shape() {
            return Err(bad(format!(
                "momentum buffer {i} has shape {:?}, the parameter {:?}",
                b.shape(),
                p.shape()
            )));
        }
        out.push((i, b.clone()));
    }
    Ok(out)
}

/// Every parameter's saved AdamW state, checked against the parameter, on its device; with
/// `master`, a half-precision parameter's f32 master copy and f32 moments.
fn adam_states(
    params: &[Tensor],
    master: bool,
    tensors: &HashMap<String, Tensor>,
    device: Device,
    bad: &dyn Fn(String) -> Error,
) -> Result<Vec<(usize, AdamState)>> {
    let mut out = Vec::new();
    for (i, p) in params.iter().enumerate() {
        let key = |s: &str| format!("optim.{i}.{s}");
        let (Some(m), Some(v), Some(step)) = (
            tensors.get(&key("exp_avg")),
            tensors.get(&key("exp_avg_sq")),
            tensors.get(&key("step")),
        ) else {
            continue;
        };
        if m.shape() != p.shape() || v.shape() != p.shape() {
            return Err(bad(format!(
                "optimizer state {i} has shape {:?}, the parameter {:?}",
                m.shape(),
                p.shape()
            )));
        }
        let step = step.item()?;
        if !(step >= 0.0 && step.fract() == 0.0) {
            return Err(bad(format!("optimizer step count {step} of parameter {i}")));
        }
        let (dtype, keeps_master) = adam_state_dtype(p, master);
        let owned = |t: &Tensor| t.to_dtype(dtype)?.to_device(device)?.contiguous_owned();
        let copy = match tensors.get(&key("master")) {
            Some(w) if keeps_master => Some(owned(w)?),
            // The manifest check has refused a file whose master copies do not match the run.
            _ => None,
        };
        out.push((
            i,
            AdamState {
                exp_avg: owned(m)?,
                exp_avg_sq: owned(v)?,
                step: step as u64,
                master: copy,
            },
        ));
    }
    Ok(out)
}

/// The dtype of AdamW's state for parameter `p`, and whether it has a master copy: with master
/// weights, an f16/bf16 parameter's moments and copy are f32; otherwise the parameter's dtype.
fn adam_state_dtype(p: &Tensor, master_weights: bool) -> (DType, bool) {
    let half = matches!(p.dtype(), DType::F16 | DType::BF16);
    if master_weights && half {
        (DType::F32, true)
    } else {
        (p.dtype(), false)
    }
}

fn trainable_names(model: &Gpt) -> Vec<String> {
    model
        .named_parameters()
        .into_iter()
        .filter(|(_, p)| p.requires_grad())
        .map(|(n, _)| n)
        .collect()
}

fn to_json(c: &GptConfig) -> Result<String> {
    serde_json::to_string(c).map_err(|e| Error::invalid("save_training_state", e.to_string()))
}

/// A generator as `seed:position`.
fn rng_string(g: &Generator) -> String {
    format!("{}:{}", g.seed(), g.word_pos())
}

fn parse_rng(s: &str, bad: &dyn Fn(String) -> Error) -> Result<Generator> {
    let (seed, pos) = s
        .split_once(':')
        .ok_or_else(|| bad(format!("random state '{s}' is not seed:position")))?;
    let mut g = Generator::new(parse(seed, "seed", bad)?);
    g.set_word_pos(parse(pos, "position", bad)?);
    Ok(g)
}

fn parse<T: std::str::FromStr>(s: &str, what: &str, bad: &dyn Fn(String) -> Error) -> Result<T> {
    s.parse()
        .map_err(|_| bad(format!("{what} '{s}' is not a number")))
}

fn amp_name(amp: Option<DType>) -> String {
    match amp {
        None => "off".into(),
        Some(DType::F16) => "f16".into(),
        Some(DType::BF16) => "bf16".into(),
        Some(d) => d.to_string(),
    }
}

/// The indices of the parameters that have optimizer state.
fn state_indices(o: &mut JobOptimizer) -> Vec<usize> {
    match o {
        JobOptimizer::AdamW(a) => (0..a.params().len())
            .filter(|&i| a.state(i).is_some())
            .collect(),
        JobOptimizer::Sgd(s) => (0..s.params().len())
            .filter(|&i| s.momentum_buffer(i).is_some())
            .collect(),
        JobOptimizer::Zero1(z) if z.has_state() => (0..z.params().len()).collect(),
        JobOptimizer::Zero1(_) => Vec::new(),
    }
}

/// `optimizer_state` read back: `none`, `all` or indices below the optimizer's count.
fn parse_state_indices(
    s: &str,
    trainer: &mut Trainer<JobOptimizer>,
    bad: &dyn Fn(String) -> Error,
) -> Result<Vec<usize>> {
    let n = trainer.with_optimizer(|o| o.params().len())?;
    match s {
        "none" => Ok(Vec::new()),
        "all" => Ok((0..n).collect()),
        list => list
            .split(',')
            .map(|i| {
                let i: usize = parse(i, "optimizer state index", bad)?;
                if i >= n {
                    return Err(bad(format!(
                        "optimizer state index {i} is past the {n} parameters that train"
                    )));
                }
                Ok(i)
            })
            .collect(),
    }
}

/// Every tensor a state of this run holds: name, dtype and shape.
fn expected_tensors(
    model: &Gpt,
    trainer: &mut Trainer<JobOptimizer>,
    with_state: &[usize],
) -> Result<Vec<(String, DType, Vec<usize>)>> {
    let mut out: Vec<(String, DType, Vec<usize>)> = model
        .named_parameters()
        .into_iter()
        .map(|(n, p)| (format!("model.{n}"), p.dtype(), p.shape().to_vec()))
        .collect();
    let (params, choice, master) =
        trainer.with_optimizer(|o| (o.params().to_vec(), o.choice(), o.master_weights()))?;
    for &i in with_state {
        let p = &params[i];
        let (state_dtype, keeps_master) = adam_state_dtype(p, master);
        let like = |s: &str| (format!("optim.{i}.{s}"), p.dtype(), p.shape().to_vec());
        let state = |s: &str| (format!("optim.{i}.{s}"), state_dtype, p.shape().to_vec());
        match choice {
            OptimizerChoice::AdamW => {
                out.push(state("exp_avg"));
                out.push(state("exp_avg_sq"));
                if keeps_master {
                    out.push(state("master"));
                }
                out.push((format!("optim.{i}.step"), DType::I64, Vec::new()));
            }
            OptimizerChoice::Sgd => out.push(like("momentum_buffer")),
        }
    }
    if let Some(s) = trainer.scaler() {
        for (n, t) in s.state_tensors()? {
            out.push((n, t.dtype(), t.shape().to_vec()));
        }
    }
    Ok(out)
}

/// Every expected tensor present with its dtype and shape, and nothing else.
fn check_manifest(
    tensors: &HashMap<String, Tensor>,
    expected: &[(String, DType, Vec<usize>)],
    bad: &dyn Fn(String) -> Error,
) -> Result<()> {
    for (name, dtype, shape) in expected {
        let Some(t) = tensors.get(name) else {
            return Err(bad(format!(
                "it lacks the tensor '{name}' ({dtype}, shape {shape:?}) this run needs: the file is incomplete; use a complete state, or start without --resume"
            )));
        };
        if t.dtype() != *dtype || t.shape() != shape.as_slice() {
            return Err(bad(format!(
                "its tensor '{name}' is {} of shape {:?}, and this run needs {dtype} of shape {shape:?}; use a state saved by the same run, or start without --resume",
                t.dtype(),
                t.shape()
            )));
        }
    }
    let mut extra: Vec<&String> = tensors
        .keys()
        .filter(|k| !expected.iter().any(|(n, _, _)| n == *k))
        .collect();
    extra.sort();
    if let Some(name) = extra.first() {
        return Err(bad(format!(
            "it holds a tensor '{name}' this run has no place for: the file was altered or belongs to another run; use a state saved by the same run"
        )));
    }
    Ok(())
}

/// Values a run cannot have written: non-finite weights or moments, negative second moments,
/// optimizer step counts outside 1..=step, and AdamW without state after the first step.
fn check_values(
    tensors: &HashMap<String, Tensor>,
    step: u64,
    bad: &dyn Fn(String) -> Error,
) -> Result<()> {
    let mut names: Vec<&String> = tensors.keys().collect();
    names.sort();
    for name in names {
        let t = &tensors[name];
        if name.ends_with(".step") && name.starts_with("optim.") {
            let s = t.item()?;
            if !(s >= 1.0 && s <= step as f64) {
                return Err(bad(format!(
                    "its optimizer step count '{name}' is {s}, outside 1..={step}: the file is corrupt; use another file"
                )));
            }
            continue;
        }
        if !t.dtype().is_float() || name.starts_with("scaler.") {
            continue;
        }
        let second_moment = name.ends_with(".exp_avg_sq");
        let ok = |x: f64| x.is_finite() && !(second_moment && x < 0.0);
        let fine = match t.to_host()? {
            HostValues::F32(v) => v.iter().all(|&x| ok(x as f64)),
            HostValues::F64(v) => v.iter().all(|&x| ok(x)),
            HostValues::I64(_) => true,
        };
        if !fine {
            let what = if second_moment {
                "negative, NaN or infinite values"
            } else {
                "NaN or infinite values"
            };
            return Err(bad(format!(
                "its tensor '{name}' holds {what}, which training cannot produce or continue from; resume from an earlier state, or start without --resume"
            )));
        }
    }
    Ok(())
}
