//! A GPT-2 style language model (as nanoGPT): token and position embeddings, `n_layer`
//! pre-norm transformer blocks (x + attn(ln_1(x)); x + mlp(ln_2(x))), a final LayerNorm and
//! an output head tied to the token embedding. Parameter names follow nanoGPT / Hugging Face
//! (`transformer.wte.weight`, `transformer.h.0.attn.c_attn.weight`, ...), so weights can be
//! loaded by name with `load_named`.
//!
//! Weight tying: the head multiplies by `wte.weight` itself (one tensor, one storage), so the
//! model has one (V, C) parameter, named once, whose gradient sums both uses.
//!
//! Initialisation as GPT-2 / nanoGPT: linear weights and embeddings ~ N(0, 0.02), biases 0,
//! the residual projections (`c_proj`) ~ N(0, 0.02/√(2·n_layer)), LayerNorm weight 1, bias 0;
//! drawn from a generator seeded with `GptConfig::seed`.
//!
//! Under autocast the residual stream stays f32 while the Linears run in half precision:
//! each LayerNorm writes the half input of the Linear after it (`forward_for_linear`), and the
//! residual adds read the half branch outputs directly (f32 + half), so no cast kernel runs
//! between them in either direction. Each residual add is done by the norm that reads its
//! sum, in one kernel (`add_forward_for_linear`; a block's last add by the next block's
//! ln_1, or ln_f), and each norm's backward adds the stream's gradient as it writes its own.

use super::attention::{CausalSelfAttention, causal_mask};
use super::mlp::Mlp;
use super::recompute::Recompute;
use super::state::prefixed;
use super::{Dropout, Embedding, LayerNorm, Linear, Module};
use crate::base::{Error, Result};
use crate::memory::{Category, recorder};
use crate::ops::{OutputValue, cast_parameters_ahead};
use crate::tensor::{DType, Device, Generator, Tensor};

/// The cross-entropy targets equal to this are ignored (PyTorch's default).
pub const IGNORE_INDEX: i64 = -100;

/// GPT-2's init standard deviation.
const INIT_STD: f64 = 0.02;

/// The shape of a GPT model. `n_embd` must be a multiple of `n_head`.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct GptConfig {
    pub vocab_size: usize,
    /// The context length: the longest sequence the model accepts.
    pub block_size: usize,
    pub n_layer: usize,
    pub n_head: usize,
    /// The width C.
    pub n_embd: usize,
    /// Dropout probability on embeddings, attention weights and residual branches.
    pub dropout: f64,
    /// Biases in the linear layers and LayerNorms.
    pub bias: bool,
    /// Seeds the initial weights and the dropout masks.
    pub seed: u64,
}

impl GptConfig {
    /// GPT-2 small: 12 layers, 12 heads, width 768, 50257 tokens, context 1024 (124M
    /// parameters).
    pub fn gpt2_124m() -> GptConfig {
        GptConfig {
            vocab_size: 50257,
            block_size: 1024,
            n_layer: 12,
            n_head: 12,
            n_embd: 768,
            dropout: 0.0,
            bias: true,
            seed: 0,
        }
    }

    /// A model small enough to train in seconds on a CPU: a character vocabulary (65),
    /// context 64, 2 layers, 4 heads, width 64.
    pub fn tiny() -> GptConfig {
        GptConfig {
            vocab_size: 65,
            block_size: 64,
            n_layer: 2,
            n_head: 4,
            n_embd: 64,
            dropout: 0.0,
            bias: true,
            seed: 0,
        }
    }

