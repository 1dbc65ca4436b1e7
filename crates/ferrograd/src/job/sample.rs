//! Text generation from a trained model: autoregressive sampling under no_grad, one character
//! at a time, from the softmax of the last position's logits at temperature 0.8 (as nanoGPT's
//! sample.py). The context is cropped to the model's block size.

use crate::autograd::no_grad;
use crate::base::Result;
use crate::data::CharTokenizer;
use crate::nn::{Gpt, Module};
use crate::tensor::{DType, Device, Generator, Tensor};

const TEMPERATURE: f64 = 0.8;

/// `chars` characters continuing a newline (or the first vocabulary entry), seeded by `seed`.
pub fn sample_text(
    model: &mut Gpt,
    tokenizer: &CharTokenizer,
    chars: usize,
    seed: u64,
    device: Device,
) -> Result<String> {
    let _g = no_grad();
    model.eval();
    let mut rng = Generator::new(seed ^ 0x5A3F);
    let mut ids: Vec<i64> = match tokenizer.encode("\n") {
        Ok(v) => v.into_iter().map(i64::from).collect(),
        Err(_) => vec![0],
    };
    let start = ids.len();
    for _ in 0..chars {
        let ctx = &ids[ids.len().saturating_sub(model.config.block_size)..];
        let x = Tensor::from_vec(ctx.to_vec(), &[1, ctx.len()], device)?;
        // (1, T, V) → the last position's (V) logits on the host
        let logits = model
            .forward(&x)?
            .narrow(1, ctx.len() - 1, 1)?
            .to_dtype(DType::F64)?
            .to_vec::<f64>()?;
        ids.push(draw(&logits, &mut rng) as i64);
    }
    model.train(true);
    tokenizer.decode(&ids[start..])
}

/// An index drawn from softmax(logits / temperature).
fn draw(logits: &[f64], rng: &mut Generator) -> usize {
    let max = logits.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let weights: Vec<f64> = logits
        .iter()
        .map(|l| ((l - max) / TEMPERATURE).exp())
        .collect();
    let total: f64 = weights.iter().sum();
    let mut u = rng.uniform(1, 0.0, total)[0];
    for (i, w) in weights.iter().enumerate() {
        if u < *w {
            return i;
        }
        u -= w;
    }
    weights.len() - 1
}
