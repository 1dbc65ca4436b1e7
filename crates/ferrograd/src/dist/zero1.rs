//! `Zero1`: AdamW with its state sharded over the ranks (ZeRO stage 1). The trainable
//! parameters of one dtype are laid end to end in a flat vector of `total` elements, padded
//! with zeros to `world · shard` where `shard = ceil(total / world)`; rank r owns elements
//! [r·shard, (r+1)·shard) and keeps exp_avg and exp_avg_sq for them only. A step:
//!
//!   local .grad (each rank its own batch)  →  reduce-scatter (average) into the rank's
//!   gradient shard  →  AdamW on the parameter shard  →  all-gather of the updated shards
//!   into every replica's parameters
//!
//! AdamW is elementwise, so updating a shard is bitwise the update `Adam::adamw` applies to
//! those elements of the whole model. Per-rank optimizer state: 2 · shard elements per dtype
//! (total / world, plus at most world − 1 padding elements). During a step the flattened
//! gradient and parameters (world · shard each) and the shard's parameter copy are
//! temporaries. Gradients stay unreduced until `step`, so global-norm clipping and a
//! GradScaler's inf check, which need the reduced gradients, are refused by the Trainer.

use std::sync::Arc;

use super::group::{ProcessGroup, ReduceOp};
use crate::autograd::no_grad;
use crate::base::{Error, Result};
use crate::memory::Category;
use crate::optim::{Adam, AdamConfig, AdamState, Optimizer, check_lr};
use crate::tensor::{DType, Tensor};

/// The parameters of one dtype and this rank's share of their state.
struct Shard {
    members: Vec<usize>,
    /// Element offset of each member in the flat vector.
    offsets: Vec<usize>,
    /// Elements of this rank's shard (the flat vector holds world · shard).
    shard: usize,
    state: Option<AdamState>,
}

pub struct Zero1 {
    group: Arc<dyn ProcessGroup>,
    names: Vec<String>,
    params: Vec<Tensor>,
    cfg: AdamConfig,
    shards: Vec<Shard>,
    steps: u64,
}

impl Zero1 {
    /// Sharded AdamW over `named` (the trainable parameters, in the module's order). The
    /// parameters take rank 0's values first, so every replica starts equal.
    pub fn adamw(
        named: Vec<(String, Tensor)>,
        cfg: AdamConfig,
        group: Arc<dyn ProcessGroup>,
    ) -> Result<Zero1> {
        // Validates the configuration and the parameters as AdamW would.
        let (names, params): (Vec<String>, Vec<Tensor>) = named.into_iter().unzip();
        Adam::adamw(params.clone(), cfg.clone())?;
        for (name, p) in names.iter().zip(&params) {
            group.broadcast(p, 0).map_err(|e| {
                Error::invalid(
                    "ZeRO-1",
                    format!("broadcasting parameter {name} from rank 0: {e}"),
                )
            })?;
        }
        let shards = plan_shards(&params, group.world_size());
        Ok(Zero1 {
            group,
            names,
            params,
            cfg,
            shards,
            steps: 0,
        })
    }

    /// This rank's optimizer-state bytes (exp_avg and exp_avg_sq of its shards).
    pub fn state_bytes(&self) -> usize {
        let of = |s: &AdamState| s.exp_avg.nbytes() + s.exp_avg_sq.nbytes();
        self.shards
            .iter()
            .filter_map(|s| s.state.as_ref())
            .map(of)
            .sum()
    }

    /// Padding elements added so each dtype's flat vector divides by the world size.
    pub fn padding_elements(&self) -> usize {
        let world = self.group.world_size();
        self.shards
            .iter()
            .map(|s| world * s.shard - flat_len(&self.params, &s.members))
            .sum()
    }

    pub fn step_count(&self) -> u64 {
        self.steps
    }

    /// Whether a step has made the moments (every shard has them after the first step).
    pub fn has_state(&self) -> bool {
        self.shards.iter().all(|s| s.state.is_some())
    }

