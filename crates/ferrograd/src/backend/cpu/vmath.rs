//! Vector-friendly math for the CPU kernels: branch-free scalar functions that the compiler
//! turns into SIMD loops, and `simd_fn!`, which compiles a kernel's loop for the widest
//! instruction set the machine has (AVX-512 or AVX2 with FMA, picked at run time; the baseline
//! x86-64 build otherwise only has SSE2).
//!
//! `exp_f32` is Cephes' `expf` (range reduction by ln 2 in two parts, a degree-6 polynomial,
//! scaling by 2ⁿ through the exponent bits). Plain multiplies and adds, never fused, so every
//! instruction set gives the same bits. Its error over every 61st f32 in [-104, 89] is at most
//! 1 ulp for normal results (tests below), against the correctly rounded exp.

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

/// Defines `$name`, which calls the `#[inline(always)]` function `$inner` compiled for AVX-512
/// or AVX2 + FMA where the machine has them (checked at run time; the baseline x86-64 build
/// has only SSE2), so the loops inlined from `$inner` are vectorised for that width. Every
/// path gives the same bits: the kernels use no fused multiply-add.
macro_rules! simd_fn {
    ($vis:vis fn $name:ident[$($gen:tt)*]($($a:ident: $t:ty),* $(,)?) $(-> $r:ty)? = $inner:path;) => {
        $vis fn $name<$($gen)*>($($a: $t),*) $(-> $r)? {
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx512f,avx2,fma")]
                fn v4<$($gen)*>($($a: $t),*) $(-> $r)? {
                    $inner($($a),*)
                }
                #[target_feature(enable = "avx2,fma")]
                fn v3<$($gen)*>($($a: $t),*) $(-> $r)? {
                    $inner($($a),*)
                }
                if std::arch::is_x86_feature_detected!("avx512f") {
                    // SAFETY: the features were detected on this machine.
                    return unsafe { v4($($a),*) };
                }
                if std::arch::is_x86_feature_detected!("avx2")
                    && std::arch::is_x86_feature_detected!("fma")
                {
                    // SAFETY: as above.
                    return unsafe { v3($($a),*) };
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

    #[inline(always)]
    fn exp_all(xs: &[f32]) -> Vec<f32> {
        xs.iter().map(|&x| exp_f32(x)).collect()
    }
    simd_fn!(fn exp_all_v[](xs: &[f32]) -> Vec<f32> = exp_all;);

    #[test]
    fn every_path_gives_the_same_bits() {
        let xs: Vec<f32> = (0..4096).map(|i| (i as f32 - 2048.0) * 0.037).collect();
        let plain: Vec<f32> = xs.iter().map(|&x| exp_f32(x)).collect();
        assert_eq!(plain, exp_all_v(&xs));
    }
}
