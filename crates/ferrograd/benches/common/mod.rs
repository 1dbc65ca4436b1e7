//! What the benchmarks share: reading their `--name value` arguments, warming up what they
//! time, timing calls queued back to back.
// Each benchmark compiles this module and uses part of it.
#![allow(dead_code)]

/// The value after `name` on the command line, parsed; `default` when it is absent or does
/// not parse.
pub fn arg<T: std::str::FromStr>(name: &str, default: T) -> T {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// Three calls of `f` before it is timed: kernels compiled and cached, blocks in the
/// allocator's pools.
pub fn warm_up(f: &dyn Fn() -> ferrograd::Result<()>) -> ferrograd::Result<()> {
    for _ in 0..3 {
        f()?;
    }
    Ok(())
}

/// Seconds per call of `f`, over `iters` calls queued back to back after three warm-up calls,
/// with one synchronisation before and one after: the device's own time per call wherever
/// the host queues work faster than the device runs it (host overhead hidden, as in a
/// training step), unlike a timing that waits for every call.
pub fn queued_s(
    dev: ferrograd::Device,
    iters: usize,
    f: &dyn Fn() -> ferrograd::Result<()>,
) -> ferrograd::Result<f64> {
    use ferrograd::backend::synchronize;
    warm_up(f)?;
    synchronize(dev)?;
    let t0 = std::time::Instant::now();
    for _ in 0..iters {
        f()?;
    }
    synchronize(dev)?;
    Ok(t0.elapsed().as_secs_f64() / iters.max(1) as f64)
}
