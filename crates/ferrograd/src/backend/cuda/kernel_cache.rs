//! NVRTC's output kept on disk between runs. Compiling the kernel modules takes seconds each
//! (tens of seconds for all of them), and every process compiled them again: a run, each test
//! binary, each benchmark. The PTX of a module is stored under a name made from everything
//! that decides it — the source text, the compile options (the GPU architecture among them)
//! and NVRTC's version — so a changed kernel, another GPU or another NVRTC never reads a stale
//! file. The driver then turns the PTX into machine code (and keeps its own cache of that).
//!
//! Where: `FERROGRAD_KERNEL_CACHE` names the folder, or `off` (also `0`, `false`) turns the
//! cache off; by default `$XDG_CACHE_HOME/ferrograd/kernels`, else `~/.cache/ferrograd/kernels`.
//! The cache never makes a run fail: a folder that cannot be made or written, or a file that
//! cannot be read, means compiling as before. Files are written whole under a temporary name
//! and renamed into place, so a reader never sees half of one (processes may share the
//! folder); a file the driver refuses is removed (`forget`) and the module compiled again.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use crate::base::Result;

/// The environment variable that places the cache or turns it off.
pub(crate) const ENV: &str = "FERROGRAD_KERNEL_CACHE";

/// The cache folder this process uses, or None when the cache is off or has no home.
pub(crate) fn default_dir() -> Option<PathBuf> {
    dir_from(
        std::env::var_os(ENV).as_deref(),
        std::env::var_os("XDG_CACHE_HOME").as_deref(),
        std::env::var_os("HOME").as_deref(),
    )
}

/// The folder from the three variables (testable without touching the environment).
fn dir_from(
    setting: Option<&std::ffi::OsStr>,
    xdg: Option<&std::ffi::OsStr>,
    home: Option<&std::ffi::OsStr>,
) -> Option<PathBuf> {
    match setting {
        Some(s) if ["off", "0", "false"].contains(&s.to_string_lossy().as_ref()) => None,
        Some(s) if !s.is_empty() => Some(PathBuf::from(s)),
        _ => {
            let base = match (xdg, home) {
                (Some(x), _) if !x.is_empty() => PathBuf::from(x),
                (_, Some(h)) if !h.is_empty() => Path::new(h).join(".cache"),
                _ => return None,
            };
            Some(base.join("ferrograd").join("kernels"))
        }
    }
}

/// The file of module `key` compiled from `src` with `options` by `compiler` (a version):
/// `{key}-{hash}.ptx`, the hash over all four.
pub(crate) fn file_for(
    dir: &Path,
    key: &str,
    src: &str,
    options: &[String],
    compiler: &str,
) -> PathBuf {
    let mut h = Fnv::new();
    for part in [key, compiler, src] {
        h.write(part.as_bytes());
        h.write(&[0xff]);
    }
    for o in options {
        h.write(o.as_bytes());
        h.write(&[0xfe]);
    }
    let name: String = key
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
        .collect();
    dir.join(format!("{name}-{:016x}.ptx", h.finish()))
}

/// A module's PTX and whether it was read from the cache.
pub(crate) struct Found {
    pub ptx: String,
    pub from_disk: bool,
}

/// The PTX at `file` if there is a whole one, else `compile()`'s, stored there for the next
/// process. Errors are `compile`'s only.
pub(crate) fn ptx_or_compile(
    file: Option<&Path>,
    compile: impl FnOnce() -> Result<String>,
) -> Result<Found> {
    if let Some(ptx) = file.and_then(read) {
        return Ok(Found {
            ptx,
            from_disk: true,
        });
    }
    let ptx = compile()?;
    if let Some(file) = file {
        // A cache that cannot be written only costs the next run the compile.
        let _ = write(file, &ptx);
    }
    Ok(Found {
        ptx,
        from_disk: false,
    })
}

/// How many modules `dir` holds and their bytes (0 and 0 for a folder not made yet).
pub(crate) fn contents(dir: &Path) -> (usize, u64) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return (0, 0);
    };
    entries
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().ends_with(".ptx"))
        .fold((0, 0), |(n, b), e| {
            (n + 1, b + e.metadata().map_or(0, |m| m.len()))
        })
}

/// Removes a cached file the driver would not load (the caller then compiles afresh).
pub(crate) fn forget(file: &Path) {
    let _ = std::fs::remove_file(file);
}

/// A stored module: text that ends as NVRTC's PTX ends (a file cut short is not one).
fn read(file: &Path) -> Option<String> {
    let text = std::fs::read_to_string(file).ok()?;
    let whole = text.starts_with("//") && text.trim_end().ends_with('}');
    whole.then_some(text)
}

/// Writes `text` to a temporary file beside `file`, then renames it into place.
pub(crate) fn write(file: &Path, text: &str) -> std::io::Result<()> {
    let dir = file.parent().unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir)?;
    // Unique per process and call: two writers never share a temporary file.
    static WRITES: AtomicU64 = AtomicU64::new(0);
    let tmp = dir.join(format!(
        ".{}.{}.{}.tmp",
        file.file_name()
            .map_or_else(String::new, |n| n.to_string_lossy().into()),
        std::process::id(),
        WRITES.fetch_add(1, Ordering::Relaxed)
    ));
    // A failed write (a full disk) or rename leaves no temporary file behind.
    std::fs::write(&tmp, text)
        .and_then(|()| std::fs::rename(&tmp, file))
        .inspect_err(|_| {
            let _ = std::fs::remove_file(&tmp);
        })
}

/// FNV-1a, 64 bits: a name for a file, stable across builds and Rust versions (std's hasher
/// is not promised to be).
struct Fnv(u64);

