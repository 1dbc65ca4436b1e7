//! ferrograd: a training engine whose first concern is memory.
//!
//! The tour, bottom up:
//! - `memory`: one allocator per device, the only source of byte counts. PyTorch-style
//!   statistics (`memory_allocated`, `max_memory_allocated`, `memory_reserved`, ...) and a
//!   category for every live block (parameter, gradient, saved activation, optimizer state,
//!   input, workspace, temporary) that always sums to `memory_allocated`.
//! - `backend`: a narrow trait over devices; op kinds travel as data. `cpu` is the reference.
//!   Backends know nothing of autograd.
//! - `tensor`: `Tensor` = `Arc` over a storage + layout + autograd state; views share storage.
//! - `autograd`: dynamic graphs, an iterative deterministic backward engine, PyTorch's
//!   `.grad` semantics, `retain_graph`, `no_grad`, custom functions and hooks.
//! - `ops`: every op's forward and backward side by side.
//! - `nn`, `optim`: modules and optimizers on top.
//! - `train`: memory strategies, one small file each (recomputation, freezing, ...).
//! - `data`, `io`: the shipped corpus with a character tokenizer; training state in
//!   safetensors with atomic writes.

pub mod amp;
pub mod autograd;
pub mod backend;
pub mod data;
pub mod demo;
pub mod error;
pub mod io;
pub mod job;
pub mod memory;
pub mod nn;
pub mod ops;
pub mod optim;
pub mod tensor;
pub mod train;

pub use autograd::{BackwardOptions, enable_grad, is_grad_enabled, no_grad};
pub use error::{Error, Result};
pub use memory::Category;
pub use tensor::{DType, Device, Generator, Tensor, manual_seed};