    /// Checks that the sizes make a model.
    pub fn validate(&self) -> Result<()> {
        let sizes = [
            ("vocab_size", self.vocab_size),
            ("block_size", self.block_size),
            ("n_head", self.n_head),
            ("n_embd", self.n_embd),
        ];
        if let Some((name, _)) = sizes.iter().find(|(_, v)| *v == 0) {
            return Err(Error::invalid(
                "GptConfig",
                format!("{name} must be at least 1"),
            ));
        }
        if !self.n_embd.is_multiple_of(self.n_head) {
            return Err(Error::invalid(
                "GptConfig",
                format!(
                    "n_embd = {} must be a multiple of n_head = {}: each head gets n_embd / n_head channels",
                    self.n_embd, self.n_head
                ),
            ));
        }
        if !(0.0..1.0).contains(&self.dropout) {
            return Err(Error::invalid(
                "GptConfig",
                format!("dropout must lie in [0, 1), got {}", self.dropout),
            ));
        }
        Ok(())
    }

    /// The number of parameter elements, computed from the sizes alone (no tensors). The
    /// tied head counts once, the position embedding counts: GPT-2 small has 124,439,808.
    pub fn num_params(&self) -> usize {
        let (c, b) = (self.n_embd, usize::from(self.bias));
        let layer_norm = c + b * c;
        let linear = |i: usize, o: usize| i * o + b * o;
        let block =
            2 * layer_norm + linear(c, 3 * c) + linear(c, c) + linear(c, 4 * c) + linear(4 * c, c);
        self.vocab_size * c + self.block_size * c + self.n_layer * block + layer_norm
    }
}

/// Draws parameters and hands out dropout seeds for one model.
struct Init {
    g: Generator,
    seed: u64,
    dropouts: u64,
    dtype: DType,
    device: Device,
}

impl Init {
    fn param(&self, t: Tensor) -> Result<Tensor> {
        t.set_category(Category::Parameter);
        t.requires_grad_(true)
    }

    fn normal(&mut self, shape: &[usize], std: f64) -> Result<Tensor> {
        let t = Tensor::normal_with(shape, 0.0, std, self.dtype, self.device, &mut self.g)?;
        self.param(t)
    }

    /// Weight ~ N(0, std), bias 0.
    fn linear(&mut self, i: usize, o: usize, bias: bool, std: f64) -> Result<Linear> {
        let weight = self.normal(&[o, i], std)?;
        let bias = if bias {
            Some(self.param(Tensor::zeros(&[o], self.dtype, self.device)?)?)
        } else {
            None
        };
        Ok(Linear { weight, bias })
    }

    fn embedding(&mut self, n: usize, d: usize) -> Result<Embedding> {
        Ok(Embedding {
            weight: self.normal(&[n, d], INIT_STD)?,
        })
    }

    fn layer_norm(&self, n: usize, bias: bool) -> Result<LayerNorm> {
        LayerNorm::new_with_dtype(n, bias, self.dtype, self.device)
    }

    /// Each dropout gets its own stream, all derived from the model's seed.
    fn dropout(&mut self, p: f64) -> Result<Dropout> {
        self.dropouts += 1;
        let seed = self
            .seed
            .wrapping_add(self.dropouts.wrapping_mul(0x9E37_79B9_7F4A_7C15));
        Dropout::new(p, seed)
    }

    fn block(&mut self, cfg: &GptConfig) -> Result<Block> {
        let (c, bias) = (cfg.n_embd, cfg.bias);
        // Residual projections are scaled down: n_layer blocks each add one to the stream.
        let proj_std = INIT_STD / (2.0 * cfg.n_layer as f64).sqrt();
        Ok(Block {
            ln_1: self.layer_norm(c, bias)?,
            attn: CausalSelfAttention {
                c_attn: self.linear(c, 3 * c, bias, INIT_STD)?,
                c_proj: self.linear(c, c, bias, proj_std)?,
                n_head: cfg.n_head,
                attn_dropout: self.dropout(cfg.dropout)?,
                resid_dropout: self.dropout(cfg.dropout)?,
                fused: true,
            },
            ln_2: self.layer_norm(c, bias)?,
            mlp: Mlp {
                c_fc: self.linear(c, 4 * c, bias, INIT_STD)?,
                c_proj: self.linear(4 * c, c, bias, proj_std)?,
                dropout: self.dropout(cfg.dropout)?,
                recompute_gelu: false,
            },
        })
    }
}