impl Fnv {
    fn new() -> Fnv {
        Fnv(0xcbf2_9ce4_8422_2325)
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 ^ b as u64).wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    fn finish(&self) -> u64 {
        self.0
    }
}

#[cfg(test)]
mod tests {
    use std::cell::Cell;
    use std::ffi::OsStr;

    use super::*;

    const PTX: &str =
        "//\n// Generated by NVIDIA NVVM Compiler\n.version 9.0\n.entry k()\n{\n\tret;\n}\n";

    fn scratch(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!(
            "ferrograd-kernel-cache-{name}-{}",
            std::process::id()
        ));
        let _ = std::fs::remove_dir_all(&dir);
        dir
    }

    /// `ptx_or_compile` with a compiler that counts its calls and returns `out`.
    fn get(file: Option<&Path>, calls: &Cell<u32>, out: &str) -> String {
        let before = calls.get();
        let found = ptx_or_compile(file, || {
            calls.set(calls.get() + 1);
            Ok(out.to_string())
        })
        .unwrap();
        assert_eq!(found.from_disk, calls.get() == before);
        found.ptx
    }

    #[test]
    fn a_module_is_compiled_once_then_read_from_disk() {
        let dir = scratch("once");
        let opts = vec!["--gpu-architecture=sm_90".to_string()];
        let file = file_for(&dir, "rows", "src", &opts, "13.0");
        let calls = Cell::new(0);
        assert_eq!(get(Some(&file), &calls, PTX), PTX);
        assert_eq!(
            get(Some(&file), &calls, "other"),
            PTX,
            "read back, not compiled"
        );
        assert_eq!(calls.get(), 1);
        // No temporary file is left beside it.
        let names: Vec<_> = std::fs::read_dir(&dir).unwrap().flatten().collect();
        assert_eq!(names.len(), 1);
        assert_eq!(contents(&dir), (1, PTX.len() as u64));
        assert_eq!(contents(&dir.join("none")), (0, 0));
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn the_name_changes_with_the_source_the_options_and_the_compiler() {
        let dir = Path::new("/cache");
        let opts = |a: &str| vec![format!("--gpu-architecture={a}")];
        let base = file_for(dir, "rows", "src", &opts("sm_90"), "13.0");
        assert_eq!(base, file_for(dir, "rows", "src", &opts("sm_90"), "13.0"));
        for other in [
            file_for(dir, "rows", "src2", &opts("sm_90"), "13.0"),
            file_for(dir, "rows", "src", &opts("sm_80"), "13.0"),
            file_for(dir, "rows", "src", &opts("sm_90"), "13.1"),
            file_for(dir, "index", "src", &opts("sm_90"), "13.0"),
        ] {
            assert_ne!(base, other);
        }
        let name = base.file_name().unwrap().to_string_lossy().to_string();
        assert!(
            name.starts_with("rows-") && name.ends_with(".ptx"),
            "{name}"
        );
        // A module key with odd characters still makes one plain file name.
        let odd = file_for(dir, "attention/bf16 64", "s", &[], "13.0");
        assert_eq!(odd.parent(), Some(dir));
    }

    #[test]
    fn a_file_cut_short_or_forgotten_is_compiled_again() {
        let dir = scratch("short");
        std::fs::create_dir_all(&dir).unwrap();
        let file = file_for(&dir, "rows", "src", &[], "13.0");
        std::fs::write(&file, &PTX[..PTX.len() / 2]).unwrap();
        let calls = Cell::new(0);
        assert_eq!(get(Some(&file), &calls, PTX), PTX);
        assert_eq!(calls.get(), 1, "the half file was not used");
        assert_eq!(
            std::fs::read_to_string(&file).unwrap(),
            PTX,
            "and was replaced"
        );
        forget(&file);
        assert_eq!(get(Some(&file), &calls, PTX), PTX);
        assert_eq!(calls.get(), 2);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_cache_that_cannot_be_written_still_compiles_and_errors_are_the_compilers() {
        // The parent "folder" is a file: nothing can be created under it.
        let dir = scratch("blocked");
        std::fs::create_dir_all(&dir).unwrap();
        let blocker = dir.join("not-a-dir");
        std::fs::write(&blocker, "x").unwrap();
        let file = file_for(&blocker, "rows", "src", &[], "13.0");
        let calls = Cell::new(0);
        assert_eq!(get(Some(&file), &calls, PTX), PTX);
        assert_eq!(get(Some(&file), &calls, PTX), PTX);
        assert_eq!(calls.get(), 2);
        let e = ptx_or_compile(Some(&file), || {
            Err(crate::base::Error::invalid("nvrtc", "syntax error"))
        })
        .err()
        .unwrap();
        assert!(e.to_string().contains("syntax error"), "{e}");
        // Off: always compiled.
        assert_eq!(get(None, &calls, PTX), PTX);
        assert_eq!(calls.get(), 3);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn the_folder_comes_from_the_setting_then_xdg_then_home() {
        let os = |s: &'static str| Some(OsStr::new(s));
        assert_eq!(dir_from(os("off"), os("/x"), os("/h")), None);
        assert_eq!(dir_from(os("0"), None, os("/h")), None);
        assert_eq!(
            dir_from(os("/k"), os("/x"), os("/h")),
            Some(PathBuf::from("/k"))
        );
        assert_eq!(
            dir_from(None, os("/x"), os("/h")),
            Some(PathBuf::from("/x/ferrograd/kernels"))
        );
        assert_eq!(
            dir_from(os(""), os(""), os("/h")),
            Some(PathBuf::from("/h/.cache/ferrograd/kernels"))
        );
        assert_eq!(dir_from(None, None, None), None);
    }
}
