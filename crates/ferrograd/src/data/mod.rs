//! Training text: a character-level tokenizer and a dataset of random (B, T) windows.
//!
//! The default corpus (eight public-domain Shakespeare plays, about 1 MB, described in the
//! repository's data/README.md) is compiled into the library, so `ferrograd train` works on a
//! fresh machine with no files; `load_text` reads any other UTF-8 text file instead.

mod batches;
mod tokenizer;

pub use batches::{Split, TextDataset, VAL_FRACTION};
pub use tokenizer::CharTokenizer;

use std::path::Path;

use crate::base::{Error, Result};

/// The name the default corpus goes by in logs and checkpoints.
pub const DEFAULT_CORPUS_NAME: &str = "shakespeare.txt";

/// The built-in training text.
pub fn default_corpus() -> &'static str {
    include_str!("../../../../data/shakespeare.txt")
}

/// Reads a UTF-8 text file to train on.
pub fn load_text(path: impl AsRef<Path>) -> Result<String> {
    let path = path.as_ref();
    let bytes = std::fs::read(path).map_err(|source| Error::Io {
        path: path.display().to_string(),
        source,
    })?;
    let text = String::from_utf8(bytes).map_err(|e| Error::BadFile {
        path: path.display().to_string(),
        detail: format!(
            "not UTF-8 text (invalid byte at offset {}); convert it to UTF-8 first",
            e.utf8_error().valid_up_to()
        ),
    })?;
    if text.is_empty() {
        return Err(Error::BadFile {
            path: path.display().to_string(),
            detail: "the file is empty; give a text to train on".to_string(),
        });
    }
    Ok(text)
}
