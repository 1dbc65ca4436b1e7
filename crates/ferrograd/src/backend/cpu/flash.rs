//! Attention of one (batch, head) as FlashAttention computes it, on the CPU: online softmax
//! over key tiles (a running max and sum per query, the partial output rescaled when the max
//! grows), only each query's log-sum-exp kept for backward, which recomputes the
//! probabilities tile by tile. Causal attention never visits a key after its query.
//!
//! Operands come as contiguous per-head buffers in the computing type (f32, or f64 for f64
//! tensors): q, k, v (T, D) and kᵀ, vᵀ (D, T), so that every inner loop runs over consecutive
//! elements and vectorises (`simd_fn!`) without reordering a sum; exp is the vectorisable
//! `exp_f32` at f32.

use super::data::Elem;
use super::vmath::simd_fn;

/// Keys per tile: one tile's scores stay in L1 (64 × 4 bytes).
const TILE: usize = 64;

/// The shape of one head's problem.
#[derive(Clone, Copy, Debug)]
pub(crate) struct HeadDims {
    /// Sequence length T (queries and keys).
    pub t: usize,
    /// Head width D.
    pub d: usize,
    /// The scores' scale, usually 1/√D.
    pub scale: f64,
    /// Query i sees keys 0..=i only.
    pub causal: bool,
}

impl HeadDims {
    /// The keys query i sees.
    #[inline(always)]
    fn keys(&self, i: usize) -> usize {
        if self.causal { i + 1 } else { self.t }
    }
}

/// One (batch, head)'s q, k, v, each (T, D), plus kᵀ and vᵀ (D, T).
pub(crate) struct Head<A> {
    q: Vec<A>,
    k: Vec<A>,
    v: Vec<A>,
    kt: Vec<A>,
    vt: Vec<A>,
}

impl<A: Elem> Head<A> {
    /// Copies the head in: `at(i, c)` gives q[i, c], k[i, c], v[i, c].
    pub(crate) fn load(dims: HeadDims, at: impl Fn(usize, usize) -> [A; 3]) -> Head<A> {
        let (t, d) = (dims.t, dims.d);
        let mut h = Head {
            q: Vec::with_capacity(t * d),
            k: Vec::with_capacity(t * d),
            v: Vec::with_capacity(t * d),
            kt: vec![A::zero(); t * d],
            vt: vec![A::zero(); t * d],
        };
        for i in 0..t {
            for c in 0..d {
                let [q, k, v] = at(i, c);
                h.q.push(q);
                h.k.push(k);
                h.v.push(v);
                h.kt[c * t + i] = k;
                h.vt[c * t + i] = v;
            }
        }
        h
    }
}

/// s[j] = scale · (x · y_{j0+j}) for j < s.len(), over yᵀ (D, T): the loop over j is the
/// inner one, so it vectorises without reordering a sum.
#[inline(always)]
fn dots<A: Elem>(x: &[A], yt: &[A], t: usize, j0: usize, scale: A, s: &mut [A]) {
    s.fill(A::zero());
    for (c, &xc) in x.iter().enumerate() {
        let row = &yt[c * t + j0..c * t + j0 + s.len()];
        s.iter_mut()
            .zip(row)
            .for_each(|(sj, &y)| *sj = *sj + xc * y);
    }
    s.iter_mut().for_each(|sj| *sj = *sj * scale);
}

/// acc += c · x
#[inline(always)]
fn axpy<A: Elem>(acc: &mut [A], c: A, x: &[A]) {
    acc.iter_mut().zip(x).for_each(|(a, &v)| *a = *a + c * v);
}

/// Forward: o (T, D) = softmax(scale · q kᵀ, causal) v, and lse (T), each query's
/// log Σ exp(scores). Both are overwritten.
#[inline(always)]
fn forward_loops<A: Elem>(h: &Head<A>, dims: HeadDims, o: &mut [A], lse: &mut [A]) {
    let (t, d, scale) = (dims.t, dims.d, A::from_f64(dims.scale));
    let mut tile = [A::zero(); TILE];
    for i in 0..t {
        let (qi, oi) = (&h.q[i * d..(i + 1) * d], &mut o[i * d..(i + 1) * d]);
        oi.fill(A::zero());
        let (mut m, mut l) = (A::neg_infinity(), A::zero());
        let n_keys = dims.keys(i);
        for j0 in (0..n_keys).step_by(TILE) {
            let s = &mut tile[..TILE.min(n_keys - j0)];
            dots(qi, &h.kt, t, j0, scale, s);
            let m_new = s.iter().fold(m, |a, &b| a.max(b));
            // First tile: m = −inf and alpha = 0, which rescales the zeros there are.
            let alpha = (m - m_new).exp_v();
            s.iter_mut().for_each(|x| *x = (*x - m_new).exp_v());
            l = l * alpha + s.iter().fold(A::zero(), |a, &b| a + b);
            oi.iter_mut().for_each(|x| *x = *x * alpha);
            for (j, &p) in s.iter().enumerate() {
                axpy(oi, p, &h.v[(j0 + j) * d..(j0 + j + 1) * d]);
            }
            m = m_new;
        }
        let inv = A::one() / l;
        oi.iter_mut().for_each(|x| *x = *x * inv);
        lse[i] = m + l.ln_v();
    }
}

