//! An optimizer with only the methods the `Optimizer` trait requires (an SGD inside): it
//! cannot skip a step on the device nor take its rate from device memory, so the tests can
//! show what happens to such an optimizer.

use ferrograd::optim::{Optimizer, Sgd};
use ferrograd::{Result, Tensor};

pub struct HostOnly(pub Sgd);

impl Optimizer for HostOnly {
    fn step(&mut self) -> Result<()> {
        self.0.step()
    }
    fn step_param(&mut self, index: usize) -> Result<()> {
        self.0.step_param(index)
    }
    fn params(&self) -> &[Tensor] {
        self.0.params()
    }
    fn name(&self) -> &'static str {
        "HostOnly"
    }
    fn lr(&self) -> f64 {
        self.0.lr()
    }
    fn set_lr(&mut self, lr: f64) -> Result<()> {
        self.0.set_lr(lr)
    }
}
