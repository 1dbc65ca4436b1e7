//! A fixture file written by one of the tools/ scripts, as every test that reads one needs it:
//! read once per test binary, its `format` and `version` header checked (a file from another
//! generator would make every comparison meaningless), tensors decoded on demand as CPU
//! tensors in their stored dtype (f32, f64, f16, bf16, i64, u8). Test code: a bad file panics
//! with the command that regenerates it. Each test binary uses part of it.
#![allow(dead_code)]

use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;

use ferrograd::{Device, Tensor};
use half::{bf16, f16};
use safetensors::{Dtype, SafeTensors};

pub struct FixtureFile {
    path: String,
    hint: String,
    tensors: SafeTensors<'static>,
    metadata: HashMap<String, String>,
}

/// tests/fixtures/`file`, whose header must say `format` version 1; `tool` (in tools/) writes
/// it. Opened once per test binary, then shared.
pub fn open(file: &'static str, format: &str, tool: &str) -> &'static FixtureFile {
    static OPEN: Mutex<Vec<(&'static str, &'static FixtureFile)>> = Mutex::new(Vec::new());
    let mut open = OPEN.lock().unwrap_or_else(|e| e.into_inner());
    if let Some((_, f)) = open.iter().find(|(name, _)| *name == file) {
        return f;
    }
    let f: &'static FixtureFile = Box::leak(Box::new(read(file, format, tool)));
    open.push((file, f));
    f
}

fn read(file: &str, format: &str, tool: &str) -> FixtureFile {
    let path = format!("{}/../../tests/fixtures/{file}", env!("CARGO_MANIFEST_DIR"));
    let hint = format!("regenerate with tools/{tool} (see tools/README.md)");
    let bytes = std::fs::read(&path).unwrap_or_else(|e| panic!("cannot read {path}: {e}; {hint}"));
    let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
    let metadata = check_header(bytes, &path, format, &hint);
    let tensors = SafeTensors::deserialize(bytes)
        .unwrap_or_else(|e| panic!("{path} is not safetensors: {e}; {hint}"));
    FixtureFile {
        path,
        hint,
        tensors,
        metadata,
    }
}

/// The header's metadata, after checking that it names `format` version 1.
pub fn check_header(bytes: &[u8], path: &str, format: &str, hint: &str) -> HashMap<String, String> {
    let (_, header) = SafeTensors::read_metadata(bytes)
        .unwrap_or_else(|e| panic!("bad fixture header in {path}: {e}; {hint}"));
    let metadata = header.metadata().clone().unwrap_or_default();
    let field = |k: &str| metadata.get(k).map(String::as_str).unwrap_or("<missing>");
    assert_eq!(field("format"), format, "fixture format of {path}; {hint}");
    assert_eq!(field("version"), "1", "fixture version of {path}; {hint}");
    metadata
}

fn words<const N: usize>(data: &[u8]) -> impl Iterator<Item = [u8; N]> + '_ {
    data.chunks_exact(N).map(|c| c.try_into().unwrap())
}

impl FixtureFile {
    /// The tensor `key`, or None when the file has no such key.
    pub fn try_get(&self, key: &str) -> Option<Tensor> {
        let v = self.tensors.tensor(key).ok()?;
        let (shape, data, cpu) = (v.shape().to_vec(), v.data(), Device::Cpu);
        let half = |w: [u8; 2]| u16::from_le_bytes(w);
        let t = match v.dtype() {
            Dtype::F32 => {
                Tensor::from_vec(words(data).map(f32::from_le_bytes).collect(), &shape, cpu)
            }
            Dtype::F64 => {
                Tensor::from_vec(words(data).map(f64::from_le_bytes).collect(), &shape, cpu)
            }
            Dtype::F16 => Tensor::from_vec(
                words(data).map(|w| f16::from_bits(half(w))).collect(),
                &shape,
                cpu,
            ),
            Dtype::BF16 => Tensor::from_vec(
                words(data).map(|w| bf16::from_bits(half(w))).collect(),
                &shape,
                cpu,
            ),
            Dtype::I64 => {
                Tensor::from_vec(words(data).map(i64::from_le_bytes).collect(), &shape, cpu)
            }
            Dtype::U8 => Tensor::from_vec(data.to_vec(), &shape, cpu),
            other => panic!(
                "fixture '{key}' in {} has dtype {other:?}; {}",
                self.path, self.hint
            ),
        };
        Some(t.unwrap())
    }

    /// The tensor `key`; a missing key panics with the regeneration hint.
    pub fn get(&self, key: &str) -> Tensor {
        self.try_get(key)
            .unwrap_or_else(|| panic!("no fixture tensor '{key}' in {}; {}", self.path, self.hint))
    }

    pub fn names(&self) -> Vec<&str> {
        self.tensors.names()
    }

    /// Every tensor `PREFIX.name`, keyed by name; none is an error.
    pub fn named(&self, prefix: &str) -> BTreeMap<String, Tensor> {
        let prefix = format!("{prefix}.");
        let map: BTreeMap<String, Tensor> = self
            .names()
            .into_iter()
            .filter_map(|k| {
                k.strip_prefix(&prefix)
                    .map(|n| (n.to_string(), self.get(k)))
            })
            .collect();
        assert!(
            !map.is_empty(),
            "no '{prefix}*' tensors in {}; {}",
            self.path,
            self.hint
        );
        map
    }

    /// A string of the header's metadata.
    pub fn meta(&self, key: &str) -> &str {
        self.metadata
            .get(key)
            .unwrap_or_else(|| panic!("no metadata '{key}' in {}; {}", self.path, self.hint))
    }
}