/// One transformer block: x + attn(ln_1(x)), then + mlp(ln_2(·)).
#[derive(Clone)]
pub struct Block {
    pub ln_1: LayerNorm,
    pub attn: CausalSelfAttention,
    pub ln_2: LayerNorm,
    pub mlp: Mlp,
}

impl Block {
    /// The weights and biases its matmuls read: what autocast casts to half precision.
    pub fn matmul_parameters(&self) -> Vec<&Tensor> {
        let linears = [
            &self.attn.c_attn,
            &self.attn.c_proj,
            &self.mlp.c_fc,
            &self.mlp.c_proj,
        ];
        let mut v = Vec::with_capacity(8);
        for l in linears {
            v.push(&l.weight);
            v.extend(l.bias.as_ref());
        }
        v
    }

    /// x: (B, T, C) → (B, T, C) with a causal mask of at least (T, T).
    pub fn forward_masked(&self, x: &Tensor, mask: &Tensor) -> Result<Tensor> {
        let (x, m) = self.forward_open(x, None, mask, OutputValue::Computed)?;
        x.add(&m)
    }

    /// `forward_masked` for a pass run only to backpropagate through the block (a
    /// recomputation): its output's value is never read, so the MLP's second product and the
    /// last residual add record their graph nodes without computing (one (B·T, 4C)·(4C, C)
    /// GEMM and one (B, T, C) pass less); every value backward reads is computed as before.
    pub(crate) fn forward_graph_only(&self, x: &Tensor, mask: &Tensor) -> Result<Tensor> {
        let (x, m) = self.forward_open(x, None, mask, OutputValue::Skipped)?;
        x.add_graph_only(&m)
    }

    /// The block on the stream `x + pending` (just `x` without a pending branch), its own
    /// last residual add left open: returns (the stream after attention, the MLP's output),
    /// whose sum is the block's output. Each residual add is done by the norm that reads
    /// its sum, in the same kernel (`add_forward_for_linear`). `mlp` says whether the MLP's
    /// output value is computed or only its graph recorded.
    pub(crate) fn forward_open(
        &self,
        x: &Tensor,
        pending: Option<&Tensor>,
        mask: &Tensor,
        mlp: OutputValue,
    ) -> Result<(Tensor, Tensor)> {
        // attn and mlp each start with a Linear.
        let (x, h) = scoped("ln_1", || match pending {
            Some(p) => self.ln_1.add_forward_for_linear(x, p),
            None => Ok((x.clone(), self.ln_1.forward_for_linear(x)?)),
        })?;
        let a = scoped("attn", || self.attn.forward_masked(&h, mask))?;
        let (x, h) = scoped("ln_2", || self.ln_2.add_forward_for_linear(&x, &a))?;
        Ok((x, scoped("mlp", || self.mlp.forward_value(&h, mlp))?))
    }
}

impl Module for Block {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let t = x.shape().get(1).copied().unwrap_or(0);
        self.forward_masked(x, &causal_mask(t, x.device())?)
    }

    fn named_parameters(&self) -> Vec<(String, Tensor)> {
        let mut v = prefixed("ln_1", &self.ln_1);
        v.extend(prefixed("attn", &self.attn));
        v.extend(prefixed("ln_2", &self.ln_2));
        v.extend(prefixed("mlp", &self.mlp));
        v
    }

    fn train(&mut self, mode: bool) {
        self.attn.train(mode);
        self.mlp.train(mode);
    }
}

pub struct Gpt {
    pub config: GptConfig,
    /// Token embedding (V, C), also the output head.
    pub wte: Embedding,
    /// Position embedding (block_size, C).
    pub wpe: Embedding,
    pub drop: Dropout,
    pub blocks: Vec<Block>,
    pub ln_f: LayerNorm,
    /// (block_size, block_size) U8 causal mask, built once and shared by every layer (the
    /// graph then saves one mask, not one per layer).
    mask: Tensor,
    /// Which blocks recompute their activations in backward.
    recompute: Recompute,
}

