//! Every kernel module compiled and loaded ahead of use, in parallel. First use loads a module
//! at a time (NVRTC, then the driver's translation to machine code: about 5 s for one
//! attention module), so a fresh machine spends minutes before a test run or a first step that
//! touches many of them; here they all go through the kernel cache on every host thread at
//! once, and later processes read the cache (`ferrograd info --compile-kernels`).

use std::time::Instant;

use super::launch::Module;
use super::{attention, elementwise, index, loss, optim, reduce, rows};
use crate::base::Result;

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

#[cfg(test)]
mod tests {
    use super::*;

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
