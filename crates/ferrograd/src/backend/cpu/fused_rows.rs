//! (being written)

use crate::backend::{FusedOp, Storage, View};
use crate::error::{Error, Result};

pub(crate) fn run(op: &FusedOp, _inputs: &[View], _outputs: &[&Storage]) -> Result<()> {
    Err(Error::invalid("fused", format!("{op:?} has no CPU kernel yet")))
}