impl Gpt {
    /// A float32 model on `device`, initialised as GPT-2.
    pub fn new(config: GptConfig, device: Device) -> Result<Gpt> {
        Gpt::new_with_dtype(config, DType::F32, device)
    }

    pub fn new_with_dtype(config: GptConfig, dtype: DType, device: Device) -> Result<Gpt> {
        config.validate()?;
        let mut init = Init {
            g: Generator::new(config.seed),
            seed: config.seed,
            dropouts: 0,
            dtype,
            device,
        };
        let wte = init.embedding(config.vocab_size, config.n_embd)?;
        let wpe = init.embedding(config.block_size, config.n_embd)?;
        let drop = init.dropout(config.dropout)?;
        let blocks = (0..config.n_layer)
            .map(|_| init.block(&config))
            .collect::<Result<Vec<_>>>()?;
        let ln_f = init.layer_norm(config.n_embd, config.bias)?;
        let mask = causal_mask(config.block_size, device)?;
        Ok(Gpt {
            config,
            wte,
            wpe,
            drop,
            blocks,
            ln_f,
            mask,
            recompute: Recompute::Off,
        })
    }

    /// Fused attention kernels where the device has them (the default), or the composed
    /// matmul–softmax–matmul path everywhere.
    pub fn set_fused_attention(&mut self, on: bool) {
        for block in &mut self.blocks {
            block.attn.fused = on;
        }
    }

    /// Whether a forward in `dtype` runs the fused attention kernel (the same in every block).
    pub fn attention_fused(&self, dtype: DType) -> bool {
        self.blocks
            .first()
            .is_some_and(|b| b.attn.runs_fused(b.attn.c_attn.weight.device(), dtype))
    }

    /// Chooses what backward recomputes instead of the forward saving it (see `Recompute`):
    /// whole blocks, or each MLP's GELU output.
    pub fn set_recompute(&mut self, policy: Recompute) {
        self.recompute = policy;
        for block in &mut self.blocks {
            block.mlp.recompute_gelu = policy == Recompute::Gelu;
        }
    }

    pub fn recompute(&self) -> Recompute {
        self.recompute
    }

    /// Every dropout layer, in a fixed order (their generators belong to saved training
    /// state, so a resumed run draws the same masks).
    pub fn dropouts(&self) -> Vec<&Dropout> {
        let mut v = vec![&self.drop];
        for b in &self.blocks {
            v.extend([&b.attn.attn_dropout, &b.attn.resid_dropout, &b.mlp.dropout]);
        }
        v
    }

    /// The output head's weight (V, C): the token embedding itself.
    pub fn lm_head(&self) -> &Tensor {
        &self.wte.weight
    }

    /// ids: I64 (B, T) with T ≤ block_size → logits (B, T, V), and with targets I64 (B, T)
    /// the mean cross-entropy (targets of -100 ignored).
    pub fn forward_loss(
        &self,
        ids: &Tensor,
        targets: Option<&Tensor>,
    ) -> Result<(Tensor, Option<Tensor>)> {
        let x = self.trunk(ids)?;
        let logits = scoped("lm_head", || x.linear(&self.wte.weight, None))?;
        let loss = targets
            .map(|y| logits.cross_entropy(y, IGNORE_INDEX))
            .transpose()?;
        Ok((logits, loss))
    }

    /// ids, targets: I64 (B, T) → the mean cross-entropy, as `forward_loss`'s, without the
    /// logits: the head and the loss run in row chunks (`Tensor::linear_cross_entropy`), so
    /// the (B, T, V) logits — a step's largest block — never exist at once.
    pub fn loss(&self, ids: &Tensor, targets: &Tensor) -> Result<Tensor> {
        let x = self.trunk(ids)?;
        scoped("lm_head", || {
            x.linear_cross_entropy(&self.wte.weight, targets, IGNORE_INDEX)
        })
    }

