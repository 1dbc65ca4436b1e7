//! The out-of-memory report: an error value that says what was asked, what is allocated and
//! by whom, and what to try. Never a crash.

use std::fmt;

use super::category::{Category, CategoryBytes};
use super::device::Device;
use super::format::format_size;

#[derive(Clone, Debug)]
pub struct LiveBlockInfo {
    pub bytes: u64,
    pub category: Category,
    pub origin: &'static str,
}

#[derive(Clone, Debug)]
pub struct OomReport {
    pub device: Device,
    pub requested: u64,
    pub origin: &'static str,
    pub capacity: u64,
    pub free: u64,
    pub allocated: u64,
    pub reserved: u64,
    pub by_category: CategoryBytes,
    pub largest: Vec<LiveBlockInfo>,
}

impl OomReport {
    /// Advice ordered by what usually helps most given what holds the memory.
    pub fn advice(&self) -> Vec<&'static str> {
        let mut tips = Vec::new();
        let saved = self.by_category.get(Category::SavedActivation);
        if saved * 4 >= self.allocated {
            tips.push("activations dominate: use a smaller batch, gradient accumulation (--accum N), or activation recomputation (--recompute every:1)");
        } else {
            tips.push("use a smaller batch or gradient accumulation (--accum N)");
        }
        tips.push("mixed precision (--amp bf16) halves activation and weight-copy bytes");
        if self.by_category.get(Category::OptimizerState) > 0 {
            tips.push("optimizer state is large: SGD keeps less than Adam; --step-in-backward frees gradients as they are used");
        }
        if self.reserved > self.allocated.saturating_mul(2) && self.reserved > 0 {
            tips.push("reserved is far above allocated: call empty_cache() or reduce fragmentation by keeping shapes constant");
        }
        tips
    }
}

impl fmt::Display for OomReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "out of memory on {}: tried to allocate {} for {}. The device has a total capacity of {} of which {} is free; {} is allocated by ferrograd and {} reserved.",
            self.device,
            format_size(self.requested),
            self.origin,
            format_size(self.capacity),
            format_size(self.free),
            format_size(self.allocated),
            format_size(self.reserved),
        )?;
        writeln!(f, "allocated by category:")?;
        for (c, b) in self.by_category.iter().filter(|(_, b)| *b > 0) {
            writeln!(f, "  {:<17} {:>12}", c.name(), format_size(b))?;
        }
        if !self.largest.is_empty() {
            writeln!(f, "largest live blocks:")?;
            for b in &self.largest {
                writeln!(
                    f,
                    "  {:>12}  {:<17} from {}",
                    format_size(b.bytes),
                    b.category.name(),
                    b.origin
                )?;
            }
        }
        writeln!(f, "what to try:")?;
        for tip in self.advice() {
            writeln!(f, "  - {tip}")?;
        }
        Ok(())
    }
}
