//! Where a tensor lives. `Cpu` is the reference backend; `Cuda(ordinal)` is a GPU; `Meta`
//! computes shapes and runs the allocator's accounting without touching memory (used by the
//! planner). Every device has exactly one allocator, the only source of its byte counts.

use std::fmt;
use std::str::FromStr;

use crate::base::Error;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Device {
    Cpu,
    Cuda(usize),
    Meta,
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Device::Cpu => f.write_str("cpu"),
            Device::Cuda(i) => write!(f, "cuda:{i}"),
            Device::Meta => f.write_str("meta"),
        }
    }
}

impl FromStr for Device {
    type Err = Error;

    /// Parses `cpu`, `cuda`, `cuda:N` and `meta`, the spellings PyTorch users know.
    fn from_str(s: &str) -> Result<Self, Error> {
        let s = s.trim().to_ascii_lowercase();
        match s.as_str() {
            "cpu" => Ok(Device::Cpu),
            "meta" => Ok(Device::Meta),
            "cuda" | "gpu" => Ok(Device::Cuda(0)),
            _ => s
                .strip_prefix("cuda:")
                .and_then(|n| n.parse().ok())
                .map(Device::Cuda)
                .ok_or_else(|| {
                    Error::invalid(
                        "device",
                        format!("unknown device '{s}': use cpu, cuda, cuda:N or meta"),
                    )
                }),
        }
    }
}
