//! Training data and training-state files: the character tokenizer, random (B, T) batches,
//! and safetensors save/load (round trips, bad files, atomic writes).

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use ferrograd::data::{self, CharTokenizer, Split, TextDataset};
use ferrograd::io::{load_state, save_state};
use ferrograd::{DType, Device, Error, Generator, Tensor};
use half::{bf16, f16};

#[path = "common/test_dir.rs"]
mod test_dir;

use test_dir::TestDir;

/// A text of `n` distinct characters in increasing order: token id == position, so a window
/// tells exactly where it was cut from.
fn positional_text(n: u32) -> String {
    (0..n).map(|i| char::from_u32(0x100 + i).unwrap()).collect()
}

// ---- tokenizer ----------------------------------------------------------------------------

#[test]
fn tokenizer_vocab_is_sorted_unique_chars() {
    let tok = CharTokenizer::from_text("hello").unwrap();
    assert_eq!(tok.vocab(), "ehlo");
    assert_eq!(tok.vocab_size(), 4);
    assert_eq!(tok.encode("hello").unwrap(), vec![1, 0, 2, 2, 3]);
    assert_eq!(tok.decode(&[3u32, 0, 2]).unwrap(), "oel");
}

#[test]
fn tokenizer_round_trips_the_default_corpus() {
    let text = data::default_corpus();
    let tok = CharTokenizer::from_text(text).unwrap();
    let expected: BTreeSet<char> = text.chars().collect();
    assert_eq!(tok.vocab(), expected.iter().collect::<String>());
    let ids = tok.encode(text).unwrap();
    assert_eq!(ids.len(), text.chars().count());
    assert_eq!(tok.decode(&ids).unwrap(), text);
    // Ids read back from an i64 tensor decode the same way.
    let ids64: Vec<i64> = ids[..100].iter().map(|&i| i as i64).collect();
    assert_eq!(tok.decode(&ids64).unwrap(), &text[..100]);
    // A saved vocabulary rebuilds the same tokenizer.
    assert_eq!(CharTokenizer::from_vocab(&tok.vocab()).unwrap(), tok);
}

#[test]
fn tokenizer_rejects_unknown_chars_and_ids() {
    let tok = CharTokenizer::from_text("abc").unwrap();
    match tok.encode("abé") {
        Err(Error::InvalidArgument { detail, .. }) => {
            assert!(
                detail.contains("'é'") && detail.contains("byte 2"),
                "{detail}"
            )
        }
        other => panic!("expected InvalidArgument, got {other:?}"),
    }
    assert!(matches!(
        tok.decode(&[0u32, 3]),
        Err(Error::InvalidArgument { .. })
    ));
    assert!(matches!(
        tok.decode(&[-1i64]),
        Err(Error::InvalidArgument { .. })
    ));
    assert!(CharTokenizer::from_text("").is_err());
    assert!(CharTokenizer::from_vocab("aba").is_err());
}

// ---- dataset and batches ------------------------------------------------------------------

#[test]
fn dataset_holds_out_the_last_tenth() {
    let text = data::default_corpus();
    let ds = TextDataset::new(text).unwrap();
    let all = ds.tokenizer().encode(text).unwrap();
    let (train, val) = (ds.tokens(Split::Train), ds.tokens(Split::Val));
    assert_eq!(train.len(), (all.len() as f64 * 0.9).round() as usize);
    assert_eq!([train, val].concat(), all);
    assert_eq!(ds.vocab_size(), ds.tokenizer().vocab_size());
}

#[test]
fn batches_are_windows_with_targets_shifted_by_one() {
    let n = 300;
    let ds = TextDataset::new(&positional_text(n)).unwrap();
    let n_train = ds.tokens(Split::Train).len() as i64;
    assert_eq!(n_train, 270);
    let mut g = Generator::new(7);
    let (b, t) = (16, 8);
    for split in [Split::Train, Split::Val] {
        let (x, y) = ds.batch(split, b, t, &mut g, Device::Cpu).unwrap();
        assert_eq!(x.shape(), &[b, t]);
        assert_eq!(y.shape(), &[b, t]);
        assert_eq!((x.dtype(), y.dtype()), (DType::I64, DType::I64));
        assert_eq!(x.device(), Device::Cpu);
        let (xv, yv) = (x.to_vec::<i64>().unwrap(), y.to_vec::<i64>().unwrap());
        let (lo, hi) = match split {
            Split::Train => (0, n_train),
            Split::Val => (n_train, n as i64),
        };
        for row in 0..b {
            let start = xv[row * t];
            for k in 0..t {
                // Token id == position: x is tokens[start..start+T], y the next ones.
                assert_eq!(xv[row * t + k], start + k as i64);
                assert_eq!(yv[row * t + k], start + k as i64 + 1);
            }
            // Every window and its last target, tokens[start + T], lie inside the split.
            assert!(start >= lo && start + (t as i64) < hi, "{split}: {start}");
        }
    }
}

