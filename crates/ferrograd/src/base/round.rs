//! f64 → f16 / bf16 rounded to nearest even, once. `half`'s `from_f64` conversions read only
//! the top 32 bits of the f64, so a value just above a tie (low bits the top word drops) can
//! round down: f32 bits 0xBB448002 became bf16 0xBB44 instead of 0xBB45. Rounding to f32 with
//! round-to-odd first keeps that information in the last mantissa bit, which makes the
//! second rounding (f32 → half, correct in `half`) the single correct one.

use half::{bf16, f16};

/// `v` as f32, rounded to odd: exact values unchanged; inexact ones truncated toward zero
/// with the last mantissa bit set. Infinities, NaN and overflow pass through `as f32`.
fn f32_round_to_odd(v: f64) -> f32 {
    let f = v as f32;
    if !f.is_finite() || f as f64 == v {
        return f;
    }
    let mut bits = f.to_bits();
    if (f as f64).abs() > v.abs() {
        // Rounded away from zero: one step back toward it (the magnitude's bits).
        bits -= 1;
    }
    f32::from_bits(bits | 1)
}

/// `v` as bf16, correctly rounded (nearest, ties to even).
pub fn bf16_of(v: f64) -> bf16 {
    bf16::from_f32(f32_round_to_odd(v))
}

/// `v` as f16, correctly rounded (nearest, ties to even).
pub fn f16_of(v: f64) -> f16 {
    f16::from_f32(f32_round_to_odd(v))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_value_just_above_a_tie_rounds_up() {
        let x = f32::from_bits(0xBB44_8002);
        assert_eq!(bf16_of(x as f64).to_bits(), 0xBB45);
        assert_eq!(bf16::from_f32(x).to_bits(), 0xBB45);
        // The exact tie goes to even, both ways.
        assert_eq!(
            bf16_of(f32::from_bits(0xBB44_8000) as f64).to_bits(),
            0xBB44
        );
        assert_eq!(
            bf16_of(f32::from_bits(0xBB45_8000) as f64).to_bits(),
            0xBB46
        );
    }

    #[test]
    fn f64_values_round_once() {
        // 1 + 2^-8 is a bf16 tie; a hair above it must round up, below it down, even where
        // the hair is far below f32's precision.
        let tie = 1.0 + 2f64.powi(-8);
        assert_eq!(bf16_of(tie).to_f64(), 1.0);
        assert_eq!(bf16_of(tie + 2f64.powi(-40)).to_f64(), 1.0 + 2f64.powi(-7));
        assert_eq!(bf16_of(tie - 2f64.powi(-40)).to_f64(), 1.0);
        // f16: 1 + 2^-11 is a tie.
        let tie = 1.0 + 2f64.powi(-11);
        assert_eq!(f16_of(tie).to_f64(), 1.0);
        assert_eq!(f16_of(tie + 2f64.powi(-45)).to_f64(), 1.0 + 2f64.powi(-10));
        assert_eq!(
            f16_of(-tie - 2f64.powi(-45)).to_f64(),
            -1.0 - 2f64.powi(-10)
        );
    }

    #[test]
    fn every_f32_pattern_of_a_range_matches_half_from_f32() {
        // f32 → f64 is exact, so the f64 path must agree with half's f32 conversions.
        for hi in [0x3F80u32, 0xBB44, 0x0001, 0x7F7F, 0x0080] {
            for lo in (0..=0xFFFFu32).step_by(7) {
                let x = f32::from_bits((hi << 16) | lo);
                assert_eq!(bf16_of(x as f64), bf16::from_f32(x), "{:08x}", x.to_bits());
                assert_eq!(f16_of(x as f64).to_bits(), f16::from_f32(x).to_bits());
            }
        }
        for v in [
            0.0f64,
            -0.0,
            f64::INFINITY,
            f64::NEG_INFINITY,
            1e300,
            -1e300,
            1e-300,
        ] {
            assert_eq!(
                bf16_of(v).to_f64(),
                bf16::from_f32(v as f32).to_f64(),
                "{v}"
            );
        }
        assert!(bf16_of(f64::NAN).is_nan() && f16_of(f64::NAN).is_nan());
    }
}
