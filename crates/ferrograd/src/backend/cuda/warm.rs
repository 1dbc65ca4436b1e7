//! Every kernel module compiled and loaded ahead of use, in parallel. First use loads a module
//! at a time (NVRTC, then the driver's translation to machine code: about 5 s for one
//! attention module), so a fresh machine spends minutes before a test run or a first step that
//! touches many of them; here they all go through the kernel cache on every host thread at
//! once, and later processes read the cache (`ferrograd info --compile-kernels`).

use std::path::{Path, PathBuf};
use std::time::Instant;

use rayon::prelude::*;

use super::device::{cached_module, compile_cubin, compile_ptx};
use super::launch::Module;
use super::{attention, elementwise, index, kernel_cache, loss, optim, reduce, rows};
use crate::base::{Error, Result};

/// Every kernel module of the backend.
pub(crate) fn all_modules() -> Vec<&'static Module> {
    let single: [&'static Module; 5] = [
        &elementwise::SHARED,
        &index::KERNELS,
        &loss::KERNELS,
        &optim::KERNELS,
        &reduce::KERNELS,
    ];
    let families: [&'static [Module]; 5] = [
        &elementwise::BY_DTYPE,
        &rows::KERNELS,
        &attention::BF16,
        &attention::F16,
        &attention::F32,
    ];
    single
        .into_iter()
        .chain(families.into_iter().flatten())
        .collect()
}

/// What `compile_all_kernels` did on one GPU.
#[derive(Clone, Debug)]
pub struct Warmed {
    /// Modules in the backend.
    pub modules: usize,
    /// Of those, the ones this call loaded (the rest were loaded already).
    pub loaded_now: usize,
    /// Host threads that compiled and loaded them.
    pub threads: usize,
    pub seconds: f64,
}

/// Compiles (or reads from the kernel cache) and loads every kernel module on GPU `ordinal`,
/// on as many threads as the host has, so that later launches in this process, and later
/// processes through the kernel cache, compile nothing.
pub fn compile_all_kernels(ordinal: usize) -> Result<Warmed> {
    let d = super::device(ordinal)?;
    let modules: Vec<_> = all_modules()
        .into_iter()
        .map(|m| (m.key(), m.source()))
        .collect();
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let t0 = Instant::now();
    let loaded_now = d.load_modules(&modules, threads)?;
    Ok(Warmed {
        modules: modules.len(),
        loaded_now,
        threads,
        seconds: t0.elapsed().as_secs_f64(),
    })
}

/// Every kernel module's PTX as NVRTC compiles it for `arch` (as "sm_90a" or "sm_80"), written
/// into `dir` as `<module>.ptx`: what the GPU would load, for reading without one (`ptxas -v`
/// for registers and notes, `cuobjdump -sass`, scripts/check_wgmma.sh). Needs NVRTC, not a
/// GPU or its driver. Compiles on every host thread; returns the files in module order.
pub fn emit_all_ptx(dir: &Path, arch: &str) -> Result<Vec<PathBuf>> {
    emit_ptx(&all_modules(), dir, arch)
}