    /// Every parameter's AdamW state, gathered whole from the ranks' shards: what plain
    /// AdamW over the same parameters would hold, so a saved state resumes on any number of
    /// ranks, sharded or not. A collective: every rank calls it; each gets the whole state.
    pub fn gather_state(&self) -> Result<Vec<Option<AdamState>>> {
        let _g = no_grad();
        let mut out: Vec<Option<AdamState>> = vec![None; self.params.len()];
        for s in &self.shards {
            let Some(st) = &s.state else { continue };
            let exp_avg = self.gather_flat(s, &st.exp_avg)?;
            let exp_avg_sq = self.gather_flat(s, &st.exp_avg_sq)?;
            for (k, &m) in s.members.iter().enumerate() {
                let p = &self.params[m];
                let cut = |flat: &Tensor| {
                    flat.narrow(0, s.offsets[k], p.numel())?
                        .reshape(p.shape())?
                        .contiguous_owned()
                };
                out[m] = Some(AdamState {
                    exp_avg: cut(&exp_avg)?,
                    exp_avg_sq: cut(&exp_avg_sq)?,
                    step: st.step,
                    master: None,
                });
            }
        }
        Ok(out)
    }

    /// The shards of every rank, end to end: (world · shard,).
    fn gather_flat(&self, s: &Shard, own: &Tensor) -> Result<Tensor> {
        let world = self.group.world_size();
        let flat = alloc_like(
            own,
            world * s.shard,
            Category::OptimizerState,
            "zero1_gathered_state",
        )?;
        self.group.all_gather(own, &flat)?;
        Ok(flat)
    }

    /// Takes this rank's shard of a whole state (as `gather_state` gives, or plain AdamW
    /// saved): the moments of every parameter of a dtype, or of none of them.
    pub fn load_state(&mut self, states: Vec<(usize, AdamState)>) -> Result<()> {
        let _g = no_grad();
        let mut by_param: Vec<Option<AdamState>> = vec![None; self.params.len()];
        for (i, st) in states {
            let slot = by_param.get_mut(i).ok_or_else(|| {
                Error::invalid("ZeRO-1", format!("no parameter {i} to take a state"))
            })?;
            *slot = Some(st);
        }
        let rank = self.group.rank();
        for k in 0..self.shards.len() {
            let s = &self.shards[k];
            let given: Vec<&AdamState> = s
                .members
                .iter()
                .filter_map(|&m| by_param[m].as_ref())
                .collect();
            if given.is_empty() {
                continue;
            }
            if given.len() != s.members.len() || given.iter().any(|g| g.step != given[0].step) {
                return Err(Error::invalid(
                    "ZeRO-1",
                    "a sharded AdamW takes the moments of every parameter of a dtype at one step count; the state holds some of them only",
                ));
            }
            let step = given[0].step;
            let pick = |f: fn(&AdamState) -> &Tensor| -> Result<Tensor> {
                let flat = self.flatten(s, |m| match &by_param[m] {
                    Some(st) => Ok(f(st).clone()),
                    None => Err(Error::invalid("ZeRO-1", "missing moment")),
                })?;
                let own = flat
                    .narrow(0, rank * s.shard, s.shard)?
                    .contiguous_owned()?;
                own.set_category(Category::OptimizerState);
                Ok(own)
            };
            let state = AdamState {
                exp_avg: pick(|st| &st.exp_avg)?,
                exp_avg_sq: pick(|st| &st.exp_avg_sq)?,
                step,
                master: None,
            };
            self.steps = step;
            self.shards[k].state = Some(state);
        }
        Ok(())
    }

    /// The flat vector (world · shard,) of `members`' values picked by `value` (zeros in the
    /// padding), as a temporary.
    fn flatten(&self, s: &Shard, value: impl Fn(usize) -> Result<Tensor>) -> Result<Tensor> {
        let p0 = &self.params[s.members[0]];
        let world = self.group.world_size();
        let flat = alloc_like(p0, world * s.shard, Category::Temporary, "zero1_flat")?;
        for (k, &m) in s.members.iter().enumerate() {
            let n = self.params[m].numel();
            flat.narrow(0, s.offsets[k], n)?
                .copy_(&value(m)?.reshape(&[n])?)?;
        }
        Ok(flat)
    }

    fn grad_of(&self, m: usize) -> Result<Tensor> {
        self.params[m].grad().ok_or_else(|| {
            Error::invalid(
                "ZeRO-1",
                format!(
                    "parameter {} has no gradient; every rank must reduce every shard, so each trainable parameter must take part in the loss (freeze unused ones before building the optimizer)",
                    self.names[m]
                ),
            )
        })
    }