/// The gradients' destinations, each (T, D), overwritten.
pub(crate) struct HeadGrads<'a, A> {
    pub dq: &'a mut [A],
    pub dk: &'a mut [A],
    pub dv: &'a mut [A],
}

/// Backward from the output o, its gradient go (T, D) and the saved lse (T): per tile,
/// p = exp(s − lse), dp = go vᵀ, ds = p (dp − rowsum(go ∘ o)); then dq += scale·ds k,
/// dk += scale·dsᵀ q, dv += pᵀ go.
#[inline(always)]
fn backward_loops<A: Elem>(
    h: &Head<A>,
    dims: HeadDims,
    (o, go, lse): (&[A], &[A], &[A]),
    g: HeadGrads<A>,
) {
    let (t, d, scale) = (dims.t, dims.d, A::from_f64(dims.scale));
    g.dq.fill(A::zero());
    g.dk.fill(A::zero());
    g.dv.fill(A::zero());
    let (mut p_tile, mut ds_tile) = ([A::zero(); TILE], [A::zero(); TILE]);
    for (i, &lse_i) in lse.iter().enumerate().take(t) {
        let row = i * d..(i + 1) * d;
        let (qi, goi) = (&h.q[row.clone()], &go[row.clone()]);
        let delta = goi
            .iter()
            .zip(&o[row.clone()])
            .fold(A::zero(), |a, (&x, &y)| a + x * y);
        let n_keys = dims.keys(i);
        for j0 in (0..n_keys).step_by(TILE) {
            let n = TILE.min(n_keys - j0);
            let (p, ds) = (&mut p_tile[..n], &mut ds_tile[..n]);
            dots(qi, &h.kt, t, j0, scale, p);
            p.iter_mut().for_each(|x| *x = (*x - lse_i).exp_v());
            // ds first holds dp = go_i · v_j.
            dots(goi, &h.vt, t, j0, A::one(), ds);
            ds.iter_mut()
                .zip(p.iter())
                .for_each(|(x, &pj)| *x = pj * (*x - delta) * scale);
            for j in 0..n {
                let kr = (j0 + j) * d..(j0 + j + 1) * d;
                axpy(&mut g.dq[row.clone()], ds[j], &h.k[kr.clone()]);
                axpy(&mut g.dk[kr.clone()], ds[j], qi);
                axpy(&mut g.dv[kr], p[j], goi);
            }
        }
    }
}

simd_fn!(pub(crate) fn forward[A: Elem](h: &Head<A>, dims: HeadDims, o: &mut [A], lse: &mut [A]) = forward_loops;);
simd_fn!(pub(crate) fn backward[A: Elem](h: &Head<A>, dims: HeadDims, saved: (&[A], &[A], &[A]), g: HeadGrads<A>) = backward_loops;);

#[cfg(test)]
mod tests {
    use super::*;

