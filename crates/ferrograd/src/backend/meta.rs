//! The meta backend: shapes and allocator accounting only. Every kernel is a no-op, so a
//! training step can run on it to predict memory without touching any.

use super::{
    Backend, BackendData, BinaryOp, FusedOp, HostValues, MatmulSpec, ReduceOp, Storage, UnaryOp,
    View,
};
use crate::base::{DType, Device};
use crate::base::{Error, Result};

pub struct MetaBackend;

impl Backend for MetaBackend {
    fn zeros(&self, _: DType, _: usize, _: u64) -> Result<BackendData> {
        Ok(BackendData::Meta)
    }
    fn upload(&self, _: DType, _: HostValues, _: u64) -> Result<BackendData> {
        Ok(BackendData::Meta)
    }
    fn to_host(&self, _: View) -> Result<HostValues> {
        Err(Error::NotSupportedOnDevice {
            op: "reading values (meta tensors have shapes but no data)",
            device: Device::Meta,
        })
    }
    fn copy(&self, _: View, _: View) -> Result<()> {
        Ok(())
    }
    fn fill(&self, _: &Storage, _: f64) -> Result<()> {
        Ok(())
    }
    fn unary(&self, _: UnaryOp, _: View, _: &Storage) -> Result<()> {
        Ok(())
    }
    fn binary(&self, _: BinaryOp, _: View, _: View, _: &Storage) -> Result<()> {
        Ok(())
    }
    fn binary_inplace(&self, _: BinaryOp, _: &Storage, _: View) -> Result<()> {
        Ok(())
    }
    fn reduce(&self, _: ReduceOp, _: View, _: &[usize], _: &Storage) -> Result<()> {
        Ok(())
    }
    fn matmul(&self, _: &MatmulSpec, _: View, _: View, _: &Storage) -> Result<()> {
        Ok(())
    }
    fn fused(&self, _: &FusedOp, _: &[View], _: &[&Storage]) -> Result<()> {
        Ok(())
    }
}