    /// ids (B, T) → the final norm's output (B, T, C), the head's input.
    fn trunk(&self, ids: &Tensor) -> Result<Tensor> {
        let t = self.check_ids(ids)?;
        let pos = Tensor::arange(0.0, t as f64, 1.0, DType::I64, ids.device())?;
        // (B, T, C) + (T, C)
        let tok = scoped("transformer.wte", || self.wte.forward(ids))?;
        let x = tok.add(&scoped("transformer.wpe", || self.wpe.forward(&pos))?)?;
        let mut x = scoped("transformer.drop", || self.drop.forward(&x))?;
        // The stream is x + pending: a block's last residual add is done by the next norm.
        let mut pending: Option<Tensor> = None;
        // Without a graph there is nothing to save, so recomputation would only cost time.
        let recording = crate::autograd::is_grad_enabled();
        // Under autocast, the weights the matmuls read are cast here in one launch instead of
        // one each as the blocks reach them (a recomputed block casts its own in each pass,
        // so their casts are not held from the forward to backward).
        let mut weights = vec![&self.wte.weight];
        for (i, block) in self.blocks.iter().enumerate() {
            if !(recording && self.recompute.applies_to(i)) {
                weights.extend(block.matmul_parameters());
            }
        }
        cast_parameters_ahead(&weights)?;
        for (i, block) in self.blocks.iter().enumerate() {
            let _scope = recorder::module_scope_indexed("transformer.h", i);
            if recording && self.recompute.applies_to(i) {
                // A recomputed block saves only its input: the whole stream.
                if let Some(p) = pending.take() {
                    x = x.add(&p)?;
                }
                x = block.forward_recomputed(&x, &self.mask, self.recompute.keeps_attention())?;
            } else {
                let (stream, m) =
                    block.forward_open(&x, pending.as_ref(), &self.mask, OutputValue::Computed)?;
                (x, pending) = (stream, Some(m));
            }
        }
        scoped("transformer.ln_f", || match &pending {
            Some(p) => Ok(self.ln_f.add_forward_for_linear(&x, p)?.1),
            None => self.ln_f.forward_for_linear(&x),
        })
    }

    /// T of valid (B, T) ids.
    fn check_ids(&self, ids: &Tensor) -> Result<usize> {
        let &[_, t] = ids.shape() else {
            return Err(Error::shape(
                "Gpt",
                format!(
                    "ids must be (B, T) int64 token ids, got shape {:?}",
                    ids.shape()
                ),
            ));
        };
        let block_size = self.config.block_size;
        if t == 0 || t > block_size {
            return Err(Error::shape(
                "Gpt",
                format!(
                    "sequence length T = {t} must lie in 1..={block_size} (the context block_size); crop the input to its last {block_size} tokens"
                ),
            ));
        }
        Ok(t)
    }
}

impl Module for Gpt {
    /// ids: I64 (B, T) → logits (B, T, V).
    fn set_recompute_policy(&mut self, policy: Recompute) -> Result<()> {
        self.set_recompute(policy);
        Ok(())
    }

    fn forward(&self, ids: &Tensor) -> Result<Tensor> {
        self.forward_loss(ids, None).map(|(logits, _)| logits)
    }

    fn named_parameters(&self) -> Vec<(String, Tensor)> {
        let mut v = prefixed("transformer.wte", &self.wte);
        v.extend(prefixed("transformer.wpe", &self.wpe));
        for (i, block) in self.blocks.iter().enumerate() {
            v.extend(prefixed(&format!("transformer.h.{i}"), block));
        }
        v.extend(prefixed("transformer.ln_f", &self.ln_f));
        v
    }

    fn train(&mut self, mode: bool) {
        self.drop.train(mode);
        for block in &mut self.blocks {
            block.train(mode);
        }
    }
}

/// Runs `f` as the child module `name`, so the memory recorder names what it allocates.
fn scoped<T>(name: &str, f: impl FnOnce() -> Result<T>) -> Result<T> {
    let _scope = recorder::module_scope(name);
    f()
}
