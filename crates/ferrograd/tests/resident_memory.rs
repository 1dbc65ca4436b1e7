//! Resident memory against the allocator's count: the promise that every byte is attributed
//! means a process's resident set grows by no more than the allocator's peak plus a small
//! constant (thread stacks, code pages, allocator metadata). Measured from /proc/self/status
//! (VmRSS before, VmHWM after, the high-water mark reset through /proc/self/clear_refs) around
//! large ops whose kernels once took scratch space the allocator never saw.
//!
//! One test in its own binary: the high-water mark is per process, so no other test may run
//! beside it. Set FERROGRAD_RSS_REPORT=1 to print the figures.

use ferrograd::memory::{max_memory_allocated, memory_allocated, reset_peak_memory_stats};
use ferrograd::{DType, Device, Tensor};

const CPU: Device = Device::Cpu;
/// What the resident set may grow beyond the allocator's peak.
const SLACK: u64 = 64 << 20;

fn status_bytes(key: &str) -> u64 {
    let text = std::fs::read_to_string("/proc/self/status").unwrap();
    let line = text.lines().find(|l| l.starts_with(key)).unwrap();
    let kib: u64 = line.split_whitespace().nth(1).unwrap().parse().unwrap();
    kib * 1024
}

/// (growth of the resident high-water mark, growth of the allocator's peak) while `f` runs.
fn measure(f: impl FnOnce()) -> (u64, u64) {
    std::fs::write("/proc/self/clear_refs", "5").expect("resetting VmHWM needs Linux 4.0+");
    reset_peak_memory_stats(CPU).unwrap();
    let (rss0, alloc0) = (status_bytes("VmRSS:"), memory_allocated(CPU).unwrap());
    f();
    let rss = status_bytes("VmHWM:").saturating_sub(rss0);
    (rss, max_memory_allocated(CPU).unwrap() - alloc0)
}

fn check(name: &str, f: impl FnOnce()) {
    let (rss, peak) = measure(f);
    if std::env::var_os("FERROGRAD_RSS_REPORT").is_some() {
        let mb = |b: u64| b as f64 / 1e6;
        println!(
            "{name}: resident +{:.1} MB ({rss} B), allocator peak +{:.1} MB ({peak} B)",
            mb(rss),
            mb(peak)
        );
    }
    assert!(
        rss <= peak + SLACK,
        "{name}: resident memory grew {rss} bytes, the allocator's peak only {peak}"
    );
}

#[test]
fn resident_memory_stays_within_the_allocators_peak() {
    // Warm up the thread pool and the allocator's tables outside the measurements.
    Tensor::randn(&[1 << 20], DType::F32, CPU)
        .unwrap()
        .sum_all()
        .unwrap();
    let before = memory_allocated(CPU).unwrap();
    check("randn of 1 GB (2.5e8 f32)", || {
        let x = Tensor::randn(&[250_000_000], DType::F32, CPU).unwrap();
        assert_eq!(x.numel(), 250_000_000);
    });
    check("randn of 1 GB as f16 (5e8 f16)", || {
        Tensor::randn(&[500_000_000], DType::F16, CPU).unwrap();
    });
    check("sum of a 2.5e8-element expanded view", || {
        let one = Tensor::ones(&[1], DType::F32, CPU).unwrap();
        let s = one.expand(&[250_000_000]).unwrap().sum_all().unwrap();
        assert_eq!(s.to_vec::<f32>().unwrap(), [2.5e8]);
    });
    check(
        "sum of a (50000, 1)-to-(50000, 5000) expanded view over dim 1",
        || {
            let col = Tensor::ones(&[50_000, 1], DType::F32, CPU).unwrap();
            let s = col
                .expand(&[50_000, 5000])
                .unwrap()
                .sum(&[1], false)
                .unwrap();
            assert_eq!(s.shape(), [50_000]);
        },
    );
    let x = Tensor::rand(&[8192, 4096], DType::F32, CPU).unwrap();
    check("sum of a transposed 128 MB tensor (strided walk)", || {
        let s = x.t().unwrap().sum_all().unwrap();
        let direct = x.sum_all().unwrap();
        let (a, b) = (s.to_vec::<f32>().unwrap(), direct.to_vec::<f32>().unwrap());
        assert!((a[0] - b[0]).abs() <= 1e-3 * b[0].abs(), "{a:?} {b:?}");
    });
    drop(x);
    assert_eq!(memory_allocated(CPU).unwrap(), before);
}
