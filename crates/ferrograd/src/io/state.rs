//! Training state in safetensors: `save_state` writes named tensors plus string metadata,
//! `load_state` reads them back onto the CPU (the caller moves them to their device).
//!
//! Saving streams one tensor at a time into a temporary file beside the target, so staging
//! costs one tensor's bytes of host memory, not the whole state's. The file is fsynced and then
//! renamed over the target; any failure removes the temporary file, and temporaries of the same
//! target left by a process that died mid-save are removed at the next save. The target is
//! therefore either the old file or the complete new one, never a partial one.
//!
//! Every file carries a checksum of each tensor's data (64-bit FNV-1a of its bytes as stored)
//! in the metadata entry `CHECKSUM_KEY`, a JSON object from tensor name to 16 hex digits.
//!
//! Loading checks the whole header (offsets, sizes, file length) before building any tensor,
//! and, when the file has checksums, every tensor's data against its checksum, so a truncated,
//! corrupt or bit-flipped file is `Error::BadFile`, never a panic or silently wrong values.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::ffi::OsString;
use std::fs::{self, File, OpenOptions};
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use half::{bf16, f16};
use safetensors::tensor::TensorInfo;
use safetensors::{Dtype, SafeTensors};

use crate::backend::cpu::{self, CpuData};
use crate::backend::{BackendData, HostValues, Storage};
use crate::base::{Error, Result};
use crate::memory::{Category, format_size};
use crate::tensor::{DType, Device, Layout, Tensor};

/// The header key safetensors reserves for string metadata.
const METADATA_KEY: &str = "__metadata__";

/// The metadata entry holding every tensor's checksum.
pub const CHECKSUM_KEY: &str = "checksum.fnv1a64";

