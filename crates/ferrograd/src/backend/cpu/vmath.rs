//! Vector-friendly math for the CPU kernels: branch-free scalar functions that the compiler
//! turns into SIMD loops, and `simd_fn!`, which compiles a kernel's loop for the widest
//! instruction set the machine has (AVX-512 or AVX2 with FMA, picked at run time; the baseline
//! x86-64 build otherwise only has SSE2). `FERROGRAD_CPU_CAPABILITY=avx2` (or `default`)
//! caps that choice, to measure on an AVX-512 machine what a CPU without it runs.
//!
//! `exp_f32` is Cephes' `expf` (range reduction by ln 2 in two parts, a degree-6 polynomial,
//! scaling by 2ⁿ through the exponent bits). Plain multiplies and adds, never fused, so every
//! instruction set gives the same bits. Its error over every 61st f32 in [-104, 89] is at most
//! 1 ulp for normal results (tests below), against the correctly rounded exp. `tanh_f32`
//! (Cephes `tanhf`) and `ln_f32` (Cephes `logf`) are built the same way, both at most 1 ulp
//! over sweeps of tens of millions of inputs against f64 references (tests below).

/// Partial results a lane reduction keeps: eight independent chains fill the vector registers
/// where one serial chain would wait on every operation (four cycles an addition).
const LANES: usize = 8;

/// term(0) ∘ term(1) ∘ … ∘ term(n − 1) for an associative `op` (sum, max), over `LANES`
/// partial results, then the tail: a fixed order, the same on every instruction set.
#[inline(always)]
pub(crate) fn lane_fold<T: Copy>(
    n: usize,
    init: T,
    term: impl Fn(usize) -> T,
    op: impl Fn(T, T) -> T,
) -> T {
    let mut acc = [init; LANES];
    let whole = n / LANES * LANES;
    for base in (0..whole).step_by(LANES) {
        for (l, a) in acc.iter_mut().enumerate() {
            *a = op(*a, term(base + l));
        }
    }
    let tail = (whole..n).fold(init, |a, j| op(a, term(j)));
    let [a0, a1, a2, a3, a4, a5, a6, a7] = acc;
    op(
        op(op(op(a0, a4), op(a1, a5)), op(op(a2, a6), op(a3, a7))),
        tail,
    )
}

/// Σ f(i) for i in 0..n in f64 over `LANES` partial sums. Row kernels sum f32 values in
/// f64, so the order changes only the f64's last bits.
#[inline(always)]
pub(crate) fn lane_sum(n: usize, f: impl Fn(usize) -> f64) -> f64 {
    lane_fold(n, 0.0, f, |a, b| a + b)
}

/// exp(x) for f32, at most 1 ulp from the correctly rounded value; NaN gives NaN, large
/// arguments +inf, very negative ones 0 (results below f32's normal range may lose bits).
#[inline(always)]
pub(crate) fn exp_f32(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    // 1.5·2²³: adding it rounds to an integer held in the low mantissa bits.
    const MAGIC: f32 = 12_582_912.0;
    // Comparisons with NaN are false: NaN passes through and gives NaN below.
    let x = if x < -104.0 { -104.0 } else { x };
    let x = if x > 89.0 { 89.0 } else { x };
    let t = x * LOG2E + MAGIC;
    let n = (t.to_bits() as i32).wrapping_sub(MAGIC.to_bits() as i32);
    let nf = t - MAGIC;
    let r = x - nf * LN2_HI - nf * LN2_LO;
    let p = 1.987_569_2e-4_f32;
    let p = p * r + 1.398_199_9e-3;
    let p = p * r + 8.333_452e-3;
    let p = p * r + 4.166_579_6e-2;
    let p = p * r + 1.666_666_5e-1;
    let p = p * r + 0.5;
    let p = p * r * r + r + 1.0;
    // 2ⁿ in two halves, each within the exponent's range for n in [-150, 129].
    let n1 = n >> 1;
    let n2 = n - n1;
    let s1 = f32::from_bits(((n1 + 127) as u32) << 23);
    let s2 = f32::from_bits(((n2 + 127) as u32) << 23);
    p * s1 * s2
}

