//! What the benchmarks share: reading their `--name value` arguments, warming up what they
//! time.
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