/// 64-bit FNV-1a of `bytes`.
fn fnv1a64(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

/// Writes `tensors` and `metadata` to `path` as a safetensors file, atomically: on error the
/// file that was at `path` (if any) is left untouched and no partial file remains.
/// Tensors may live on any device with data (CPU or CUDA); views are saved as their values.
pub fn save_state(
    path: impl AsRef<Path>,
    tensors: &[(String, Tensor)],
    metadata: BTreeMap<String, String>,
) -> Result<()> {
    let path = path.as_ref();
    super::check_output_path(path)?;
    check_names(tensors)?;
    let order = file_order(tensors);
    let mut metadata = metadata;
    metadata.remove(CHECKSUM_KEY);
    let mut sums = BTreeMap::new();
    sums.insert(METADATA_KEY.to_string(), metadata_sum(&metadata)?);
    for (name, t) in tensors {
        sums.insert(name.clone(), format!("{:016x}", fnv1a64(&tensor_bytes(t)?)));
    }
    let sums = serde_json::to_string(&sums)
        .map_err(|e| Error::invalid("save_state", format!("cannot write the checksums: {e}")))?;
    metadata.insert(CHECKSUM_KEY.to_string(), sums);
    let header = header_bytes(tensors, &order, metadata)?;
    write_atomic(path, |w| {
        let io = io_err(path);
        w.write_all(&(header.len() as u64).to_le_bytes())
            .map_err(io)?;
        w.write_all(&header).map_err(io_err(path))?;
        for &i in &order {
            let bytes = tensor_bytes(&tensors[i].1)?;
            w.write_all(&bytes).map_err(io_err(path))?;
        }
        Ok(())
    })
}

/// Reads a safetensors file: every tensor (on the CPU, counted as `input`) and the string
/// metadata. Supports f32, f64, f16, bf16, i64 and u8 tensors.
pub fn load_state(
    path: impl AsRef<Path>,
) -> Result<(HashMap<String, Tensor>, BTreeMap<String, String>)> {
    let path = path.as_ref();
    // A device or pipe (/dev/zero) would be read forever: only regular files are states.
    if !fs::metadata(path).map_err(io_err(path))?.is_file() {
        return Err(bad_file(
            path,
            "not a regular file (a folder, device or pipe); give a state file saved by --save",
        ));
    }
    let bytes = fs::read(path).map_err(io_err(path))?;
    let (header_len, header) = SafeTensors::read_metadata(&bytes).map_err(|e| {
        bad_file(
            path,
            format!(
                "not a readable safetensors file ({e}); it may be truncated or corrupt: save it again or use another file"
            ),
        )
    })?;
    // read_metadata checked that the data section ends exactly at the end of the file.
    let data = bytes
        .get(8 + header_len..)
        .ok_or_else(|| bad_file(path, "the file ends inside its header"))?;
    let metadata: BTreeMap<String, String> = header
        .metadata()
        .clone()
        .unwrap_or_default()
        .into_iter()
        .collect();
    if metadata.contains_key(CHECKSUM_KEY) {
        check_sums(path, &metadata, &header.tensors(), data)?;
    }
    let mut tensors = HashMap::new();
    for (name, info) in header.tensors() {
        let t = decode(path, &name, info, data)?;
        tensors.insert(name, t);
    }
    Ok((tensors, metadata))
}

/// The checksum of the metadata (without the checksums), as its sorted JSON.
fn metadata_sum(metadata: &BTreeMap<String, String>) -> Result<String> {
    let json = serde_json::to_string(metadata)
        .map_err(|e| Error::invalid("save_state", format!("cannot write the metadata: {e}")))?;
    Ok(format!("{:016x}", fnv1a64(json.as_bytes())))
}

/// The metadata and every tensor's data against their recorded checksums, and no checksum
/// without its tensor.
fn check_sums(
    path: &Path,
    metadata: &BTreeMap<String, String>,
    infos: &HashMap<String, &TensorInfo>,
    data: &[u8],
) -> Result<()> {
    let sums = metadata.get(CHECKSUM_KEY).map_or("", String::as_str);
    let mut sums: BTreeMap<String, String> = serde_json::from_str(sums).map_err(|e| {
        bad_file(
            path,
            format!("its checksums are unreadable ({e}); the file is corrupt: use another file"),
        )
    })?;
    if let Some(want) = sums.remove(METADATA_KEY) {
        let mut rest = metadata.clone();
        rest.remove(CHECKSUM_KEY);
        if metadata_sum(&rest)? != want {
            return Err(bad_file(
                path,
                "its metadata does not match its checksum: the file is corrupt or was altered; use another file",
            ));
        }
    }
    // In name order, so the first difference named is the same every time.
    let mut names: Vec<&String> = infos.keys().collect();
    names.sort();
    for name in names {
        let (start, end) = infos[name].data_offsets;
        let raw = data
            .get(start..end)
            .ok_or_else(|| bad_file(path, format!("tensor '{name}' lies outside the file")))?;
        let Some(want) = sums.get(name) else {
            return Err(bad_file(
                path,
                format!("tensor '{name}' has no checksum: the file was altered; use another file"),
            ));
        };
        let got = format!("{:016x}", fnv1a64(raw));
        if &got != want {
            return Err(bad_file(
                path,
                format!(
                    "tensor '{name}' does not match its checksum (stored {want}, data {got}): the file is corrupt or was altered; use another file"
                ),
            ));
        }
    }
    if let Some(name) = sums.keys().find(|n| !infos.contains_key(*n)) {
        return Err(bad_file(
            path,
            format!(
                "tensor '{name}' has a checksum but is missing: the file was altered; use another file"
            ),
        ));
    }
    Ok(())
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> Error + '_ {
    move |source| Error::Io {
        path: path.display().to_string(),
        source,
    }
}

fn bad_file(path: &Path, detail: impl Into<String>) -> Error {
    Error::BadFile {
        path: path.display().to_string(),
        detail: detail.into(),
    }
}

/// Names must be unique, non-empty and not the reserved metadata key.
fn check_names(tensors: &[(String, Tensor)]) -> Result<()> {
    let mut seen = HashSet::new();
    for (name, _) in tensors {
        if name.is_empty() || name == METADATA_KEY {
            return Err(Error::invalid(
                "save_state",
                format!(
                    "'{name}' cannot name a tensor; use a non-empty name other than {METADATA_KEY}"
                ),
            ));
        }
        if !seen.insert(name.as_str()) {
            return Err(Error::invalid(
                "save_state",
                format!("two tensors are named '{name}'; give every tensor its own name"),
            ));
        }
    }
    Ok(())
}

fn st_dtype(d: DType) -> Dtype {
    match d {
        DType::F32 => Dtype::F32,
        DType::F64 => Dtype::F64,
        DType::F16 => Dtype::F16,
        DType::BF16 => Dtype::BF16,
        DType::I64 => Dtype::I64,
        DType::U8 => Dtype::U8,
    }
}

/// The order tensors take in the file: widest dtype first, then by name, as the safetensors
/// library writes them, so every tensor's data is aligned for readers that map the file.
fn file_order(tensors: &[(String, Tensor)]) -> Vec<usize> {
    let mut order: Vec<usize> = (0..tensors.len()).collect();
    order.sort_by(|&a, &b| {
        let (na, ta) = &tensors[a];
        let (nb, tb) = &tensors[b];
        st_dtype(tb.dtype())
            .cmp(&st_dtype(ta.dtype()))
            .then_with(|| na.cmp(nb))
    });
    order
}

/// The JSON header, space-padded to a multiple of 8 bytes. Keys are written in a fixed order,
/// so the same state always gives the same bytes.
fn header_bytes(
    tensors: &[(String, Tensor)],
    order: &[usize],
    metadata: BTreeMap<String, String>,
) -> Result<Vec<u8>> {
    let json_err = |e: serde_json::Error| {
        Error::invalid(
            "save_state",
            format!("cannot write the safetensors header: {e}"),
        )
    };
    let mut map = serde_json::Map::new();
    if !metadata.is_empty() {
        map.insert(
            METADATA_KEY.to_string(),
            serde_json::to_value(metadata).map_err(json_err)?,
        );
    }
    let mut offset = 0usize;
    for &i in order {
        let (name, t) = &tensors[i];
        let info = TensorInfo {
            dtype: st_dtype(t.dtype()),
            shape: t.shape().to_vec(),
            data_offsets: (offset, offset + t.nbytes()),
        };
        offset += t.nbytes();
        map.insert(name.clone(), serde_json::to_value(info).map_err(json_err)?);
    }
    let mut bytes = serde_json::to_vec(&map).map_err(json_err)?;
    bytes.resize(bytes.len().next_multiple_of(8), b' ');
    Ok(bytes)
}

/// A tensor's elements in row-major order as little-endian bytes.
fn tensor_bytes(t: &Tensor) -> Result<Vec<u8>> {
    if t.device() == Device::Cpu {
        return cpu_bytes(t);
    }
    // Other devices download through host values; a meta tensor has no data and errors here.
    host_bytes(t.dtype(), &t.to_host()?)
}

fn cpu_bytes(t: &Tensor) -> Result<Vec<u8>> {
    let data = cpu::read(t.storage())?;
    let l = t.layout();
    match &*data {
        CpuData::F32(v) => encode(v, l, f32::to_le_bytes),
        CpuData::F64(v) => encode(v, l, f64::to_le_bytes),
        CpuData::F16(v) => encode(v, l, f16::to_le_bytes),
        CpuData::BF16(v) => encode(v, l, bf16::to_le_bytes),
        CpuData::I64(v) => encode(v, l, i64::to_le_bytes),
        CpuData::U8(v) => encode(v, l, |x: u8| [x]),
    }
}

/// The elements of `v` seen through `layout`, each turned into bytes by `le`.
fn encode<T: Copy, const N: usize>(
    v: &[T],
    layout: &Layout,
    le: impl Fn(T) -> [u8; N],
) -> Result<Vec<u8>> {
    let n = layout.numel();
    if layout.is_contiguous() {
        let start = layout.offset();
        let slice = v.get(start..start + n).ok_or_else(|| {
            Error::invalid("save_state", "a tensor's view reaches past its storage")
        })?;
        collect_bytes(n, slice.iter().map(|&x| le(x)))
    } else {
        collect_bytes(n, layout.offsets().map(|i| le(v[i])))
    }
}

/// Host values downloaded from a device, re-encoded in the tensor's own dtype (exact: the
/// values were widened from that dtype).
fn host_bytes(dtype: DType, values: &HostValues) -> Result<Vec<u8>> {
    let n = values.len();
    let floats = || -> Box<dyn Iterator<Item = f64> + '_> {
        match values {
            HostValues::F64(v) => Box::new(v.iter().copied()),
            HostValues::F32(v) => Box::new(v.iter().map(|&x| x as f64)),
            HostValues::I64(v) => Box::new(v.iter().map(|&x| x as f64)),
        }
    };
    let ints = || -> Box<dyn Iterator<Item = i64> + '_> {
        match values {
            HostValues::I64(v) => Box::new(v.iter().copied()),
            HostValues::F64(v) => Box::new(v.iter().map(|&x| x as i64)),
            HostValues::F32(v) => Box::new(v.iter().map(|&x| x as i64)),
        }
    };
    match dtype {
        DType::F32 => collect_bytes(n, floats().map(|x| (x as f32).to_le_bytes())),
        DType::F64 => collect_bytes(n, floats().map(f64::to_le_bytes)),
        DType::F16 => collect_bytes(n, floats().map(|x| crate::base::f16_of(x).to_le_bytes())),
        DType::BF16 => collect_bytes(n, floats().map(|x| crate::base::bf16_of(x).to_le_bytes())),
        DType::I64 => collect_bytes(n, ints().map(i64::to_le_bytes)),
        DType::U8 => collect_bytes(n, ints().map(|x| [x as u8])),
    }
}

