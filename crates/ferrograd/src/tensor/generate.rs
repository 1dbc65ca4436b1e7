//! New tensors whose values a host-side sequence produces (rand, randn, arange). The bytes are
//! accounted first, so an impossible size is the allocator's typed out-of-memory error; the
//! values are then written straight into the new CPU buffer (no staging copy of the whole
//! tensor, no memory the accounting does not see), or staged once, fallibly, for a GPU
//! upload. Meta tensors draw nothing, as in PyTorch.

use std::sync::Arc;

use super::{DType, Device, Layout, Tensor};
use crate::backend::cpu::CpuData;
use crate::backend::{self, BackendData, HostValues, Storage};
use crate::base::{Error, Result, checked_numel};
use crate::memory::Category;

/// The sequence of values, in row-major order.
pub(crate) enum Draw<'a> {
    /// f32 values, for an F32 tensor drawn without widening.
    F32(&'a mut dyn FnMut() -> f32),
    /// f64 values, rounded to the tensor's dtype as uploads round them.
    F64(&'a mut dyn FnMut() -> f64),
}

impl Tensor {
    /// A new `input` tensor of `shape` holding the values `draw` produces; `origin` names
    /// the op in the allocator's records.
    pub(crate) fn generate(
        shape: &[usize],
        dtype: DType,
        device: Device,
        origin: &'static str,
        draw: Draw,
    ) -> Result<Tensor> {
        let len = checked_numel(origin, shape)?;
        let be = backend::backend(device)?;
        // Staged for a GPU before the block exists, so integer values (positions from
        // arange) can keep their host copy for range checks (Storage::uploaded_i64s).
        let (mut draw, mut staged) = match device {
            Device::Cuda(_) => (None, Some(stage(len, draw)?)),
            _ => (Some(draw), None),
        };
        let remembered = match (&staged, dtype) {
            (Some(HostValues::F64(v)), DType::I64) => {
                Some(v.iter().map(|&x| x as i64).collect::<Arc<[i64]>>())
            }
            _ => None,
        };
        let storage = Storage::new(
            device,
            dtype,
            len,
            Category::Input,
            origin,
            |addr| match device {
                Device::Meta => be.empty(dtype, len, addr),
                Device::Cpu => {
                    let mut data = be.empty(dtype, len, addr)?;
                    if let (BackendData::Cpu(values), Some(draw)) = (&mut data, draw.take()) {
                        fill_cpu(values, draw);
                    }
                    Ok(data)
                }
                Device::Cuda(_) => match staged.take() {
                    Some(values) => be.upload(dtype, values, addr),
                    None => be.empty(dtype, len, addr),
                },
            },
        )?;
        if let Some(v) = remembered {
            storage.remember_upload(v);
        }
        Ok(Tensor::from_storage(
            Arc::new(storage),
            Layout::contiguous(shape),
        ))
    }
}

/// Writes the sequence into a CPU buffer, converting as `CpuData::from_host` converts.
fn fill_cpu(data: &mut CpuData, draw: Draw) {
    fn each<T>(v: &mut [T], next: &mut dyn FnMut() -> f64, conv: impl Fn(f64) -> T) {
        v.iter_mut().for_each(|x| *x = conv(next()));
    }
    match (data, draw) {
        (CpuData::F32(v), Draw::F32(next)) => v.iter_mut().for_each(|x| *x = next()),
        (data, Draw::F32(next)) => fill_cpu(data, Draw::F64(&mut || next() as f64)),
        (CpuData::F32(v), Draw::F64(next)) => each(v, next, |x| x as f32),
        (CpuData::F64(v), Draw::F64(next)) => each(v, next, |x| x),
        (CpuData::F16(v), Draw::F64(next)) => each(v, next, crate::base::f16_of),
        (CpuData::BF16(v), Draw::F64(next)) => each(v, next, crate::base::bf16_of),
        (CpuData::I64(v), Draw::F64(next)) => each(v, next, |x| x as i64),
        (CpuData::U8(v), Draw::F64(next)) => each(v, next, |x| (x != 0.0) as u8),
    }
}

/// The whole sequence as host values for a device upload; a host that cannot hold them is an
/// error, never an abort.
fn stage(len: usize, draw: Draw) -> Result<HostValues> {
    fn collect<T>(len: usize, next: &mut dyn FnMut() -> T) -> Result<Vec<T>> {
        let mut v = Vec::new();
        v.try_reserve_exact(len).map_err(|_| {
            Error::invalid(
                "allocate",
                format!("the host could not stage {len} values for the upload; use smaller sizes"),
            )
        })?;
        v.extend((0..len).map(|_| next()));
        Ok(v)
    }
    Ok(match draw {
        Draw::F32(next) => HostValues::F32(collect(len, next)?),
        Draw::F64(next) => HostValues::F64(collect(len, next)?),
    })
}
