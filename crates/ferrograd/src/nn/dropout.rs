//! Dropout as a module: inverted dropout with probability `p` while training, the identity in
//! eval mode. Each module owns its generator, seeded at construction, so a run with the same
//! seeds draws the same masks; it sits behind a mutex because `forward` takes `&self`.
//! Clones share the generator (a recomputed block replays its masks through a clone).

use std::sync::{Arc, Mutex};

use super::Module;
use crate::base::{Error, Result};
use crate::tensor::{Generator, Tensor};

#[derive(Clone)]
pub struct Dropout {
    pub p: f64,
    pub training: bool,
    rng: Arc<Mutex<Generator>>,
}

impl Dropout {
    /// A dropout layer in training mode; `p` must lie in [0, 1).
    pub fn new(p: f64, seed: u64) -> Result<Dropout> {
        // p = 1 would zero everything and scale by 1/0: no model wants that.
        if !(0.0..1.0).contains(&p) {
            return Err(Error::invalid(
                "Dropout",
                format!("p must be a probability in [0, 1), got {p}"),
            ));
        }
        Ok(Dropout {
            p,
            training: true,
            rng: Arc::new(Mutex::new(Generator::new(seed))),
        })
    }

    /// The generator's current state (to replay masks or save training state).
    pub fn generator_state(&self) -> Generator {
        self.rng.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Whether it drops anything now (training with p > 0).
    pub fn acts(&self) -> bool {
        self.training && self.p > 0.0
    }

    /// Runs `f` with this layer's generator (for ops that draw their own mask, such as the
    /// fused attention's).
    pub(crate) fn with_generator<R>(&self, f: impl FnOnce(&mut Generator) -> R) -> R {
        f(&mut self.rng.lock().unwrap_or_else(|e| e.into_inner()))
    }

    /// Continues from a state taken with `generator_state`.
    pub fn set_generator_state(&self, state: Generator) {
        *self.rng.lock().unwrap_or_else(|e| e.into_inner()) = state;
    }
}

impl Module for Dropout {
    /// x: (...) → (...)
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        if self.p == 0.0 || !self.training {
            return Ok(x.clone());
        }
        let mut rng = self.rng.lock().unwrap_or_else(|e| e.into_inner());
        x.dropout(self.p, self.training, &mut rng)
    }

    fn named_parameters(&self) -> Vec<(String, Tensor)> {
        Vec::new()
    }

    fn train(&mut self, mode: bool) {
        self.training = mode;
    }
}
