//! Learning-rate schedules. `WarmupCosine`: linear warmup to `max_lr`, then a cosine decay to
//! `min_lr` at `total_steps`, then `min_lr` (the nanoGPT / llm.c schedule). Steps count from
//! 0; set the rate before each optimizer step:
//!
//!   for step in 0..n { opt.set_lr(schedule.lr_at(step))?; ...; opt.step()?; }

use crate::base::{Error, Result};

#[derive(Clone, Copy, Debug, PartialEq)]
pub struct WarmupCosine {
    pub max_lr: f64,
    pub min_lr: f64,
    pub warmup_steps: u64,
    pub total_steps: u64,
}

impl WarmupCosine {
    /// Checks 0 ≤ min_lr ≤ max_lr (finite) and warmup_steps ≤ total_steps.
    pub fn new(max_lr: f64, min_lr: f64, warmup_steps: u64, total_steps: u64) -> Result<Self> {
        let rates_ok = min_lr.is_finite() && max_lr.is_finite() && 0.0 <= min_lr;
        if !rates_ok || min_lr > max_lr {
            return Err(Error::invalid(
                "WarmupCosine",
                format!("needs 0 <= min_lr <= max_lr, got min_lr {min_lr} and max_lr {max_lr}"),
            ));
        }
        if warmup_steps > total_steps {
            return Err(Error::invalid(
                "WarmupCosine",
                format!(
                    "warmup_steps ({warmup_steps}) must not exceed total_steps ({total_steps})"
                ),
            ));
        }
        Ok(WarmupCosine {
            max_lr,
            min_lr,
            warmup_steps,
            total_steps,
        })
    }

    /// The rate of step `step` (0-based):
    /// - step < warmup: max_lr · (step + 1) / warmup_steps
    /// - warmup ≤ step ≤ total: min_lr + ½(1 + cos(π·r))·(max_lr − min_lr),
    ///   r = (step − warmup) / (total − warmup)
    /// - step > total (or no decay phase at all): min_lr
    pub fn lr_at(&self, step: u64) -> f64 {
        let (warmup, total) = (self.warmup_steps, self.total_steps);
        if step < warmup {
            return self.max_lr * (step + 1) as f64 / warmup as f64;
        }
        if step > total || total == warmup {
            return self.min_lr;
        }
        let ratio = (step - warmup) as f64 / (total - warmup) as f64;
        let coeff = 0.5 * (1.0 + (std::f64::consts::PI * ratio).cos());
        self.min_lr + coeff * (self.max_lr - self.min_lr)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn warmup_then_cosine_then_floor() {
        let s = WarmupCosine::new(1.0, 0.1, 4, 14).unwrap();
        assert_eq!(s.lr_at(0), 0.25);
        assert_eq!(s.lr_at(3), 1.0);
        assert_eq!(s.lr_at(4), 1.0); // the decay starts at its top
        assert!((s.lr_at(9) - 0.55).abs() < 1e-12); // halfway: the mean of max and min
        assert!((s.lr_at(14) - 0.1).abs() < 1e-12);
        assert_eq!(s.lr_at(15), 0.1);
        assert_eq!(s.lr_at(1_000_000), 0.1);
        let falling = (4..=14).map(|k| s.lr_at(k)).collect::<Vec<_>>();
        assert!(falling.windows(2).all(|w| w[1] < w[0]));
    }

    #[test]
    fn no_warmup_or_no_decay() {
        let s = WarmupCosine::new(2.0, 0.0, 0, 10).unwrap();
        assert_eq!(s.lr_at(0), 2.0);
        let s = WarmupCosine::new(2.0, 0.5, 3, 3).unwrap();
        assert!((s.lr_at(2) - 2.0).abs() < 1e-15);
        assert_eq!(s.lr_at(3), 0.5);
    }

    #[test]
    fn bad_settings_are_errors() {
        assert!(WarmupCosine::new(0.1, 0.2, 0, 10).is_err());
        assert!(WarmupCosine::new(0.1, -0.1, 0, 10).is_err());
        assert!(WarmupCosine::new(f64::NAN, 0.0, 0, 10).is_err());
        assert!(WarmupCosine::new(0.1, 0.0, 11, 10).is_err());
    }
}