    /// Deterministic values in [-2, 2).
    fn values(n: usize, seed: u64) -> Vec<f64> {
        let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                (s >> 11) as f64 / (1u64 << 53) as f64 * 4.0 - 2.0
            })
            .collect()
    }

    /// Attention spelled out in f64: the full score matrix, masked, softmax, product; and
    /// its backward. Returns (o, lse, dq, dk, dv).
    #[allow(clippy::type_complexity)]
    fn naive(
        dims: HeadDims,
        q: &[f64],
        k: &[f64],
        v: &[f64],
        go: &[f64],
    ) -> (Vec<f64>, Vec<f64>, Vec<f64>, Vec<f64>, Vec<f64>) {
        let (t, d) = (dims.t, dims.d);
        let mut p = vec![0.0; t * t];
        let mut lse = vec![0.0; t];
        for i in 0..t {
            let n = dims.keys(i);
            let s: Vec<f64> = (0..n)
                .map(|j| dims.scale * (0..d).map(|c| q[i * d + c] * k[j * d + c]).sum::<f64>())
                .collect();
            let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let sum: f64 = s.iter().map(|x| (x - m).exp()).sum();
            lse[i] = m + sum.ln();
            for j in 0..n {
                p[i * t + j] = (s[j] - lse[i]).exp();
            }
        }
        let mm = |a: &[f64], b: &[f64], n: usize, kk: usize, m: usize, ta: bool| {
            // (n, kk) @ (kk, m), a read transposed when ta.
            let mut out = vec![0.0; n * m];
            for r in 0..n {
                for c in 0..m {
                    out[r * m + c] = (0..kk)
                        .map(|x| {
                            let av = if ta { a[x * n + r] } else { a[r * kk + x] };
                            av * b[x * m + c]
                        })
                        .sum();
                }
            }
            out
        };
        let o = mm(&p, v, t, t, d, false);
        let dv = mm(&p, go, t, t, d, true);
        // dp = go vᵀ, ds = p (dp − rowsum(go ∘ o)) · scale
        let mut ds = vec![0.0; t * t];
        for i in 0..t {
            let delta: f64 = (0..d).map(|c| go[i * d + c] * o[i * d + c]).sum();
            for j in 0..t {
                let dp: f64 = (0..d).map(|c| go[i * d + c] * v[j * d + c]).sum();
                ds[i * t + j] = p[i * t + j] * (dp - delta) * dims.scale;
            }
        }
        let dq = mm(&ds, k, t, t, d, false);
        let dk = mm(&ds, q, t, t, d, true);
        (o, lse, dq, dk, dv)
    }

    fn check<A: Elem>(dims: HeadDims, tol: f64) {
        let n = dims.t * dims.d;
        let (q, k, v, go) = (values(n, 1), values(n, 2), values(n, 3), values(n, 4));
        let a = |x: &[f64]| x.iter().map(|&e| A::from_f64(e)).collect::<Vec<A>>();
        let (qa, ka, va, goa) = (a(&q), a(&k), a(&v), a(&go));
        let h = Head::load(dims, |i, c| {
            let at = i * dims.d + c;
            [qa[at], ka[at], va[at]]
        });
        let (mut o, mut lse) = (vec![A::zero(); n], vec![A::zero(); dims.t]);
        forward(&h, dims, &mut o, &mut lse);
        let (mut dq, mut dk, mut dv) = (vec![A::zero(); n], vec![A::zero(); n], vec![A::zero(); n]);
        let g = HeadGrads {
            dq: &mut dq,
            dk: &mut dk,
            dv: &mut dv,
        };
        backward(&h, dims, (&o, &goa, &lse), g);
        let want = naive(dims, &q, &k, &v, &go);
        let got = [&o, &lse, &dq, &dk, &dv];
        let wants = [&want.0, &want.1, &want.2, &want.3, &want.4];
        for (name, (g, w)) in ["o", "lse", "dq", "dk", "dv"]
            .iter()
            .zip(got.iter().zip(wants))
        {
            let err = g
                .iter()
                .zip(w.iter())
                .map(|(&x, &y)| (x.to_f64() - y).abs() / (1.0 + y.abs()))
                .fold(0.0, f64::max);
            assert!(err < tol, "{name}: error {err} for {dims:?}");
        }
    }

    fn dims(t: usize, d: usize, causal: bool) -> HeadDims {
        HeadDims {
            t,
            d,
            scale: 1.0 / (d as f64).sqrt(),
            causal,
        }
    }

    #[test]
    fn matches_the_spelled_out_attention_in_f64() {
        // T = 150 spans three key tiles, the last one partial; T = 64 is the main job's.
        for (t, d) in [(1, 4), (7, 3), (64, 32), (150, 16)] {
            for causal in [true, false] {
                check::<f64>(dims(t, d, causal), 1e-12);
            }
        }
    }

    #[test]
    fn matches_the_spelled_out_attention_in_f32() {
        for (t, d) in [(5, 8), (64, 32), (130, 16)] {
            for causal in [true, false] {
                check::<f32>(dims(t, d, causal), 1e-5);
            }
        }
    }

    #[test]
    fn a_large_score_after_the_first_tile_rescales_the_earlier_ones() {
        // Key 100 (second tile) is aligned with every query: its weight dominates, which the
        // online softmax only gets right by rescaling the first tile's partial sums.
        let d = dims(128, 4, false);
        let h = Head::load(d, |i, c| {
            let big = if i == 100 { 30.0 } else { 0.0 };
            [1.0f64, big + 0.01 * c as f64, i as f64]
        });
        let (mut o, mut lse) = (vec![0.0; 128 * 4], vec![0.0; 128]);
        forward(&h, d, &mut o, &mut lse);
        // Every query: o ≈ v[100] = 100 (the other keys' weights are e^-30 each).
        assert!(o.iter().all(|&x| (x - 100.0).abs() < 1e-8), "{:?}", &o[..4]);
    }
}
