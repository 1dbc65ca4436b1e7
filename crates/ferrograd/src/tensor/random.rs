//! Seeded random numbers. A `Generator` is a ChaCha8 stream: the same seed gives the same
//! tensors on every machine. A process-wide default generator serves `rand`/`randn`, seeded
//! with `manual_seed` (as in PyTorch).

use std::sync::{Mutex, OnceLock};

use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rand_distr::StandardNormal;

#[derive(Clone, Debug)]
pub struct Generator {
    rng: ChaCha8Rng,
    seed: u64,
}

impl Generator {
    pub fn new(seed: u64) -> Self {
        Generator {
            rng: ChaCha8Rng::seed_from_u64(seed),
            seed,
        }
    }

    pub fn seed(&self) -> u64 {
        self.seed
    }

    /// Uniform samples in [low, high).
    pub fn uniform(&mut self, n: usize, low: f64, high: f64) -> Vec<f64> {
        (0..n).map(|_| self.next_uniform(low, high)).collect()
    }

    /// Uniform f32 samples in [low, high), drawn without an f64 buffer.
    pub fn uniform_f32(&mut self, n: usize, low: f32, high: f32) -> Vec<f32> {
        (0..n).map(|_| self.next_uniform_f32(low, high)).collect()
    }

    /// Normal samples with the given mean and standard deviation.
    pub fn normal(&mut self, n: usize, mean: f64, std: f64) -> Vec<f64> {
        (0..n).map(|_| self.next_normal(mean, std)).collect()
    }

    /// The next uniform sample in [low, high).
    pub fn next_uniform(&mut self, low: f64, high: f64) -> f64 {
        low + (high - low) * self.rng.random::<f64>()
    }

    /// The next uniform f32 sample in [low, high).
    pub fn next_uniform_f32(&mut self, low: f32, high: f32) -> f32 {
        low + (high - low) * self.rng.random::<f32>()
    }

    /// The next 64 random bits (a dropout mask's Philox key).
    pub fn next_u64(&mut self) -> u64 {
        self.rng.random::<u64>()
    }

    /// The next normal sample.
    pub fn next_normal(&mut self, mean: f64, std: f64) -> f64 {
        mean + std * self.rng.sample::<f64, _>(StandardNormal)
    }

    /// The stream position, so a saved state can resume the same sequence.
    pub fn word_pos(&self) -> u128 {
        self.rng.get_word_pos()
    }

    /// Restores a stream position saved with `word_pos`.
    pub fn set_word_pos(&mut self, pos: u128) {
        self.rng.set_word_pos(pos);
    }
}

fn default_generator() -> &'static Mutex<Generator> {
    static G: OnceLock<Mutex<Generator>> = OnceLock::new();
    G.get_or_init(|| Mutex::new(Generator::new(0)))
}

/// Seeds the default generator.
pub fn manual_seed(seed: u64) {
    *default_generator()
        .lock()
        .unwrap_or_else(|e| e.into_inner()) = Generator::new(seed);
}

/// Runs `f` with the default generator.
pub(crate) fn with_default<R>(f: impl FnOnce(&mut Generator) -> R) -> R {
    f(&mut default_generator()
        .lock()
        .unwrap_or_else(|e| e.into_inner()))
}

/// A copy of the default generator's state (`torch.get_rng_state`).
pub fn get_rng_state() -> Generator {
    with_default(|g| g.clone())
}

/// Restores a state taken with `get_rng_state` (`torch.set_rng_state`).
pub fn set_rng_state(state: Generator) {
    with_default(|g| *g = state);
}
