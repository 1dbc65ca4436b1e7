//! Attention of one (batch, head) as FlashAttention computes it, on the CPU: online softmax
//! over key tiles (a running max and sum per query, the partial output rescaled when the max
//! grows), only each query's log-sum-exp kept for backward, which recomputes the
//! probabilities tile by tile. Causal attention never visits a key after its query.
//!
//! Operands come as contiguous per-head buffers in the computing type (f32, or f64 for f64
//! tensors): q, k, v (T, D) and kᵀ, vᵀ (D, T), padded to whole register blocks, so that the
//! scores of R queries against J keys stay in registers and every inner loop runs over
//! consecutive elements and vectorises (`simd_fn!`) without reordering a sum; exp is the
//! vectorisable `exp_f32` at f32.

use super::data::Elem;
use super::vmath::{lane_fold, simd_fn};

/// Keys per tile: one tile's scores for a block of queries stay in L1.
const TILE: usize = 64;
/// Queries computed together: each key row loaded serves R of them.
const R: usize = 4;
/// Keys per register block of scores (R × J accumulators).
const J: usize = 16;
// The dk, dv accumulation below is written out for four queries.
const _: () = assert!(R == 4 && TILE.is_multiple_of(J));

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
        if self.causal {
            (i + 1).min(self.t)
        } else {
            self.t
        }
    }
    /// Rows of the query-side buffers: T rounded up to a whole block of R queries.
    fn query_rows(&self) -> usize {
        self.t.div_ceil(R) * R
    }
    /// Row stride of kᵀ and vᵀ: T rounded up to whole register blocks of J keys.
    fn key_stride(&self) -> usize {
        self.t.div_ceil(J) * J
    }
}

/// One (batch, head)'s q (T', D) with T' = T rounded up to R rows (zero rows after T),
/// k, v (T, D), and kᵀ, vᵀ (D, T'') with T'' = T rounded up to J (zero columns after T).
pub(crate) struct Head<A> {
    q: Vec<A>,
    k: Vec<A>,
    v: Vec<A>,
    kt: Vec<A>,
    vt: Vec<A>,
}

impl<A: Elem> Head<A> {
    /// Takes q, k, v as contiguous (T, D) rows.
    pub(crate) fn new(dims: HeadDims, mut q: Vec<A>, k: Vec<A>, v: Vec<A>) -> Head<A> {
        q.resize(dims.query_rows() * dims.d, A::zero());
        let (kt, vt) = (transpose(&k, dims), transpose(&v, dims));
        Head { q, k, v, kt, vt }
    }
}

/// x (T, D) → xᵀ (D, key_stride), zero padded.
fn transpose<A: Elem>(x: &[A], dims: HeadDims) -> Vec<A> {
    let (t, d, ts) = (dims.t, dims.d, dims.key_stride());
    let mut out = vec![A::zero(); d * ts];
    for (i, row) in x.chunks_exact(d).take(t).enumerate() {
        for (c, &e) in row.iter().enumerate() {
            out[c * ts + i] = e;
        }
    }
    out
}

/// rows (R, D) of x starting at row i0 (x padded to whole blocks of R rows).
#[inline(always)]
fn block<A>(x: &[A], i0: usize, d: usize) -> [&[A]; R] {
    std::array::from_fn(|r| &x[(i0 + r) * d..(i0 + r + 1) * d])
}

/// s[r][j] = scale · (x_r · y_{j0+j}) for j < n, over yᵀ (D, stride ts): R queries against
/// J keys at a time, in registers. Columns n..round_up(n, J) get values from zero padding or
/// later keys; callers mask them.
#[inline(always)]
fn scores<A: Elem>(
    x: [&[A]; R],
    yt: &[A],
    ts: usize,
    j0: usize,
    n: usize,
    scale: A,
    s: &mut [[A; TILE]; R],
) {
    for jb in (0..n).step_by(J) {
        let mut acc = [[A::zero(); J]; R];
        for c in 0..x[0].len() {
            let y: &[A; J] = yt[c * ts + j0 + jb..c * ts + j0 + jb + J]
                .try_into()
                .expect("kᵀ rows are padded to whole register blocks");
            for r in 0..R {
                let xr = x[r][c];
                for jj in 0..J {
                    acc[r][jj] = acc[r][jj] + xr * y[jj];
                }
            }
        }
        for r in 0..R {
            for jj in 0..J.min(TILE - jb) {
                s[r][jb + jj] = acc[r][jj] * scale;
            }
        }
    }
}

/// x · y over the lane reduction's partial sums.
#[inline(always)]
fn dot<A: Elem>(x: &[A], y: &[A]) -> A {
    let y = &y[..x.len()];
    lane_fold(x.len(), A::zero(), |j| x[j] * y[j], |a, b| a + b)
}

/// Columns of the register block in `weighted_rows`: one 256-bit vector of f32.
const C: usize = 8;