/// tanh(x) for f32 (Cephes' `tanhf`), at most 1 ulp from the correctly rounded value over
/// every 31st f32 up to |x| = 20 (tested; beyond, tanh is ±1 in f32): an odd
/// polynomial below |x| = 0.625, where 1 − 2/(e²ˣ + 1) would cancel, and that formula (on the
/// vectorisable `exp_f32`) above it. Both are computed and one is selected, so the loop has no
/// branch. NaN gives NaN, ±inf gives ±1.
#[inline(always)]
pub(crate) fn tanh_f32(x: f32) -> f32 {
    let z = x.abs();
    let e = exp_f32(z + z);
    // e = +inf above |x| ≈ 44.5: 2/inf = 0 and the result is exactly ±1.
    let big = 1.0 - 2.0 / (e + 1.0);
    let s = x * x;
    let p = -5.704_988_7e-3_f32;
    let p = p * s + 2.063_909e-2;
    let p = p * s - 5.373_971_6e-2;
    let p = p * s + 1.333_144_2e-1;
    let p = p * s - 3.333_328e-1;
    let small = p * s * x + x;
    // Both are ≥ 0 for x ≥ 0 and ≤ 0 below; the sign of x also keeps tanh(−0) = −0.
    let r = if z >= 0.625 { big } else { small };
    r.copysign(x)
}

/// ln(x) for f32 (Cephes' `logf`), at most 1 ulp from the correctly rounded value: x = m·2ᵉ
/// with m in [√½, √2), a degree-9 polynomial in m − 1, and e·ln 2 added in two parts.
/// Subnormals are scaled into the normal range first; 0 gives −inf, negative numbers and NaN
/// give NaN, +inf gives +inf. Selections, no branches.
#[inline(always)]
pub(crate) fn ln_f32(x: f32) -> f32 {
    const SQRT_HALF: f32 = std::f32::consts::FRAC_1_SQRT_2;
    let tiny = x < f32::MIN_POSITIVE;
    // 2²⁵ lifts every positive subnormal into the normal range.
    let xs = if tiny { x * 33_554_432.0 } else { x };
    let bits = xs.to_bits() as i32;
    // Exponent e and mantissa m in [0.5, 1), as frexp.
    let mut e = ((bits >> 23) & 0xff) - 126 - if tiny { 25 } else { 0 };
    let m = f32::from_bits(((bits & 0x007f_ffff) | 0x3f00_0000) as u32);
    let low = m < SQRT_HALF;
    e -= i32::from(low);
    let r = if low { m + m - 1.0 } else { m - 1.0 };
    let z = r * r;
    let p = 7.037_683_6e-2_f32;
    let p = p * r - 1.151_461e-1;
    let p = p * r + 1.167_699_9e-1;
    let p = p * r - 1.242_014_1e-1;
    let p = p * r + 1.424_932_3e-1;
    let p = p * r - 1.666_805_8e-1;
    let p = p * r + 2.000_071_4e-1;
    let p = p * r - 2.499_999_4e-1;
    let p = p * r + 3.333_333e-1;
    let ef = e as f32;
    let y = p * r * z + ef * -2.121_944_4e-4 - 0.5 * z;
    let y = r + y + ef * 0.693_359_4;
    // Special inputs last, as selections: NaN and x < 0 give NaN, 0 gives −inf, inf gives inf.
    let y = if x == f32::INFINITY { x } else { y };
    let y = if x == 0.0 { f32::NEG_INFINITY } else { y };
    if x < 0.0 || x.is_nan() { f32::NAN } else { y }
}

/// The widest instruction set the kernels may use: the machine's, lowered by the
/// `FERROGRAD_CPU_CAPABILITY` environment variable (`avx2` or `default`, read once; like
/// PyTorch's `ATEN_CPU_CAPABILITY`) to measure what a CPU without AVX-512 would run.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Debug)]
pub(crate) enum Capability {
    /// The baseline build (SSE2 on x86-64).
    Default,
    /// AVX2 with FMA.
    Avx2,
    Avx512,
}

pub(crate) fn capability() -> Capability {
    static LEVEL: std::sync::OnceLock<Capability> = std::sync::OnceLock::new();
    *LEVEL.get_or_init(|| {
        let cap = std::env::var("FERROGRAD_CPU_CAPABILITY").ok();
        detected().min(
            match cap.as_deref().map(str::to_ascii_lowercase).as_deref() {
                Some("default") => Capability::Default,
                Some("avx2") => Capability::Avx2,
                _ => Capability::Avx512,
            },
        )
    })
}