#[test]
fn batches_cover_every_start_including_the_last() {
    // 11 tokens, 10 train; with T = 8 the starts are 0 and 1 only.
    let ds = TextDataset::with_tokenizer(
        &positional_text(11),
        CharTokenizer::from_text(&positional_text(11)).unwrap(),
        0.1,
    )
    .unwrap();
    let mut g = Generator::new(0);
    let (x, _) = ds.batch(Split::Train, 200, 8, &mut g, Device::Cpu).unwrap();
    let starts: BTreeSet<i64> = x.to_vec::<i64>().unwrap().chunks(8).map(|r| r[0]).collect();
    assert_eq!(starts, BTreeSet::from([0, 1]));
}

#[test]
fn batches_are_deterministic_for_a_seed() {
    let ds = TextDataset::new(data::default_corpus()).unwrap();
    let draw = |seed| {
        let mut g = Generator::new(seed);
        let (x1, y1) = ds.batch(Split::Train, 4, 32, &mut g, Device::Cpu).unwrap();
        let (x2, _) = ds.batch(Split::Val, 4, 32, &mut g, Device::Cpu).unwrap();
        (
            x1.to_vec::<i64>().unwrap(),
            y1.to_vec::<i64>().unwrap(),
            x2.to_vec::<i64>().unwrap(),
        )
    };
    assert_eq!(draw(1337), draw(1337));
    assert_ne!(draw(1337).0, draw(1338).0);
}

#[test]
fn batch_sizes_must_fit_the_split() {
    let ds = TextDataset::new(&positional_text(100)).unwrap();
    let mut g = Generator::new(0);
    // The val split has 10 tokens: windows of 10 need 11.
    assert!(matches!(
        ds.batch(Split::Val, 2, 10, &mut g, Device::Cpu),
        Err(Error::InvalidArgument { .. })
    ));
    assert!(ds.batch(Split::Val, 2, 9, &mut g, Device::Cpu).is_ok());
    assert!(ds.batch(Split::Train, 0, 4, &mut g, Device::Cpu).is_err());
    assert!(ds.batch(Split::Train, 4, 0, &mut g, Device::Cpu).is_err());
    assert!(
        TextDataset::with_tokenizer("ab", CharTokenizer::from_text("ab").unwrap(), 1.0).is_err()
    );
    // A tokenizer restored from a checkpoint must cover the text.
    assert!(
        TextDataset::with_tokenizer("abc", CharTokenizer::from_text("ab").unwrap(), 0.1).is_err()
    );
}

#[test]
fn load_text_reads_utf8_and_reports_bad_files() {
    let dir = TestDir::new("data-io-load_text");
    let ok = dir.path("ok.txt");
    std::fs::write(&ok, "to be, or not to be\n").unwrap();
    assert_eq!(data::load_text(&ok).unwrap(), "to be, or not to be\n");
    let bad = dir.path("bad.txt");
    std::fs::write(&bad, [b'a', 0xff, b'b']).unwrap();
    assert!(matches!(data::load_text(&bad), Err(Error::BadFile { .. })));
    let empty = dir.path("empty.txt");
    std::fs::write(&empty, "").unwrap();
    assert!(matches!(
        data::load_text(&empty),
        Err(Error::BadFile { .. })
    ));
    assert!(matches!(
        data::load_text(dir.path("missing.txt")),
        Err(Error::Io { .. })
    ));
}

// ---- training state -----------------------------------------------------------------------

