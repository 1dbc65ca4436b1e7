//! The one error type of the library. Every failure a user can cause (shapes, dtypes, devices,
//! autograd misuse, files, out of memory) is a variant here with a message that says what to do.
//! Panics are reserved for broken internal invariants.

use super::oom::OomReport;
use super::{DType, Device};

/// Result alias used across the crate.
pub type Result<T> = std::result::Result<T, Error>;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("shape mismatch in {op}: {detail}")]
    Shape { op: &'static str, detail: String },

    #[error(
        "dtype mismatch in {op}: expected {expected:?}, got {got:?}; convert with .to_dtype() first"
    )]
    DType {
        op: &'static str,
        expected: DType,
        got: DType,
    },

    #[error("{op} does not support dtype {dtype:?}: {hint}")]
    UnsupportedDType {
        op: &'static str,
        dtype: DType,
        hint: &'static str,
    },

    #[error(
        "device mismatch in {op}: tensors on {a} and {b}; move one with .to_device() so both are on the same device"
    )]
    DeviceMismatch {
        op: &'static str,
        a: Device,
        b: Device,
    },

    #[error("device {device} is not available: {reason}")]
    DeviceUnavailable { device: Device, reason: String },

    #[error("{op}: the operation is not supported on {device}")]
    NotSupportedOnDevice { op: &'static str, device: Device },

    #[error("index out of range in {op}: {detail}")]
    Index { op: &'static str, detail: String },

    #[error("invalid argument to {op}: {detail}")]
    InvalidArgument { op: &'static str, detail: String },

    #[error("{0}")]
    Autograd(String),

    #[error("{0}")]
    OutOfMemory(Box<OomReport>),

    #[error("{what} needs about {needed} at its peak but only {available} is available on {device}; {hint}", needed = super::format::format_size(*.needed), available = super::format::format_size(*.available))]
    DoesNotFit {
        what: String,
        device: Device,
        needed: u64,
        available: u64,
        hint: String,
    },

    #[error("i/o error on {path}: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },

    #[error("bad file {path}: {detail}")]
    BadFile { path: String, detail: String },

    /// The run was stopped (by a signal) at a step boundary; `detail` says what was kept.
    #[error("interrupted at step {step}: {detail}")]
    Interrupted { step: u64, detail: String },

    /// A resumed state has already reached the run's last step: nothing is left to train.
    #[error(
        "{path} is already finished: it reached step {step} of --max-steps {max_steps}, so nothing is left to train; raise --max-steps to train further"
    )]
    AlreadyFinished {
        path: String,
        step: u64,
        max_steps: u64,
    },

    /// A path the run cannot write its output to, found before any work starts.
    #[error("cannot save to {path}: {detail}")]
    OutputPath { path: String, detail: String },

    /// Launching or joining a multi-process run went wrong: the torchrun variables, the
    /// rendezvous, a rank that did not arrive. `context` names the step that failed.
    #[error("{context}: {detail}")]
    Distributed {
        context: &'static str,
        detail: String,
    },

    #[error(
        "{path} was saved by a run with --optimizer {saved}, and this run uses --optimizer {requested}: resume with --optimizer {saved}, or start without --resume"
    )]
    OptimizerMismatch {
        path: String,
        saved: String,
        requested: String,
    },

    /// A resumed state was saved with another weight precision: its parameters, moments and
    /// master copies (present only with half-precision weights) do not fit this run.
    #[error(
        "{path} was saved by a run with --weights {saved}, and this run uses --weights {requested} (bf16 weights keep f32 master copies in AdamW's state, f32 weights none): resume with --weights {saved}, or start without --resume"
    )]
    WeightsMismatch {
        path: String,
        saved: String,
        requested: String,
    },
}

impl Error {
    pub(crate) fn shape(op: &'static str, detail: impl Into<String>) -> Self {
        Error::Shape {
            op,
            detail: detail.into(),
        }
    }

    pub(crate) fn invalid(op: &'static str, detail: impl Into<String>) -> Self {
        Error::InvalidArgument {
            op,
            detail: detail.into(),
        }
    }

    pub(crate) fn distributed(context: &'static str, detail: impl Into<String>) -> Self {
        Error::Distributed {
            context,
            detail: detail.into(),
        }
    }

    pub(crate) fn autograd(msg: impl Into<String>) -> Self {
        Error::Autograd(msg.into())
    }

    /// True for out-of-memory errors: callers can retry with a smaller batch.
    pub fn is_out_of_memory(&self) -> bool {
        matches!(self, Error::OutOfMemory(_))
    }
}