fn detected() -> Capability {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512f") {
            return Capability::Avx512;
        }
        if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
        {
            return Capability::Avx2;
        }
    }
    Capability::Default
}

/// Defines `$name`, which calls the `#[inline(always)]` function `$inner` compiled for AVX-512
/// or AVX2 + FMA where the machine has them (`capability()`, checked at run time; the baseline
/// x86-64 build has only SSE2), so the loops inlined from `$inner` are vectorised for that
/// width. Every path gives the same bits: the kernels use no fused multiply-add.
macro_rules! simd_fn {
    ($vis:vis fn $name:ident[$($gen:tt)*]($($a:ident: $t:ty),* $(,)?) $(-> $r:ty)? = $inner:path;) => {
        $vis fn $name<$($gen)*>($($a: $t),*) $(-> $r)? {
            #[cfg(target_arch = "x86_64")]
            {
                use $crate::backend::cpu::vmath::{Capability, capability};
                #[target_feature(enable = "avx512f,avx2,fma")]
                fn v4<$($gen)*>($($a: $t),*) $(-> $r)? {
                    $inner($($a),*)
                }
                #[target_feature(enable = "avx2,fma")]
                fn v3<$($gen)*>($($a: $t),*) $(-> $r)? {
                    $inner($($a),*)
                }
                match capability() {
                    // SAFETY: capability() only reports features detected on this machine.
                    Capability::Avx512 => return unsafe { v4($($a),*) },
                    // SAFETY: as above.
                    Capability::Avx2 => return unsafe { v3($($a),*) },
                    Capability::Default => {}
                }
            }
            $inner($($a),*)
        }
    };
}
pub(crate) use simd_fn;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lane_sum_adds_every_term_once_whatever_the_tail() {
        for n in 0..40 {
            // Distinct powers of two: any term missed or counted twice changes the bits.
            let got = lane_sum(n, |i| (2.0f64).powi(i as i32));
            assert_eq!(got, (2.0f64).powi(n as i32) - 1.0, "n = {n}");
        }
        assert!(lane_sum(9, |i| if i == 8 { f64::NAN } else { 1.0 }).is_nan());
    }

    /// Distance in representable f32 values (both finite, same sign handled by the ordering).
    fn ulps(a: f32, b: f32) -> u64 {
        let key = |v: f32| {
            let b = v.to_bits() as i64;
            if b < 0 { i32::MIN as i64 - b } else { b }
        };
        (key(a) - key(b)).unsigned_abs()
    }

    #[test]
    fn exp_f32_is_within_one_ulp_over_a_dense_sweep() {
        let (mut worst, mut at, mut count) = (0u64, 0.0f32, 0usize);
        let mut check = |x: f32| {
            let want = (x as f64).exp() as f32;
            let got = exp_f32(x);
            if want.is_normal() || want == 0.0 && got == 0.0 {
                let u = ulps(got, want);
                if u > worst {
                    (worst, at) = (u, x);
                }
                count += 1;
            }
        };
        // Every 61st f32 in [-104, 89] (about 35 million values), both signs.
        for bits in (0..89.0f32.to_bits()).step_by(61) {
            check(f32::from_bits(bits));
        }
        for bits in (0..104.0f32.to_bits()).step_by(61) {
            check(-f32::from_bits(bits));
        }
        assert!(count > 30_000_000, "{count}");
        eprintln!("exp_f32: max {worst} ulp (at x = {at}) over {count} inputs");
        assert!(worst <= 1, "max error {worst} ulp at x = {at}");
    }

    #[test]
    fn exp_f32_edges() {
        assert!(exp_f32(f32::NAN).is_nan());
        assert_eq!(exp_f32(f32::INFINITY), f32::INFINITY);
        assert_eq!(exp_f32(89.0), f32::INFINITY);
        assert_eq!(exp_f32(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp_f32(-200.0), 0.0);
        assert_eq!(exp_f32(0.0), 1.0);
        assert!(exp_f32(88.7).is_finite());
        // Subnormal results: within one step of the smallest subnormal.
        for x in [-88.0f32, -95.0, -100.0, -103.0] {
            let want = (x as f64).exp() as f32;
            assert!(ulps(exp_f32(x), want) <= 1, "x = {x}");
        }
    }

    /// The largest ulp error of `f` against the f64 reference `want` over every `step`-th
    /// f32 bit pattern from `from` to `to` (positive), with the worst input.
    fn worst_ulps(
        from: f32,
        to: f32,
        step: usize,
        f: impl Fn(f32) -> f32,
        want: impl Fn(f64) -> f64,
        sign: f32,
    ) -> (u64, f32, usize) {
        let (mut worst, mut at, mut count) = (0u64, 0.0f32, 0usize);
        for bits in (from.to_bits()..to.to_bits()).step_by(step) {
            let x = sign * f32::from_bits(bits);
            let (got, w) = (f(x), want(x as f64) as f32);
            let u = ulps(got, w);
            if u > worst {
                (worst, at) = (u, x);
            }
            count += 1;
        }
        (worst, at, count)
    }

    #[test]
    fn tanh_f32_is_within_one_ulp_over_a_dense_sweep() {
        // Every 31st f32 from the smallest subnormal to 20 (tanh is ±1 in f32 beyond), both signs.
        for sign in [1.0, -1.0] {
            let (worst, at, count) =
                worst_ulps(f32::from_bits(1), 20.0, 31, tanh_f32, f64::tanh, sign);
            assert!(count > 30_000_000, "{count}");
            eprintln!("tanh_f32: max {worst} ulp (at x = {at}) over {count} inputs");
            assert!(worst <= 1, "max error {worst} ulp at x = {at}");
        }
    }

    #[test]
    fn tanh_f32_edges() {
        assert!(tanh_f32(f32::NAN).is_nan());
        assert_eq!(tanh_f32(f32::INFINITY), 1.0);
        assert_eq!(tanh_f32(f32::NEG_INFINITY), -1.0);
        assert_eq!(tanh_f32(100.0), 1.0);
        assert_eq!(tanh_f32(0.0).to_bits(), 0.0f32.to_bits());
        assert_eq!(tanh_f32(-0.0).to_bits(), (-0.0f32).to_bits());
    }

    #[test]
    fn ln_f32_is_within_one_ulp_over_every_positive_float() {
        // Every 17th positive finite f32, subnormals included.
        let (worst, at, count) = worst_ulps(f32::from_bits(1), f32::MAX, 17, ln_f32, f64::ln, 1.0);
        assert!(count > 100_000_000, "{count}");
        eprintln!("ln_f32: max {worst} ulp (at x = {at}) over {count} inputs");
        assert!(worst <= 1, "max error {worst} ulp at x = {at}");
    }

    #[test]
    fn ln_f32_edges() {
        assert!(ln_f32(f32::NAN).is_nan());
        assert!(ln_f32(-1.0).is_nan());
        assert!(ln_f32(f32::NEG_INFINITY).is_nan());
        assert_eq!(ln_f32(0.0), f32::NEG_INFINITY);
        assert_eq!(ln_f32(-0.0), f32::NEG_INFINITY);
        assert_eq!(ln_f32(f32::INFINITY), f32::INFINITY);
        assert_eq!(ln_f32(1.0), 0.0);
        assert_eq!(
            ln_f32(f32::from_bits(1)),
            (f32::from_bits(1) as f64).ln() as f32
        );
    }

    /// exp, tanh and ln of each element, side by side.
    #[inline(always)]
    fn all_three(xs: &[f32]) -> Vec<[f32; 3]> {
        xs.iter()
            .map(|&x| [exp_f32(x), tanh_f32(x), ln_f32(x)])
            .collect()
    }
    simd_fn!(fn all_three_v[](xs: &[f32]) -> Vec<[f32; 3]> = all_three;);

    #[test]
    fn every_path_gives_the_same_bits() {
        let xs: Vec<f32> = (0..4096).map(|i| (i as f32 - 2048.0) * 0.037).collect();
        let plain: Vec<u32> = all_three(&xs)
            .iter()
            .flatten()
            .map(|v| v.to_bits())
            .collect();
        let simd: Vec<u32> = all_three_v(&xs)
            .iter()
            .flatten()
            .map(|v| v.to_bits())
            .collect();
        assert_eq!(plain, simd);
    }
}