fn sample_state() -> Vec<(String, Tensor)> {
    let f32s = Tensor::from_vec(
        vec![1.5f32, -2.25, 3.0e-7, f32::MAX, -0.0, 7.0],
        &[2, 3],
        Device::Cpu,
    )
    .unwrap();
    let halves: Vec<f16> = [0.5, -1.0, 65504.0, 6.0e-8].map(f16::from_f64).to_vec();
    let brains: Vec<bf16> = [1.0e30, -3.5, 0.0078125].map(bf16::from_f64).to_vec();
    vec![
        ("model.w".to_string(), f32s.clone()),
        // A transposed view is saved as its values, in its own row-major order.
        ("model.w_t".to_string(), f32s.t().unwrap()),
        (
            "f64".to_string(),
            Tensor::from_vec(vec![std::f64::consts::PI, -1e-300], &[2], Device::Cpu).unwrap(),
        ),
        (
            "f16".to_string(),
            Tensor::from_vec(halves, &[2, 2], Device::Cpu).unwrap(),
        ),
        (
            "bf16".to_string(),
            Tensor::from_vec(brains, &[3], Device::Cpu).unwrap(),
        ),
        (
            "step".to_string(),
            Tensor::from_vec(vec![i64::MIN, 42, i64::MAX], &[3], Device::Cpu).unwrap(),
        ),
        (
            "mask".to_string(),
            Tensor::from_vec(vec![0u8, 1, 1, 0, 1], &[5], Device::Cpu).unwrap(),
        ),
        (
            "scalar".to_string(),
            Tensor::scalar(2.5, DType::F32, Device::Cpu).unwrap(),
        ),
        (
            "empty".to_string(),
            Tensor::zeros(&[0, 3], DType::F32, Device::Cpu).unwrap(),
        ),
    ]
}