fn emit_ptx(modules: &[&'static Module], dir: &Path, arch: &str) -> Result<Vec<PathBuf>> {
    const OP: &str = "emit_ptx";
    let arch = nvrtc_arch(OP, arch)?;
    std::fs::create_dir_all(dir)
        .map_err(|e| Error::invalid(OP, format!("cannot make {}: {e}", dir.display())))?;
    modules
        .par_iter()
        .map(|m| {
            let ptx = compile_ptx(m.key(), m.source(), arch)
                .map_err(|e| Error::invalid(OP, format!("NVRTC could not compile {e}")))?;
            let file = dir.join(format!("{}.ptx", m.key()));
            std::fs::write(&file, ptx)
                .map_err(|e| Error::invalid(OP, format!("cannot write {}: {e}", file.display())))?;
            Ok(file)
        })
        .collect()
}

/// What `fill_kernel_cache` did.
#[derive(Clone, Debug)]
pub struct Filled {
    /// The kernel cache folder.
    pub dir: PathBuf,
    /// Modules in the backend.
    pub modules: usize,
    /// Of those, the ones NVRTC compiled now (the rest were in the cache already).
    pub compiled_now: usize,
    pub seconds: f64,
}

/// Every kernel module compiled by NVRTC for `arch` into this process's kernel cache as
/// machine code, without a GPU or its driver: a GPU of that architecture whose processes use
/// the same cache folder (`FERROGRAD_KERNEL_CACHE`) and the same NVRTC version then compiles
/// and translates nothing, only loads.
pub fn fill_kernel_cache(arch: &str) -> Result<Filled> {
    let dir = super::kernel_cache::default_dir().ok_or_else(|| {
        Error::invalid(
            "fill_kernel_cache",
            "the kernel cache is off or has no home folder: set FERROGRAD_KERNEL_CACHE to a folder",
        )
    })?;
    fill_cache_in(&all_modules(), dir, arch)
}

fn fill_cache_in(modules: &[&'static Module], dir: PathBuf, arch: &str) -> Result<Filled> {
    const OP: &str = "fill_kernel_cache";
    let arch = nvrtc_arch(OP, arch)?;
    let t0 = Instant::now();
    let compiled: Vec<bool> = modules
        .par_iter()
        .map(|m| {
            let file = cached_module(&dir, m.key(), m.source(), arch);
            let compile = || {
                compile_cubin(m.key(), m.source(), arch)
                    .map_err(|e| Error::invalid(OP, format!("NVRTC could not compile {e}")))
            };
            kernel_cache::image_or_compile(Some(&file), compile).map(|found| !found.from_disk)
        })
        .collect::<Result<_>>()?;
    Ok(Filled {
        dir,
        modules: modules.len(),
        compiled_now: compiled.iter().filter(|&&now| now).count(),
        seconds: t0.elapsed().as_secs_f64(),
    })
}

/// `arch` checked as an architecture NVRTC can be given ("sm_90a", "sm_80"), with NVRTC
/// present.
fn nvrtc_arch<'a>(op: &'static str, arch: &'a str) -> Result<&'a str> {
    let valid = arch.strip_prefix("sm_").is_some_and(|v| {
        let digits = v.strip_suffix('a').unwrap_or(v);
        !digits.is_empty() && digits.chars().all(|c| c.is_ascii_digit())
    });
    if !valid {
        return Err(Error::invalid(
            op,
            format!("'{arch}' is not a GPU architecture: name one as sm_90a, sm_90 or sm_80"),
        ));
    }
    if super::info::nvrtc_version().is_none() {
        return Err(Error::invalid(
            op,
            "NVRTC (libnvrtc) was not found: install CUDA's NVRTC or put its folder on LD_LIBRARY_PATH",
        ));
    }
    Ok(arch)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// With NVRTC, a module's PTX lands in the folder, compiled for the architecture named;
    /// without it (CI), the error says what to install.
    #[test]
    fn ptx_is_written_for_the_architecture_or_nvrtc_is_asked_for() {
        let dir = std::env::temp_dir().join(format!("ferrograd-emit-ptx-{}", std::process::id()));
        let written = emit_ptx(&[&index::KERNELS], &dir, "sm_80");
        match super::super::info::nvrtc_version() {
            Some(_) => {
                let files = written.expect("NVRTC is present");
                assert_eq!(files, vec![dir.join("index.ptx")]);
                let ptx = std::fs::read_to_string(&files[0]).expect("written");
                assert!(
                    ptx.lines().any(|l| l.trim() == ".target sm_80"),
                    "{ptx:.300}"
                );
            }
            None => {
                let e = written.expect_err("no NVRTC here").to_string();
                assert!(e.contains("NVRTC (libnvrtc) was not found"), "{e}");
            }
        }
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// With NVRTC, the filled file is the one a GPU of that architecture reads, and a second
    /// fill compiles nothing; without it (CI), the error says what to install.
    #[test]
    fn a_filled_cache_holds_the_file_a_gpu_reads() {
        let dir = std::env::temp_dir().join(format!("ferrograd-fill-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let first = fill_cache_in(&[&index::KERNELS], dir.clone(), "sm_80");
        match super::super::info::nvrtc_version() {
            Some(_) => {
                let first = first.expect("NVRTC is present");
                assert_eq!((first.modules, first.compiled_now), (1, 1));
                let file =
                    cached_module(&dir, index::KERNELS.key(), index::KERNELS.source(), "sm_80");
                let image = std::fs::read(&file).expect("the GPU's file is there");
                assert_eq!(&image[..4], b"\x7fELF", "machine code, not PTX");
                let again =
                    fill_cache_in(&[&index::KERNELS], dir.clone(), "sm_80").expect("filled");
                assert_eq!(again.compiled_now, 0);
            }
            None => {
                let e = first.expect_err("no NVRTC here").to_string();
                assert!(e.contains("NVRTC (libnvrtc) was not found"), "{e}");
            }
        }
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn an_architecture_is_named_as_sm_and_digits() {
        let dir = std::env::temp_dir();
        for bad in ["90a", "sm_", "sm_a", "sm_9x", "compute_90"] {
            let e = emit_ptx(&[], &dir, bad).expect_err(bad).to_string();
            assert!(e.contains("is not a GPU architecture"), "{bad}: {e}");
            let e = fill_cache_in(&[], dir.clone(), bad)
                .expect_err(bad)
                .to_string();
            assert!(e.contains("is not a GPU architecture"), "{bad}: {e}");
        }
    }

    #[test]
    fn every_kernel_file_is_compiled_by_a_listed_module() {
        let files = [
            include_str!("kernels/attention.cu"),
            include_str!("kernels/attention_f32.cu"),
            include_str!("kernels/elementwise.cu"),
            include_str!("kernels/index.cu"),
            include_str!("kernels/loss.cu"),
            include_str!("kernels/optim.cu"),
            include_str!("kernels/reduce.cu"),
            include_str!("kernels/rows.cu"),
        ];
        let all = all_modules();
        for (i, f) in files.iter().enumerate() {
            assert!(
                all.iter().any(|m| m.body().contains(f)),
                "kernel file {i} of the list is in no module"
            );
        }
        // The shared header goes with both attention files.
        let common = include_str!("kernels/attention_common.cuh");
        let with_common = all.iter().filter(|m| m.body().contains(common)).count();
        assert_eq!(with_common, 24, "8 head dims × (bf16, f16, f32)");
    }

    #[test]
    fn module_keys_are_unique() {
        let mut keys: Vec<_> = all_modules().iter().map(|m| m.key()).collect();
        let n = keys.len();
        keys.sort_unstable();
        keys.dedup();
        assert_eq!(keys.len(), n);
        // 5 single modules, 4 elementwise and 4 row dtypes, 24 attention builds.
        assert_eq!(n, 37);
    }
}
