//! NVRTC's output kept on disk between runs. Compiling the kernel modules takes seconds each
//! (tens of seconds for all of them), and every process compiled them again: a run, each test
//! binary, each benchmark. A module's machine code (a cubin, which the driver loads as it is)
//! is stored under a name made from everything that decides it — the source text, the compile
//! options (the GPU architecture among them) and NVRTC's version — so a changed kernel, another
//! GPU or another NVRTC never reads a stale file. Machine code, not PTX: the driver's
//! translation of PTX took about 100 s for all the modules on a fresh H100 with their PTX
//! already here, and only machine code made ahead (`fill_kernel_cache`, anywhere) saves that.
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
/// `{key}-{hash}.cubin`, the hash over all four.
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
    dir.join(format!("{name}-{:016x}.{EXT}", h.finish()))
}

/// The extension of a cached module.
const EXT: &str = "cubin";

/// A module's machine code and whether it was read from the cache.
pub(crate) struct Found {
    pub image: Vec<u8>,
    pub from_disk: bool,
}

/// The machine code at `file` if there is a whole one, else `compile()`'s, stored there for
/// the next process. Errors are `compile`'s only.
pub(crate) fn image_or_compile(
    file: Option<&Path>,
    compile: impl FnOnce() -> Result<Vec<u8>>,
) -> Result<Found> {
    if let Some(image) = file.and_then(read) {
        return Ok(Found {
            image,
            from_disk: true,
        });
    }
    let image = compile()?;
    if let Some(file) = file {
        // A cache that cannot be written only costs the next run the compile.
        let _ = write(file, &image);
    }
    Ok(Found {
        image,
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
        .filter(|e| e.path().extension().is_some_and(|x| x == EXT))
        .fold((0, 0), |(n, b), e| {
            (n + 1, b + e.metadata().map_or(0, |m| m.len()))
        })
}

/// Removes a cached file the driver would not load (the caller then compiles afresh).
pub(crate) fn forget(file: &Path) {
    let _ = std::fs::remove_file(file);
}

/// A stored module: a 64-bit ELF file as long as its header says (its section headers come
/// last), so a file cut short, or one that is not machine code, is not read.
fn read(file: &Path) -> Option<Vec<u8>> {
    let bytes = std::fs::read(file).ok()?;
    whole_elf(&bytes).then_some(bytes)
}

fn whole_elf(b: &[u8]) -> bool {
    if b.len() < 64 || &b[..4] != b"\x7fELF" || b[4] != 2 || b[5] != 1 {
        return false;
    }
    let u64_at = |o: usize| u64::from_le_bytes(b[o..o + 8].try_into().unwrap_or_default());
    let u16_at = |o: usize| u16::from_le_bytes([b[o], b[o + 1]]) as u64;
    // e_shoff + e_shnum · e_shentsize: the end of the section header table.
    let end = u64_at(0x28).saturating_add(u16_at(0x3c).saturating_mul(u16_at(0x3a)));
    end <= b.len() as u64
}

/// Writes `bytes` to a temporary file beside `file`, then renames it into place.
pub(crate) fn write(file: &Path, bytes: &[u8]) -> std::io::Result<()> {
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
    std::fs::write(&tmp, bytes)
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

    /// A 64-bit ELF file of 128 bytes whose one section header (64 bytes) ends it, marked by
    /// `tag`: whole as far as `read` can tell.
    fn elf(tag: u8) -> Vec<u8> {
        let mut b = vec![0u8; 128];
        b[..6].copy_from_slice(b"\x7fELF\x02\x01");
        b[0x28..0x30].copy_from_slice(&64u64.to_le_bytes()); // e_shoff
        b[0x3a..0x3c].copy_from_slice(&64u16.to_le_bytes()); // e_shentsize
        b[0x3c..0x3e].copy_from_slice(&1u16.to_le_bytes()); // e_shnum
        b[100] = tag;
        b
    }

    fn scratch(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!(
            "ferrograd-kernel-cache-{name}-{}",
            std::process::id()
        ));
        let _ = std::fs::remove_dir_all(&dir);
        dir
    }

    /// `image_or_compile` with a compiler that counts its calls and returns `out`.
    fn get(file: Option<&Path>, calls: &Cell<u32>, out: &[u8]) -> Vec<u8> {
        let before = calls.get();
        let found = image_or_compile(file, || {
            calls.set(calls.get() + 1);
            Ok(out.to_vec())
        })
        .unwrap();
        assert_eq!(found.from_disk, calls.get() == before);
        found.image
    }

    #[test]
    fn a_module_is_compiled_once_then_read_from_disk() {
        let dir = scratch("once");
        let opts = vec!["--gpu-architecture=sm_90".to_string()];
        let file = file_for(&dir, "rows", "src", &opts, "13.0");
        let calls = Cell::new(0);
        let image = elf(1);
        assert_eq!(get(Some(&file), &calls, &image), image);
        assert_eq!(
            get(Some(&file), &calls, &elf(2)),
            image,
            "read back, not compiled"
        );
        assert_eq!(calls.get(), 1);
        // No temporary file is left beside it.
        let names: Vec<_> = std::fs::read_dir(&dir).unwrap().flatten().collect();
        assert_eq!(names.len(), 1);
        assert_eq!(contents(&dir), (1, image.len() as u64));
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
            name.starts_with("rows-") && name.ends_with(".cubin"),
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
        let image = elf(1);
        let calls = Cell::new(0);
        // Cut short, or not machine code at all (the PTX this cache once held).
        let ptx = b"//\n.version 9.0\n.entry k()\n{\n\tret;\n}\n".to_vec();
        for (n, bad) in [image[..image.len() - 1].to_vec(), image[..32].to_vec(), ptx]
            .iter()
            .enumerate()
        {
            std::fs::write(&file, bad).unwrap();
            assert_eq!(get(Some(&file), &calls, &image), image);
            assert_eq!(calls.get(), n as u32 + 1, "the bad file was not used");
            assert_eq!(std::fs::read(&file).unwrap(), image, "and was replaced");
        }
        forget(&file);
        assert_eq!(get(Some(&file), &calls, &image), image);
        assert_eq!(calls.get(), 4);
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
        let image = elf(1);
        assert_eq!(get(Some(&file), &calls, &image), image);
        assert_eq!(get(Some(&file), &calls, &image), image);
        assert_eq!(calls.get(), 2);
        let e = image_or_compile(Some(&file), || {
            Err(crate::base::Error::invalid("nvrtc", "syntax error"))
        })
        .err()
        .unwrap();
        assert!(e.to_string().contains("syntax error"), "{e}");
        // Off: always compiled.
        assert_eq!(get(None, &calls, &image), image);
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