fn sample_metadata() -> BTreeMap<String, String> {
    BTreeMap::from([
        ("step".to_string(), "1200".to_string()),
        ("vocab".to_string(), "\n !'ab\"é".to_string()),
        ("config".to_string(), r#"{"n_layer":4}"#.to_string()),
    ])
}

/// Exact equality of dtype, shape and values (as f64: exact for every supported dtype but
/// i64 extremes, which are compared as i64).
fn assert_same(name: &str, a: &Tensor, b: &Tensor) {
    assert_eq!(a.dtype(), b.dtype(), "{name}");
    assert_eq!(a.shape(), b.shape(), "{name}");
    if a.dtype() == DType::I64 || a.dtype() == DType::U8 {
        assert_eq!(
            a.to_vec::<i64>().unwrap(),
            b.to_vec::<i64>().unwrap(),
            "{name}"
        );
    } else {
        let (x, y) = (a.to_vec::<f64>().unwrap(), b.to_vec::<f64>().unwrap());
        assert_eq!(x.len(), y.len(), "{name}");
        for (p, q) in x.iter().zip(&y) {
            assert_eq!(p.to_bits(), q.to_bits(), "{name}: {p} vs {q}");
        }
    }
}

#[test]
fn state_round_trips_every_dtype_and_metadata() {
    let dir = TestDir::new("data-io-round_trip");
    let path = dir.path("state.safetensors");
    let state = sample_state();
    save_state(&path, &state, sample_metadata()).unwrap();
    let (loaded, mut meta) = load_state(&path).unwrap();
    assert!(meta.remove(ferrograd::io::CHECKSUM_KEY).is_some());
    assert_eq!(meta, sample_metadata());
    assert_eq!(loaded.len(), state.len());
    for (name, t) in &state {
        let l = &loaded[name];
        assert_eq!(l.device(), Device::Cpu);
        assert!(l.is_contiguous());
        assert_same(name, t, l);
    }
    assert_eq!(dir.files(), vec!["state.safetensors"]);
}

#[test]
fn state_files_are_standard_safetensors() {
    let dir = TestDir::new("data-io-standard");
    let path = dir.path("state.safetensors");
    save_state(&path, &sample_state(), sample_metadata()).unwrap();
    let bytes = std::fs::read(&path).unwrap();
    // An independent reader sees the same names, dtypes and little-endian bytes.
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let w = st.tensor("model.w_t").unwrap();
    assert_eq!(w.dtype(), safetensors::Dtype::F32);
    assert_eq!(w.shape(), &[3, 2]);
    let expected: Vec<u8> = [1.5f32, f32::MAX, -2.25, -0.0, 3.0e-7, 7.0]
        .iter()
        .flat_map(|x| x.to_le_bytes())
        .collect();
    assert_eq!(w.data(), &expected[..]);
    assert_eq!(st.tensor("mask").unwrap().data(), &[0, 1, 1, 0, 1]);
    let (header_len, header) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
    assert_eq!(header_len % 8, 0);
    let meta = header.metadata().clone().unwrap();
    assert_eq!(meta["step"], "1200");
    // The same state gives the same bytes (no hash-order header).
    let again = dir.path("again.safetensors");
    save_state(&again, &sample_state(), sample_metadata()).unwrap();
    assert_eq!(std::fs::read(&again).unwrap(), bytes);
}

#[test]
fn tensors_with_autograd_state_save_their_values() {
    let dir = TestDir::new("data-io-autograd");
    let path = dir.path("p.safetensors");
    let p = Tensor::from_vec(vec![1.0f32, 2.0], &[2], Device::Cpu)
        .unwrap()
        .requires_grad_(true)
        .unwrap();
    let y = p.mul(&p).unwrap();
    save_state(
        &path,
        &[("p".into(), p.clone()), ("y".into(), y)],
        BTreeMap::new(),
    )
    .unwrap();
    let (loaded, meta) = load_state(&path).unwrap();
    assert_eq!(
        meta.keys().collect::<Vec<_>>(),
        [ferrograd::io::CHECKSUM_KEY],
        "only the checksums"
    );
    assert_eq!(loaded["y"].to_vec::<f32>().unwrap(), vec![1.0, 4.0]);
    assert!(!loaded["p"].requires_grad());
}

fn expect_bad_file(path: &Path) {
    match load_state(path) {
        Err(Error::BadFile { path: p, detail }) => {
            assert!(p.contains("state"), "{p}");
            assert!(!detail.is_empty());
        }
        Err(e) => panic!("expected BadFile, got {e}"),
        Ok(_) => panic!("expected BadFile, got a loaded state"),
    }
}

#[test]
fn truncated_and_corrupt_files_are_bad_files() {
    let dir = TestDir::new("data-io-bad_files");
    let good = dir.path("state.safetensors");
    save_state(&good, &sample_state(), sample_metadata()).unwrap();
    let bytes = std::fs::read(&good).unwrap();
    let header_len = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;

    let write = |name: &str, b: &[u8]| {
        let p = dir.path(name);
        std::fs::write(&p, b).unwrap();
        p
    };
    // Cut inside the data, inside the header, inside the length prefix, and empty.
    expect_bad_file(&write("state-trunc-data", &bytes[..bytes.len() - 3]));
    expect_bad_file(&write("state-trunc-header", &bytes[..8 + header_len / 2]));
    expect_bad_file(&write("state-trunc-len", &bytes[..5]));
    expect_bad_file(&write("state-empty", &[]));
    // Extra bytes after the data are not a safetensors file either.
    expect_bad_file(&write("state-extra", &[&bytes[..], &[0u8; 4]].concat()));
    // A header that is not JSON.
    let mut corrupt = bytes.clone();
    corrupt[8..8 + 16].copy_from_slice(b"\xffnot json at all");
    expect_bad_file(&write("state-corrupt-header", &corrupt));
    // Valid JSON whose offsets disagree with the data.
    let mut json = bytes.clone();
    let text = String::from_utf8(json[8..8 + header_len].to_vec()).unwrap();
    let shifted = text.replacen("\"shape\":[2,3]", "\"shape\":[3,3]", 1);
    assert_ne!(shifted, text);
    json[8..8 + header_len].copy_from_slice(shifted.as_bytes());
    expect_bad_file(&write("state-bad-offsets", &json));
    // A header length far past the end of the file.
    let mut huge = bytes.clone();
    huge[..8].copy_from_slice(&u64::MAX.to_le_bytes());
    expect_bad_file(&write("state-huge-len", &huge));
    // A dtype ferrograd does not support.
    let i32_data = [1i32, 2].map(i32::to_le_bytes).concat();
    let view =
        safetensors::tensor::TensorView::new(safetensors::Dtype::I32, vec![2], &i32_data).unwrap();
    let foreign = safetensors::serialize([("x", view)], None).unwrap();
    expect_bad_file(&write("state-i32", &foreign));

    assert!(matches!(
        load_state(dir.path("missing.safetensors")),
        Err(Error::Io { .. })
    ));
}

#[test]
fn a_failed_save_leaves_the_existing_file_intact() {
    let dir = TestDir::new("data-io-atomic");
    let path = dir.path("state.safetensors");
    save_state(&path, &sample_state(), sample_metadata()).unwrap();
    let before = std::fs::read(&path).unwrap();

    // A meta tensor has no data: the save fails midway, after earlier tensors were written
    // to the temporary file, which must then be gone.
    let mut state = sample_state();
    state.push((
        "zz_meta".to_string(),
        Tensor::zeros(&[1000], DType::F32, Device::Meta).unwrap(),
    ));
    let err = save_state(&path, &state, BTreeMap::new()).unwrap_err();
    assert!(matches!(err, Error::NotSupportedOnDevice { .. }), "{err}");
    assert_eq!(std::fs::read(&path).unwrap(), before);
    assert_eq!(dir.files(), vec!["state.safetensors"]);

    // Duplicate names are refused before anything is written.
    let dup = vec![
        (
            "a".to_string(),
            Tensor::zeros(&[1], DType::F32, Device::Cpu).unwrap(),
        ),
        (
            "a".to_string(),
            Tensor::zeros(&[1], DType::F32, Device::Cpu).unwrap(),
        ),
    ];
    assert!(matches!(
        save_state(&path, &dup, BTreeMap::new()),
        Err(Error::InvalidArgument { .. })
    ));
    assert_eq!(std::fs::read(&path).unwrap(), before);

    // A directory that does not exist: refused naming the target and what to do, and nothing
    // created.
    let missing = dir.path("no-such-dir").join("state.safetensors");
    match save_state(&missing, &sample_state(), BTreeMap::new()) {
        Err(Error::OutputPath { path, detail }) => {
            assert!(path.contains("no-such-dir"), "{path}");
            assert!(detail.contains("create it first"), "{detail}");
        }
        other => panic!("expected OutputPath, got {other:?}"),
    }
    assert_eq!(dir.files(), vec!["state.safetensors"]);

    // A successful save replaces the file whole.
    let small = vec![(
        "only".to_string(),
        Tensor::from_vec(vec![9i64], &[1], Device::Cpu).unwrap(),
    )];
    save_state(&path, &small, BTreeMap::new()).unwrap();
    let (loaded, _) = load_state(&path).unwrap();
    assert_eq!(loaded.keys().collect::<Vec<_>>(), vec!["only"]);
    assert_eq!(dir.files(), vec!["state.safetensors"]);
}

#[test]
fn temporaries_of_dead_processes_are_removed_at_the_next_save() {
    let dir = TestDir::new("data-io-stale-tmp");
    let path = dir.path("state.safetensors");
    // No process has this id (Linux caps ids far below it); process 1 always lives.
    let dead = ".state.safetensors.999999999.3.tmp";
    let probe = ".state.safetensors.999999999.probe.tmp";
    std::fs::write(dir.path(probe), b"").unwrap();
    let alive = ".state.safetensors.1.0.tmp";
    let other = ".other.safetensors.999999999.0.tmp";
    for f in [dead, alive, other] {
        std::fs::write(dir.path(f), b"partial").unwrap();
    }
    save_state(&path, &sample_state(), sample_metadata()).unwrap();
    let mut expect = vec![alive, other, "state.safetensors"];
    if !cfg!(target_os = "linux") {
        expect.extend([dead, probe]);
    }
    expect.sort();
    assert_eq!(dir.files(), expect);
}

#[test]
fn save_state_refuses_folders_and_devices() {
    let dir = TestDir::new("data-io-refuse-targets");
    let err = save_state(dir.path(""), &sample_state(), sample_metadata()).unwrap_err();
    assert!(matches!(err, Error::OutputPath { .. }), "{err}");
    let err = save_state("/dev/null", &sample_state(), sample_metadata()).unwrap_err();
    assert!(err.to_string().contains("not a regular file"), "{err}");
    assert!(!std::fs::metadata("/dev/null").unwrap().is_file());
}

#[test]
fn a_flipped_bit_fails_the_checksum() {
    let dir = TestDir::new("data-io-bit-flip");
    let path = dir.path("state.safetensors");
    save_state(&path, &sample_state(), sample_metadata()).unwrap();
    let good = std::fs::read(&path).unwrap();
    // The last byte is tensor data; flipping one of its bits keeps the file well-formed.
    let mut bytes = good.clone();
    *bytes.last_mut().unwrap() ^= 1;
    std::fs::write(&path, &bytes).unwrap();
    let err = load_state(&path).unwrap_err().to_string();
    assert!(err.contains("does not match its checksum"), "{err}");
    // The metadata is covered too.
    let mut bytes = good.clone();
    let at = bytes.windows(4).position(|w| w == b"1200").unwrap();
    bytes[at + 3] = b'1';
    std::fs::write(&path, &bytes).unwrap();
    let err = load_state(&path).unwrap_err().to_string();
    assert!(
        err.contains("metadata does not match its checksum"),
        "{err}"
    );
}

#[test]
fn load_state_reads_only_regular_files() {
    for path in ["/dev/zero", "/"] {
        let err = load_state(path).unwrap_err().to_string();
        assert!(err.contains("not a regular file"), "{path}: {err}");
    }
}
