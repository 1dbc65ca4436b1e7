//! A tokenized text split into train and validation parts, and random batches of windows
//! from either, as nanoGPT's `get_batch`: x = tokens[i .. i+T], y = tokens[i+1 .. i+T+1]
//! for B random starts i, so y is x shifted left by one (the next-token targets).

use std::fmt;
use std::str::FromStr;

use super::CharTokenizer;
use crate::base::{Error, Result};
use crate::tensor::{DType, Device, Generator, Tensor};

/// The share of the tokens held out for validation (the last 10%, as nanoGPT).
pub const VAL_FRACTION: f64 = 0.1;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Split {
    Train,
    Val,
}

impl fmt::Display for Split {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Split::Train => "train",
            Split::Val => "val",
        })
    }
}

impl FromStr for Split {
    type Err = Error;

    fn from_str(s: &str) -> Result<Split> {
        match s.trim().to_ascii_lowercase().as_str() {
            "train" => Ok(Split::Train),
            "val" | "valid" | "validation" => Ok(Split::Val),
            _ => Err(Error::invalid(
                "split",
                format!("unknown split '{s}': use train or val"),
            )),
        }
    }
}

#[derive(Clone, Debug)]
pub struct TextDataset {
    tokenizer: CharTokenizer,
    train: Vec<u32>,
    val: Vec<u32>,
}

impl TextDataset {
    /// Tokenizes `text` with a tokenizer built from it and holds out the last 10%.
    pub fn new(text: &str) -> Result<TextDataset> {
        TextDataset::with_tokenizer(text, CharTokenizer::from_text(text)?, VAL_FRACTION)
    }

    /// Tokenizes `text` with `tokenizer` (e.g. one restored from a checkpoint) and holds out
    /// the last `val_fraction` of the tokens (0 ≤ val_fraction < 1).
    pub fn with_tokenizer(
        text: &str,
        tokenizer: CharTokenizer,
        val_fraction: f64,
    ) -> Result<TextDataset> {
        if !(0.0..1.0).contains(&val_fraction) {
            return Err(Error::invalid(
                "TextDataset",
                format!("val_fraction {val_fraction} must be in [0, 1), e.g. 0.1"),
            ));
        }
        let mut train = tokenizer.encode(text)?;
        let n_train = ((train.len() as f64) * (1.0 - val_fraction)).round() as usize;
        let val = train.split_off(n_train.min(train.len()));
        Ok(TextDataset {
            tokenizer,
            train,
            val,
        })
    }

    pub fn tokenizer(&self) -> &CharTokenizer {
        &self.tokenizer
    }

    pub fn vocab_size(&self) -> usize {
        self.tokenizer.vocab_size()
    }

    /// The token ids of a split.
    pub fn tokens(&self, split: Split) -> &[u32] {
        match split {
            Split::Train => &self.train,
            Split::Val => &self.val,
        }
    }

    /// `batch_size` random windows of `block_size` tokens from `split`, on `device`:
    /// x (B, T) i64 inputs and y (B, T) i64 targets, y[b, t] = x[b, t + 1] within the text.
    /// The starts are drawn from `g`, so a seed fixes the batches.
    pub fn batch(
        &self,
        split: Split,
        batch_size: usize,
        block_size: usize,
        g: &mut Generator,
        device: Device,
    ) -> Result<(Tensor, Tensor)> {
        if device == Device::Meta {
            return self.meta_batch(split, batch_size, block_size, g);
        }
        let (x, y) = self.host_batch(split, batch_size, block_size, g)?;
        let shape = [batch_size, block_size];
        Ok((
            Tensor::from_vec(x, &shape, device)?,
            Tensor::from_vec(y, &shape, device)?,
        ))
    }

    /// `batch`'s ids and targets on the host, row-major (batch_size, block_size) each: the
    /// same draws from `g`, for a caller that writes them into buffers of its own.
    pub fn host_batch(
        &self,
        split: Split,
        batch_size: usize,
        block_size: usize,
        g: &mut Generator,
    ) -> Result<(Vec<i64>, Vec<i64>)> {
        let starts = self.starts(split, batch_size, block_size, g)?;
        let tokens = self.tokens(split);
        let n = batch_size.checked_mul(block_size).ok_or_else(|| {
            Error::invalid(
                "TextDataset::batch",
                format!(
                    "a ({batch_size}, {block_size}) batch has more elements than fit in memory"
                ),
            )
        })?;
        let mut x = Vec::with_capacity(n);
        let mut y = Vec::with_capacity(n);
        for i in starts {
            x.extend(tokens[i..i + block_size].iter().map(|&t| t as i64));
            y.extend(tokens[i + 1..i + 1 + block_size].iter().map(|&t| t as i64));
        }
        Ok((x, y))
    }

    /// A batch on the meta device, for a plan: the shapes and bytes of `batch`, no tokens (a
    /// planned batch may be far larger than the host could gather). The sizes are checked as
    /// `batch` checks them.
    fn meta_batch(
        &self,
        split: Split,
        batch_size: usize,
        block_size: usize,
        g: &mut Generator,
    ) -> Result<(Tensor, Tensor)> {
        // One window (none for an empty batch, which `starts` refuses).
        self.starts(split, batch_size.min(1), block_size, g)?;
        let shape = [batch_size, block_size];
        Ok((
            Tensor::zeros(&shape, DType::I64, Device::Meta)?,
            Tensor::zeros(&shape, DType::I64, Device::Meta)?,
        ))
    }

    /// Random window starts in [0, len − block_size), so every target exists.
    fn starts(
        &self,
        split: Split,
        batch_size: usize,
        block_size: usize,
        g: &mut Generator,
    ) -> Result<Vec<usize>> {
        if batch_size == 0 || block_size == 0 {
            return Err(Error::invalid(
                "TextDataset::batch",
                format!(
                    "batch_size {batch_size} and block_size {block_size} must both be at least 1"
                ),
            ));
        }
        let len = self.tokens(split).len();
        if len <= block_size {
            return Err(Error::invalid(
                "TextDataset::batch",
                format!(
                    "the {split} split has {len} tokens, too few for windows of {block_size} plus one target; use a block size below {len} or a longer text"
                ),
            ));
        }
        let n_starts = len - block_size;
        // Uniform in [0, n_starts): floor of a uniform float, clamped against rounding up.
        Ok(g.uniform(batch_size, 0.0, n_starts as f64)
            .into_iter()
            .map(|u| (u as usize).min(n_starts - 1))
            .collect())
    }
}