/// acc_r (D) += Σ_{j<n} w[r][j] · x_{j0+j} for the R rows of acc (R, D), over x (T, D): a
/// tile of probabilities times v, or of score gradients times k. Each block of C columns of
/// the R rows is summed in registers over the n keys, then added to acc once.
#[inline(always)]
fn weighted_rows<A: Elem>(acc: &mut [A], w: &[[A; TILE]; R], x: &[A], j0: usize, n: usize) {
    let d = acc.len() / R;
    let whole = d / C * C;
    for c0 in (0..whole).step_by(C) {
        let mut reg = [[A::zero(); C]; R];
        for j in 0..n {
            let xj: &[A; C] = x[(j0 + j) * d + c0..(j0 + j) * d + c0 + C]
                .try_into()
                .expect("a block of C columns");
            for r in 0..R {
                let wj = w[r][j];
                for c in 0..C {
                    reg[r][c] = reg[r][c] + wj * xj[c];
                }
            }
        }
        for (r, row) in reg.iter().enumerate() {
            for (a, &v) in acc[r * d + c0..r * d + c0 + C].iter_mut().zip(row) {
                *a = *a + v;
            }
        }
    }
    for c in whole..d {
        for r in 0..R {
            let sum = (0..n).fold(A::zero(), |s, j| s + w[r][j] * x[(j0 + j) * d + c]);
            acc[r * d + c] = acc[r * d + c] + sum;
        }
    }
}

/// How many of the n keys of the tile starting at key j0 query i sees (a prefix of them).
#[inline(always)]
fn visible(dims: HeadDims, i: usize, j0: usize, n: usize) -> usize {
    if dims.causal {
        (i + 1).saturating_sub(j0).min(n)
    } else {
        n
    }
}

/// Forward: o (T, D) = softmax(scale · q kᵀ, causal) v, and lse (T), each query's
/// log Σ exp(scores). Both are overwritten.
// j indexes the scores of R rows and the rows of v together.
#[allow(clippy::needless_range_loop)]
#[inline(always)]
fn forward_loops<A: Elem>(h: &Head<A>, dims: HeadDims, o: &mut [A], lse: &mut [A]) {
    let (t, d, ts, scale) = (dims.t, dims.d, dims.key_stride(), A::from_f64(dims.scale));
    let mut s = [[A::zero(); TILE]; R];
    let mut acc = vec![A::zero(); R * d];
    for i0 in (0..t).step_by(R) {
        let q = block(&h.q, i0, d);
        acc.fill(A::zero());
        let (mut m, mut l) = ([A::neg_infinity(); R], [A::zero(); R]);
        let n_keys = dims.keys(i0 + R - 1);
        for j0 in (0..n_keys).step_by(TILE) {
            let n = TILE.min(n_keys - j0);
            scores(q, &h.kt, ts, j0, n, scale, &mut s);
            for r in 0..R {
                let sr = &mut s[r][..n];
                sr[visible(dims, i0 + r, j0, n)..].fill(A::neg_infinity());
                let m_new = m[r].max(lane_fold(sr.len(), A::neg_infinity(), |j| sr[j], A::max));
                // A row that sees nothing yet keeps m = −inf; its exps stay 0 (no NaN).
                let shift = if m_new == A::neg_infinity() {
                    A::zero()
                } else {
                    m_new
                };
                let alpha = (m[r] - shift).exp_v();
                sr.iter_mut().for_each(|x| *x = (*x - shift).exp_v());
                l[r] = l[r] * alpha + lane_fold(sr.len(), A::zero(), |j| sr[j], |a, b| a + b);
                acc[r * d..(r + 1) * d]
                    .iter_mut()
                    .for_each(|x| *x = *x * alpha);
                m[r] = m_new;
            }
            weighted_rows(&mut acc, &s, &h.v, j0, n);
        }
        for r in 0..R.min(t - i0) {
            let inv = A::one() / l[r];
            let oi = &mut o[(i0 + r) * d..(i0 + r + 1) * d];
            oi.iter_mut()
                .zip(&acc[r * d..(r + 1) * d])
                .for_each(|(x, &a)| *x = a * inv);
            lse[i0 + r] = m[r] + l[r].ln_v();
        }
    }
}

/// The gradients' destinations, each (T, D), overwritten.
pub(crate) struct HeadGrads<'a, A> {
    pub dq: &'a mut [A],
    pub dk: &'a mut [A],
    pub dv: &'a mut [A],
}

/// What backward reads besides the head: the output o, its gradient go (T, D) and the saved
/// lse (T).
pub(crate) struct Saved<A> {
    pub o: Vec<A>,
    pub go: Vec<A>,
    pub lse: Vec<A>,
}

