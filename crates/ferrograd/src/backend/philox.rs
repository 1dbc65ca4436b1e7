//! Philox 4x32-10, the counter-based generator behind dropout masks (Salmon et al., "Parallel
//! random numbers: as easy as 1, 2, 3", SC 2011; the generator cuRAND and PyTorch's CUDA
//! dropout use). Element i of a mask made with key k draws word i mod 4 of
//! philox(counter = i / 4, key = k), so any element can be computed on its own, in any order,
//! on any device: the CPU and the CUDA kernel (kernels/elementwise.cu) give the same mask for
//! the same key, and recomputation replays a mask from its key alone.

const M0: u32 = 0xD251_1F53;
const M1: u32 = 0xCD9E_8D57;
const W0: u32 = 0x9E37_79B9;
const W1: u32 = 0xBB67_AE85;

/// The four 32-bit words for `counter` under `key`.
pub fn philox4x32_10(counter: u64, key: u64) -> [u32; 4] {
    let mut c = [counter as u32, (counter >> 32) as u32, 0, 0];
    let mut k = [key as u32, (key >> 32) as u32];
    for round in 0..10 {
        if round > 0 {
            k[0] = k[0].wrapping_add(W0);
            k[1] = k[1].wrapping_add(W1);
        }
        let p0 = u64::from(M0) * u64::from(c[0]);
        let p1 = u64::from(M1) * u64::from(c[2]);
        c = [
            ((p1 >> 32) as u32) ^ c[1] ^ k[0],
            p1 as u32,
            ((p0 >> 32) as u32) ^ c[3] ^ k[1],
            p0 as u32,
        ];
    }
    c
}

/// A word's uniform draw in [0, 1) with 24 random bits (exact in f32 and f64).
pub fn to_uniform(word: u32) -> f64 {
    f64::from(word >> 8) * (1.0 / 16_777_216.0)
}

/// The draws of elements 4g .. 4g + 3 (one Philox call).
pub fn uniforms4(key: u64, g: u64) -> [f64; 4] {
    philox4x32_10(g, key).map(to_uniform)
}

/// Element `i`'s uniform draw in [0, 1).
pub fn uniform(key: u64, i: u64) -> f64 {
    uniforms4(key, i / 4)[(i % 4) as usize]
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The known-answer vectors of the Random123 distribution (kat_vectors, philox4x32 10):
    /// counter and key all zero, and all ones. Here the counter's upper 64 bits are zero, so
    /// only vectors with such counters apply.
    #[test]
    fn known_answers() {
        assert_eq!(
            philox4x32_10(0, 0),
            [0x6627_e8d5, 0xe169_c58d, 0xbc57_ac4c, 0x9b00_dbd8]
        );
    }

    #[test]
    fn draws_are_uniform_and_differ_by_key() {
        let n = 100_000;
        let mean = (0..n).map(|i| uniform(7, i)).sum::<f64>() / n as f64;
        assert!((mean - 0.5).abs() < 0.005, "{mean}");
        assert!((0..n).all(|i| (0.0..1.0).contains(&uniform(7, i))));
        let same = (0..1000)
            .filter(|&i| uniform(7, i) == uniform(8, i))
            .count();
        assert!(same < 5, "{same}");
    }
}
