//! Character-level tokenizer: the vocabulary is the sorted set of distinct characters of a
//! text, and a token id is a character's index in it (as nanoGPT's shakespeare_char).

use std::collections::HashMap;

use crate::base::{Error, Result};

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CharTokenizer {
    /// The vocabulary in id order.
    chars: Vec<char>,
    ids: HashMap<char, u32>,
}

impl CharTokenizer {
    /// The tokenizer whose vocabulary is every distinct character of `text`, sorted.
    pub fn from_text(text: &str) -> Result<CharTokenizer> {
        let mut chars: Vec<char> = text.chars().collect();
        chars.sort_unstable();
        chars.dedup();
        CharTokenizer::from_vocab(&chars.into_iter().collect::<String>())
    }

    /// The tokenizer with exactly these characters, in this order (id = position), e.g. a
    /// vocabulary saved with a checkpoint by `vocab()`.
    pub fn from_vocab(vocab: &str) -> Result<CharTokenizer> {
        let chars: Vec<char> = vocab.chars().collect();
        if chars.is_empty() {
            return Err(Error::invalid(
                "CharTokenizer",
                "the vocabulary is empty; build it from a non-empty text",
            ));
        }
        if u32::try_from(chars.len()).is_err() {
            return Err(Error::invalid(
                "CharTokenizer",
                "the vocabulary has more characters than u32 ids can number",
            ));
        }
        let mut ids = HashMap::with_capacity(chars.len());
        for (i, &c) in chars.iter().enumerate() {
            if ids.insert(c, i as u32).is_some() {
                return Err(Error::invalid(
                    "CharTokenizer",
                    format!("the vocabulary lists {c:?} twice; every character must appear once"),
                ));
            }
        }
        Ok(CharTokenizer { chars, ids })
    }

    /// Number of distinct tokens (the model's vocabulary size).
    pub fn vocab_size(&self) -> usize {
        self.chars.len()
    }

    /// The vocabulary as one string in id order; `from_vocab` rebuilds the same tokenizer.
    pub fn vocab(&self) -> String {
        self.chars.iter().collect()
    }

    /// The token ids of `text`. A character outside the vocabulary is an error naming it.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        text.char_indices()
            .map(|(at, c)| {
                self.ids.get(&c).copied().ok_or_else(|| {
                    Error::invalid(
                        "CharTokenizer::encode",
                        format!(
                            "character {c:?} (U+{:04X}) at byte {at} is not in the vocabulary of {} characters; use only characters of the training text",
                            c as u32,
                            self.chars.len()
                        ),
                    )
                })
            })
            .collect()
    }

    /// The text of token ids (u32 from `encode`, or i64 read from a tensor). An id outside
    /// the vocabulary is an error.
    pub fn decode<T: Copy + Into<i64>>(&self, ids: &[T]) -> Result<String> {
        ids.iter()
            .map(|&id| {
                let id: i64 = id.into();
                usize::try_from(id)
                    .ok()
                    .and_then(|i| self.chars.get(i).copied())
                    .ok_or_else(|| {
                        Error::invalid(
                            "CharTokenizer::decode",
                            format!(
                                "token id {id} is outside the vocabulary (ids 0..{})",
                                self.chars.len()
                            ),
                        )
                    })
            })
            .collect()
    }
}