/// Gathers `n` elements' bytes into one buffer; running out of host memory is an error.
fn collect_bytes<const N: usize>(
    n: usize,
    elems: impl Iterator<Item = [u8; N]>,
) -> Result<Vec<u8>> {
    let bytes = n.saturating_mul(N);
    let mut out = Vec::new();
    out.try_reserve_exact(bytes).map_err(|_| {
        Error::invalid(
            "save_state",
            format!(
                "the host could not allocate {} to stage a tensor for writing; free host memory and retry",
                format_size(bytes as u64)
            ),
        )
    })?;
    for e in elems {
        out.extend_from_slice(&e);
    }
    Ok(out)
}

/// Builds one CPU tensor from its bytes in the file's data section.
fn decode(path: &Path, name: &str, info: &TensorInfo, data: &[u8]) -> Result<Tensor> {
    let (start, end) = info.data_offsets;
    let raw = data
        .get(start..end)
        .ok_or_else(|| bad_file(path, format!("tensor '{name}' lies outside the file")))?;
    let values = match info.dtype {
        Dtype::F32 => CpuData::F32(from_le(raw, f32::from_le_bytes)),
        Dtype::F64 => CpuData::F64(from_le(raw, f64::from_le_bytes)),
        Dtype::F16 => CpuData::F16(from_le(raw, f16::from_le_bytes)),
        Dtype::BF16 => CpuData::BF16(from_le(raw, bf16::from_le_bytes)),
        Dtype::I64 => CpuData::I64(from_le(raw, i64::from_le_bytes)),
        Dtype::U8 => CpuData::U8(raw.to_vec()),
        other => {
            return Err(bad_file(
                path,
                format!(
                    "tensor '{name}' has dtype {other:?}; ferrograd reads f32, f64, f16, bf16, i64 and u8: convert it before saving"
                ),
            ));
        }
    };
    let (dtype, len) = (values.dtype(), values.len());
    let storage = Storage::new(
        Device::Cpu,
        dtype,
        len,
        Category::Input,
        "load_state",
        |_| Ok(BackendData::Cpu(values)),
    )?;
    Ok(Tensor::from_storage(
        Arc::new(storage),
        Layout::contiguous(&info.shape),
    ))
}

