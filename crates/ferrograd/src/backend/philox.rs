//! Philox 4x32-10, the counter-based generator behind dropout masks (Salmon et al., "Parallel
//! random numbers: as easy as 1, 2, 3", SC 2011; the generator cuRAND and PyTorch's CUDA
//! dropout use). One call gives 128 bits: eight 16-bit draws. Element i of a mask made with key
//! k draws half i mod 2 (the low half first) of word (i / 2) mod 4 of philox(counter = i / 8,
//! key = k), so any element can be computed on its own, in any order, on any device: the CPU,
//! the CUDA dropout kernel (kernels/elementwise.cu) and the attention kernels give the same
//! mask for the same key, and recomputation replays a mask from its key alone. Sixteen bits a
//! draw put the keep probability on a grid of 2⁻¹⁶ (FlashAttention's dropout uses 8) and make
//! one call serve eight elements: the generator is most of the work where a kernel draws a mask
//! for every attention probability.

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

/// Draws per Philox call.
pub const DRAWS_PER_CALL: u64 = 8;

/// The 16-bit draw of element `i` from its call's words (`philox4x32_10(i / 8, key)`).
pub fn draw16(words: &[u32; 4], i: u64) -> u32 {
    (words[((i >> 1) & 3) as usize] >> (16 * (i & 1))) & 0xffff
}

/// A 16-bit draw as a uniform value in [0, 1) (exact in f32 and f64).
pub fn to_uniform(draw: u32) -> f64 {
    f64::from(draw) * (1.0 / 65_536.0)
}

/// The draws of elements 8g .. 8g + 7 (one Philox call).
pub fn uniforms8(key: u64, g: u64) -> [f64; 8] {
    let w = philox4x32_10(g, key);
    std::array::from_fn(|e| to_uniform(draw16(&w, e as u64)))
}

/// Element `i`'s uniform draw in [0, 1).
pub fn uniform(key: u64, i: u64) -> f64 {
    uniforms8(key, i / DRAWS_PER_CALL)[(i % DRAWS_PER_CALL) as usize]
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

    /// Element i's draw is half i % 2 of word (i / 2) % 4 of call i / 8: the layout the CUDA
    /// kernels index by hand.
    #[test]
    fn draws_follow_the_documented_layout() {
        let w = philox4x32_10(3, 11);
        for e in 0..8u64 {
            let word = w[(e / 2) as usize];
            let half = if e % 2 == 0 {
                word & 0xffff
            } else {
                word >> 16
            };
            assert_eq!(uniform(11, 24 + e), f64::from(half) / 65_536.0);
        }
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
