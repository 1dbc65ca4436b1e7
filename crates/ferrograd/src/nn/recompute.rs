//! The model-level recomputation policy: which transformer blocks run under
//! `checkpoint_activations` (every block, every k-th block, none) or, lighter, only each MLP's
//! GELU output (`Recompute::Gelu`), and the recomputed forward of one block. A recomputed block
//! keeps only its input (B, T, C); everything inside it is rebuilt during backward. Under
//! `Recompute::Selective` it also keeps its fused attention's output (B, T, C) and
//! log-sum-exp (B, H, T), so backward runs the attention's backward kernels but not its
//! forward again (PyTorch's selective activation checkpointing with the attention saved).
//! The recomputation runs the block for its graph alone (`Block::forward_graph_only`): the
//! values of its MLP's second product and last residual add are not computed, as backward
//! reads neither. Under autocast each pass casts the block's weights in one launch.
//!
//! Dropout: each block's dropouts own generators, so the segment snapshots them before the
//! forward and replays from that snapshot when recomputing (then puts the streams back), which
//! gives the same masks in both passes.

use std::str::FromStr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use super::gpt::Block;
use crate::autograd::{Segment, checkpoint_activations, checkpoint_activations_keeping};
use crate::base::{Device, Error, Result};
use crate::ops::cast_parameters_ahead;
use crate::tensor::{Generator, Tensor};

/// Which blocks recompute their activations in backward instead of saving them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Recompute {
    /// Save everything (the library's default; see `default_for` for a run's).
    #[default]
    Off,
    /// Recompute blocks 0, k, 2k, ...: `Every(1)` recomputes every block.
    Every(usize),
    /// Recompute only each MLP's GELU output (one elementwise pass per block in backward),
    /// the largest activation a block saves.
    Gelu,
    /// As `Every(k)`, but each recomputed block also keeps its fused attention's output and
    /// log-sum-exp, so the recomputation skips the attention's forward.
    Selective(usize),
}

impl Recompute {
    /// The policy a run takes when none is asked for (`ferrograd train`'s `--recompute
    /// auto`): `Gelu` on a GPU, `Off` on the host. On a GPU the MLP is one fused op whose
    /// GELU output, (B, T, 4C), is a block's largest saved activation; rebuilding it costs one
    /// elementwise pass per block in backward (about 2% of a GPT-2 124M step on an H100) and
    /// takes 12% off the step's peak: the trade torch.compile's partitioner makes by default
    /// for pointwise ops. On the host the layers compose, the pass is a larger share of the
    /// step, and the models trained there are small.
    pub fn default_for(device: Device) -> Recompute {
        match device {
            Device::Cuda(_) => Recompute::Gelu,
            Device::Cpu | Device::Meta => Recompute::Off,
        }
    }

    /// Whether block `index` is recomputed.
    pub fn applies_to(self, index: usize) -> bool {
        match self {
            Recompute::Off | Recompute::Gelu => false,
            Recompute::Every(k) | Recompute::Selective(k) => k > 0 && index.is_multiple_of(k),
        }
    }

    /// Whether recomputed blocks keep their attention's results.
    pub fn keeps_attention(self) -> bool {
        matches!(self, Recompute::Selective(_))
    }
}

impl FromStr for Recompute {
    type Err = Error;

    /// `off`, `gelu`, `every:K` or `selective:K` with K ≥ 1.
    fn from_str(s: &str) -> Result<Recompute> {
        let bad = || {
            Error::invalid(
                "recompute",
                format!(
                    "unknown policy '{s}': use 'off', 'gelu' (each MLP's GELU output), 'every:K' (K ≥ 1; every:1 recomputes every block) or 'selective:K' (as every:K, keeping each block's attention output)"
                ),
            )
        };
        match s.split_once(':') {
            None if s == "off" || s == "none" => Ok(Recompute::Off),
            None if s == "gelu" => Ok(Recompute::Gelu),
            Some((kind @ ("every" | "selective"), k)) => match k.parse::<usize>() {
                Ok(k) if k >= 1 && kind == "every" => Ok(Recompute::Every(k)),
                Ok(k) if k >= 1 => Ok(Recompute::Selective(k)),
                _ => Err(bad()),
            },
            _ => Err(bad()),
        }
    }
}

impl std::fmt::Display for Recompute {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Recompute::Off => write!(f, "off"),
            Recompute::Every(k) => write!(f, "every:{k}"),
            Recompute::Gelu => write!(f, "gelu"),
            Recompute::Selective(k) => write!(f, "selective:{k}"),
        }
    }
}

impl Block {
    /// The dropout generators of this block, in a fixed order.
    fn dropout_states(&self) -> [Generator; 3] {
        [
            self.attn.attn_dropout.generator_state(),
            self.attn.resid_dropout.generator_state(),
            self.mlp.dropout.generator_state(),
        ]
    }

    fn set_dropout_states(&self, [a, r, m]: [Generator; 3]) {
        self.attn.attn_dropout.set_generator_state(a);
        self.attn.resid_dropout.set_generator_state(r);
        self.mlp.dropout.set_generator_state(m);
    }

    /// x: (B, T, C) → (B, T, C), like `forward_masked`, saving only `x` for backward (and,
    /// when `keep_attention`, the fused attention's output and log-sum-exp).
    pub fn forward_recomputed(
        &self,
        x: &Tensor,
        mask: &Tensor,
        keep_attention: bool,
    ) -> Result<Tensor> {
        // A clone shares the parameters and dropout generators; the segment owns it so the
        // recomputation sees the block as it was (same train/eval mode).
        let block = self.clone();
        let mask = mask.clone();
        let start = self.dropout_states();
        let first_pass = AtomicBool::new(true);
        let segment: Segment = Arc::new(move |inputs: &[Tensor]| {
            let [x] = inputs else {
                return Err(Error::autograd("a recomputed block takes one input"));
            };
            // Under autocast the block's weights are cast in one launch per pass, not one per
            // op: the first pass runs without grad (its casts are cached apart from those of
            // the recorded forward) and the recomputation in an autocast region of its own.
            cast_parameters_ahead(&block.matmul_parameters())?;
            if first_pass.swap(false, Ordering::SeqCst) {
                return block.forward_masked(x, &mask);
            }
            let after = block.dropout_states();
            block.set_dropout_states(start.clone());
            // Only the graph is backpropagated: the output's value is not needed.
            let out = block.forward_graph_only(x, &mask);
            block.set_dropout_states(after);
            out
        });
        let x = std::slice::from_ref(x);
        if keep_attention {
            checkpoint_activations_keeping(segment, x)
        } else {
            checkpoint_activations(segment, x)
        }
    }
}