/// Little-endian elements of `N` bytes each.
fn from_le<T, const N: usize>(raw: &[u8], f: fn([u8; N]) -> T) -> Vec<T> {
    raw.chunks_exact(N)
        .map(|c| {
            let mut a = [0u8; N];
            a.copy_from_slice(c);
            f(a)
        })
        .collect()
}

/// Writes a file through `write` into a temporary sibling, fsyncs it and renames it over
/// `path`. The sibling sits in the same directory so the rename is atomic.
fn write_atomic(
    path: &Path,
    write: impl FnOnce(&mut BufWriter<&File>) -> Result<()>,
) -> Result<()> {
    let name = path.file_name().ok_or_else(|| {
        Error::invalid(
            "save_state",
            format!(
                "'{}' names no file; give a path like run/state.safetensors",
                path.display()
            ),
        )
    })?;
    let dir = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    remove_stale_temporaries(dir, name);
    let tmp = TempFile::create(dir, name, path)?;
    {
        let mut w = BufWriter::with_capacity(1 << 20, tmp.file()?);
        write(&mut w)?;
        w.flush().map_err(io_err(path))?;
    }
    tmp.persist(path)?;
    sync_dir(dir);
    Ok(())
}

/// Removes the temporary files `.NAME.PID.N.tmp` (and `.NAME.PID.probe.tmp`) of this target left by processes that are
/// gone (killed mid-save). Linux only, where `/proc/PID` says whether a process lives; files
/// of living processes, and anything else in the folder, are left alone. Best effort.
fn remove_stale_temporaries(dir: &Path, name: &std::ffi::OsStr) {
    if !cfg!(target_os = "linux") || !Path::new("/proc/self").exists() {
        return;
    }
    let Some(name) = name.to_str() else {
        return;
    };
    let prefix = format!(".{name}.");
    let Ok(entries) = fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let file = entry.file_name();
        let Some(pid) = file
            .to_str()
            .and_then(|f| f.strip_prefix(&prefix))
            .and_then(|rest| rest.strip_suffix(".tmp"))
            .and_then(|rest| rest.split_once('.'))
            // `N` of a save, or `probe` of `check_output_path`.
            .filter(|(_, n)| {
                *n == "probe" || (!n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
            })
            .and_then(|(pid, _)| pid.parse::<u32>().ok())
        else {
            continue;
        };
        let alive = pid == std::process::id() || Path::new(&format!("/proc/{pid}")).exists();
        if !alive {
            let _ = fs::remove_file(entry.path());
        }
    }
}

