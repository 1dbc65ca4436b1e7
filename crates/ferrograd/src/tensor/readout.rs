//! Numbers a step computes on the device (its loss, every rank's peak), read back to the host
//! only when someone looks at them. Reading a value waits for the device; a training loop that
//! reads its loss every step cannot run ahead of the GPU, so the step hands out a `Readout`
//! and the log reads it on the steps it prints, as `loss.item()` is called in PyTorch only
//! when logging.

use std::sync::{Arc, Mutex};

use super::Tensor;
use crate::base::Result;

/// One or more values still on the device, read once and cached; clones share the cache.
#[derive(Clone, Debug)]
pub struct Readout {
    source: Option<Tensor>,
    values: Arc<Mutex<Option<Vec<f64>>>>,
}

impl Readout {
    /// Values already on the host.
    pub fn ready(values: Vec<f64>) -> Readout {
        Readout {
            source: None,
            values: Arc::new(Mutex::new(Some(values))),
        }
    }

    /// The elements of `t` (any float dtype, any device), read when first asked for.
    pub fn pending(t: Tensor) -> Readout {
        Readout {
            source: Some(t),
            values: Arc::new(Mutex::new(None)),
        }
    }

    /// Every value, in the tensor's element order (waits for the device the first time).
    pub fn values(&self) -> Result<Vec<f64>> {
        let mut cached = self.values.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(v) = cached.as_ref() {
            return Ok(v.clone());
        }
        let v = match &self.source {
            Some(t) => t.to_vec::<f64>()?,
            None => Vec::new(),
        };
        *cached = Some(v.clone());
        Ok(v)
    }

    /// The first value (the loss of a step); NaN when there is none.
    pub fn value(&self) -> Result<f64> {
        Ok(self.values()?.first().copied().unwrap_or(f64::NAN))
    }

    /// Whether the values were already read (looking costs no wait).
    pub fn is_read(&self) -> bool {
        self.values
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .is_some()
    }

    /// The device tensor behind a pending readout (None once only host values exist).
    pub fn tensor(&self) -> Option<&Tensor> {
        self.source.as_ref()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tensor::{DType, Device};

    #[test]
    fn a_pending_value_is_read_once_and_shared_by_clones() {
        let t = Tensor::from_vec_as(vec![2.5f64, -1.0], &[2], DType::F32, Device::Cpu).unwrap();
        let r = Readout::pending(t.clone());
        let copy = r.clone();
        assert!(!r.is_read());
        assert_eq!(r.value().unwrap(), 2.5);
        assert!(copy.is_read());
        // The cache, not the tensor, answers from now on.
        t.fill_(7.0).unwrap();
        assert_eq!(copy.values().unwrap(), vec![2.5, -1.0]);
    }

    #[test]
    fn ready_values_need_no_tensor() {
        let r = Readout::ready(vec![3.0]);
        assert!(r.is_read() && r.tensor().is_none());
        assert_eq!(r.value().unwrap(), 3.0);
        assert!(Readout::ready(Vec::new()).value().unwrap().is_nan());
    }
}