/// Backward: per block of R queries and tile of keys, p = exp(s − lse), dp = go vᵀ,
/// ds = p (dp − rowsum(go ∘ o)); then dq += scale·ds k, dk += scale·dsᵀ q, dv += pᵀ go.
#[inline(always)]
fn backward_loops<A: Elem>(h: &Head<A>, dims: HeadDims, saved: Saved<A>, g: HeadGrads<A>) {
    let (t, d, ts, scale) = (dims.t, dims.d, dims.key_stride(), A::from_f64(dims.scale));
    g.dk.fill(A::zero());
    g.dv.fill(A::zero());
    let mut go = saved.go;
    go.resize(dims.query_rows() * d, A::zero());
    let mut dq = vec![A::zero(); dims.query_rows() * d];
    let (mut p, mut ds) = ([[A::zero(); TILE]; R], [[A::zero(); TILE]; R]);
    for i0 in (0..t).step_by(R) {
        let rows = R.min(t - i0);
        let (q, gor) = (block(&h.q, i0, d), block(&go, i0, d));
        let mut delta = [A::zero(); R];
        let mut lse = [A::zero(); R];
        for r in 0..rows {
            let at = (i0 + r) * d..(i0 + r + 1) * d;
            delta[r] = dot(&go[at.clone()], &saved.o[at]);
            lse[r] = saved.lse[i0 + r];
        }
        let n_keys = dims.keys(i0 + R - 1);
        for j0 in (0..n_keys).step_by(TILE) {
            let n = TILE.min(n_keys - j0);
            scores(q, &h.kt, ts, j0, n, scale, &mut p);
            // ds first holds dp = go_i · v_j.
            scores(gor, &h.vt, ts, j0, n, A::one(), &mut ds);
            for r in 0..R {
                // Exps of every key, then a select: no branch in the loop, so it vectorises.
                let seen = if r < rows {
                    visible(dims, i0 + r, j0, n)
                } else {
                    0
                };
                for j in 0..n {
                    let e = (p[r][j] - lse[r]).exp_v();
                    let pj = if j < seen { e } else { A::zero() };
                    p[r][j] = pj;
                    ds[r][j] = pj * (ds[r][j] - delta[r]) * scale;
                }
            }
            weighted_rows(&mut dq[i0 * d..(i0 + R) * d], &ds, &h.k, j0, n);
            for j in 0..n {
                let kr = (j0 + j) * d..(j0 + j + 1) * d;
                let (dk, dv) = (&mut g.dk[kr.clone()], &mut g.dv[kr]);
                let dsj: [A; R] = std::array::from_fn(|r| ds[r][j]);
                let pj: [A; R] = std::array::from_fn(|r| p[r][j]);
                for c in 0..d {
                    dk[c] = dk[c]
                        + (dsj[0] * q[0][c]
                            + dsj[1] * q[1][c]
                            + dsj[2] * q[2][c]
                            + dsj[3] * q[3][c]);
                    dv[c] = dv[c]
                        + (pj[0] * gor[0][c]
                            + pj[1] * gor[1][c]
                            + pj[2] * gor[2][c]
                            + pj[3] * gor[3][c]);
                }
            }
        }
    }
    g.dq.copy_from_slice(&dq[..t * d]);
}

simd_fn!(pub(crate) fn forward[A: Elem](h: &Head<A>, dims: HeadDims, o: &mut [A], lse: &mut [A]) = forward_loops;);
simd_fn!(pub(crate) fn backward[A: Elem](h: &Head<A>, dims: HeadDims, saved: Saved<A>, g: HeadGrads<A>) = backward_loops;);

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
        let h = Head::new(dims, qa, ka, va);
        let (mut o, mut lse) = (vec![A::zero(); n], vec![A::zero(); dims.t]);
        forward(&h, dims, &mut o, &mut lse);
        let (mut dq, mut dk, mut dv) = (vec![A::zero(); n], vec![A::zero(); n], vec![A::zero(); n]);
        let g = HeadGrads {
            dq: &mut dq,
            dk: &mut dk,
            dv: &mut dv,
        };
        let saved = Saved {
            o: o.clone(),
            go: goa,
            lse: lse.clone(),
        };
        backward(&h, dims, saved, g);
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
        let (n, w) = (128, 4);
        let q = vec![1.0f64; n * w];
        let k: Vec<f64> = (0..n * w)
            .map(|at| if at / w == 100 { 30.0 } else { 0.0 } + 0.01 * (at % w) as f64)
            .collect();
        let v: Vec<f64> = (0..n * w).map(|at| (at / w) as f64).collect();
        let h = Head::new(d, q, k, v);
        let (mut o, mut lse) = (vec![0.0; 128 * 4], vec![0.0; 128]);
        forward(&h, d, &mut o, &mut lse);
        // Every query: o ≈ v[100] = 100 (the other keys' weights are e^-30 each).
        assert!(o.iter().all(|&x| (x - 100.0).abs() < 1e-8), "{:?}", &o[..4]);
    }
}
