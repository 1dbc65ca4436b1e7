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

/// The largest text `load_text` reads: 256 MiB (the tokens take eight times that in memory).
pub const MAX_TEXT_BYTES: u64 = 256 << 20;

/// Reads a UTF-8 text file to train on: a regular file (not a device, pipe or folder) of at
/// most `MAX_TEXT_BYTES`, refused before anything is read otherwise.
pub fn load_text(path: impl AsRef<Path>) -> Result<String> {
    use std::io::Read;
    let path = path.as_ref();
    let io = |source| Error::Io {
        path: path.display().to_string(),
        source,
    };
    let bad = |detail: String| Error::BadFile {
        path: path.display().to_string(),
        detail,
    };
    let file = std::fs::File::open(path).map_err(io)?;
    let meta = file.metadata().map_err(io)?;
    if !meta.is_file() {
        return Err(bad(
            "not a regular file (a folder, device or pipe); give a text file".to_string(),
        ));
    }
    if meta.len() > MAX_TEXT_BYTES {
        return Err(bad(format!(
            "{} is larger than the {} a text may be; train on a part of it",
            crate::memory::format_size(meta.len()),
            crate::memory::format_size(MAX_TEXT_BYTES)
        )));
    }
    let mut bytes = Vec::new();
    // A file that grows while it is read still stops at the cap.
    file.take(MAX_TEXT_BYTES + 1)
        .read_to_end(&mut bytes)
        .map_err(io)?;
    if bytes.len() as u64 > MAX_TEXT_BYTES {
        return Err(bad(format!(
            "it grew past the {} a text may be while it was read; train on a part of it",
            crate::memory::format_size(MAX_TEXT_BYTES)
        )));
    }
    let text = String::from_utf8(bytes).map_err(|e| {
        bad(format!(
            "not UTF-8 text (invalid byte at offset {}); convert it to UTF-8 first",
            e.utf8_error().valid_up_to()
        ))
    })?;
    if text.is_empty() {
        return Err(bad("the file is empty; give a text to train on".to_string()));
    }
    Ok(text)
}