/// A temporary file that deletes itself unless `persist` renamed it into place (also when a
/// panic unwinds through the save).
struct TempFile {
    path: PathBuf,
    file: Option<File>,
    kept: bool,
}

impl TempFile {
    fn create(dir: &Path, name: &std::ffi::OsStr, target: &Path) -> Result<TempFile> {
        // Unique per process and per call, so concurrent saves never share a temporary.
        static COUNTER: AtomicU64 = AtomicU64::new(0);
        let n = COUNTER.fetch_add(1, Ordering::Relaxed);
        let mut tmp_name = OsString::from(".");
        tmp_name.push(name);
        tmp_name.push(format!(".{}.{n}.tmp", std::process::id()));
        let path = dir.join(tmp_name);
        let file = OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&path)
            .map_err(io_err(target))?;
        Ok(TempFile {
            path,
            file: Some(file),
            kept: false,
        })
    }

    fn file(&self) -> Result<&File> {
        self.file
            .as_ref()
            .ok_or_else(|| Error::invalid("save_state", "the temporary file is already closed"))
    }

    /// Flushes the data to disk, closes the file and renames it to `target`.
    fn persist(mut self, target: &Path) -> Result<()> {
        let file = self.file.take();
        if let Some(f) = &file {
            f.sync_all().map_err(io_err(target))?;
        }
        drop(file);
        fs::rename(&self.path, target).map_err(io_err(target))?;
        self.kept = true;
        Ok(())
    }
}

impl Drop for TempFile {
    fn drop(&mut self) {
        if !self.kept {
            self.file.take();
            let _ = fs::remove_file(&self.path);
        }
    }
}

/// Makes the rename durable. Best effort: the new file is complete either way, and a failure
/// here (some filesystems refuse to sync directories) does not make it wrong.
fn sync_dir(dir: &Path) {
    #[cfg(unix)]
    if let Ok(d) = File::open(dir) {
        let _ = d.sync_all();
    }
    #[cfg(not(unix))]
    let _ = dir;
}