    /// Reduce-scatter, local AdamW, all-gather for one dtype's parameters.
    fn step_shard(&mut self, k: usize) -> Result<()> {
        let (rank, world) = (self.group.rank(), self.group.world_size());
        let s = &self.shards[k];
        let n = s.shard;
        let p0 = self.params[s.members[0]].clone();
        let grads = self.flatten(s, |m| self.grad_of(m))?;
        let grad = alloc_like(&p0, n, Category::Gradient, "zero1_grad")?;
        self.group.reduce_scatter(&grads, &grad, ReduceOp::Avg)?;
        drop(grads);
        let flat = self.flatten(s, |m| Ok(self.params[m].clone()))?;
        let own = alloc_like(&p0, n, Category::Temporary, "zero1_param")?;
        own.copy_(&flat.narrow(0, rank * n, n)?)?;
        own.set_grad(Some(grad))?;
        let state = adamw_on(&own, &self.cfg, s.state.clone())?;
        self.shards[k].state = Some(state);
        self.group.all_gather(&own, &flat)?;
        let s = &self.shards[k];
        for (j, &m) in s.members.iter().enumerate() {
            let p = &self.params[m];
            p.copy_(
                &flat
                    .narrow(0, s.offsets[j], p.numel())?
                    .reshape(p.shape())?,
            )?;
        }
        debug_assert_eq!(flat.numel(), world * n);
        Ok(())
    }
}

/// One AdamW step of the owned shard `own` (its `.grad` set), continuing from `state`.
fn adamw_on(own: &Tensor, cfg: &AdamConfig, state: Option<AdamState>) -> Result<AdamState> {
    let mut adam = Adam::adamw(vec![own.clone()], cfg.clone())?;
    if let Some(st) = state {
        adam.set_state(0, st)?;
    }
    adam.step()?;
    adam.state(0)
        .cloned()
        .ok_or_else(|| Error::invalid("ZeRO-1", "AdamW made no state for the shard"))
}

/// Groups the parameters by dtype, in first-seen order, and sizes each rank's shard.
fn plan_shards(params: &[Tensor], world: usize) -> Vec<Shard> {
    let mut by_dtype: Vec<(DType, Vec<usize>)> = Vec::new();
    for (i, p) in params.iter().enumerate() {
        match by_dtype.iter_mut().find(|(d, _)| *d == p.dtype()) {
            Some((_, v)) => v.push(i),
            None => by_dtype.push((p.dtype(), vec![i])),
        }
    }
    by_dtype
        .into_iter()
        .map(|(_, members)| {
            let mut offsets = Vec::with_capacity(members.len());
            let mut total = 0;
            for &m in &members {
                offsets.push(total);
                total += params[m].numel();
            }
            Shard {
                members,
                offsets,
                shard: total.div_ceil(world),
                state: None,
            }
        })
        .collect()
}

fn flat_len(params: &[Tensor], members: &[usize]) -> usize {
    members.iter().map(|&m| params[m].numel()).sum()
}

impl Optimizer for Zero1 {
    fn step(&mut self) -> Result<()> {
        let _g = no_grad();
        for k in 0..self.shards.len() {
            self.step_shard(k)?;
        }
        self.steps += 1;
        Ok(())
    }

    fn step_param(&mut self, _index: usize) -> Result<()> {
        Err(Error::invalid(
            "ZeRO-1",
            "a sharded optimizer steps all parameters at once (its shards cut across them); step in backward is not available",
        ))
    }

    fn params(&self) -> &[Tensor] {
        &self.params
    }

    fn name(&self) -> &'static str {
        "AdamW (ZeRO-1)"
    }

    fn graph_support(&self) -> std::result::Result<(), String> {
        Err("ZeRO-1 reduces and gathers across ranks inside its step, which is not captured".into())
    }

    fn lr(&self) -> f64 {
        self.cfg.lr
    }

    fn set_lr(&mut self, lr: f64) -> Result<()> {
        check_lr("ZeRO-1", lr)?;
        self.cfg.lr = lr;
        Ok(())
    }

    fn reduces_gradients_in_step(&self) -> bool {
        true
    }
}

/// A zeroed (n,) buffer in `like`'s dtype and on its device, counted as `category`.
fn alloc_like(like: &Tensor, n: usize, category: Category, what: &'static str) -> Result<Tensor> {
    Tensor::alloc(&[n], like.dtype(), like.device(), category, what)
}
