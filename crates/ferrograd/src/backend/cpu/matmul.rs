//! Batched GEMM on the CPU through the `gemm` crate, which takes arbitrary row and column
//! strides: transposed operands (`x @ w.T`) and broadcast gradients (stride 0) need no copy.
//! bf16 has no kernel there, so it is widened to f32 and narrowed back. f16 or bf16 operands
//! into an f32 output are widened and multiplied in f32, the sums stored as they are (what
//! the GPU's f32-accumulating half GEMM computes, to its order of sums). `matmul_acc` adds
//! the product into the output scaled by beta (the gemm crate's dst = α·dst + β·lhs·rhs).

use gemm::{Parallelism, gemm};
use half::bf16;
use rayon::prelude::*;

use super::data::CpuData;
use super::{CpuBackend, Scratch, read, write};
use crate::backend::MatmulSpec;
use crate::backend::matmul::{Matmul, MatmulKernels};
use crate::base::Layout;
use crate::base::{Error, Result};

/// One operand: the element slice, the offset of each batch's matrix, and (row, col) strides.
struct Operand<'a, T> {
    data: &'a [T],
    bases: Vec<usize>,
    rs: isize,
    cs: isize,
}

fn operand<'a, T>(data: &'a [T], l: &Layout) -> Operand<'a, T> {
    let r = l.rank();
    let batch = Layout::new(
        l.shape()[..r - 2].to_vec(),
        l.strides()[..r - 2].to_vec(),
        l.offset(),
    );
    Operand {
        data,
        bases: batch.offsets().collect(),
        rs: l.strides()[r - 2],
        cs: l.strides()[r - 1],
    }
}

fn gemm_typed<T: 'static + Copy + Send + Sync + num_traits::Zero + num_traits::One>(
    s: &MatmulSpec,
    a: Operand<T>,
    b: Operand<T>,
    out: &mut [T],
    acc: Option<T>,
) {
    let (m, n, k) = (s.m, s.n, s.k);
    // acc = Some(beta): out = beta·out + a·b (gemm's alpha scales dst); None: out is not read.
    let (read_dst, keep) = match acc {
        Some(beta) => (true, beta),
        None => (false, T::zero()),
    };
    let flops = 2 * m * n * k;
    let threads = rayon::current_num_threads();
    let run = |dst: &mut [T], i: usize, par: Parallelism| {
        // SAFETY: the operand bases and strides come from layouts validated against their
        // storages, and dst is a disjoint (m, n) row-major chunk.
        unsafe {
            gemm(
                m,
                n,
                k,
                dst.as_mut_ptr(),
                1,
                n as isize,
                read_dst,
                a.data.as_ptr().add(a.bases[i]),
                a.cs,
                a.rs,
                b.data.as_ptr().add(b.bases[i]),
                b.cs,
                b.rs,
                keep,
                T::one(),
                false,
                false,
                false,
                par,
            )
        }
    };
    if m * n == 0 {
        return;
    }
    if s.batch >= threads && flops < (1 << 24) {
        out.par_chunks_mut(m * n)
            .enumerate()
            .for_each(|(i, dst)| run(dst, i, Parallelism::None));
    } else {
        let par = if flops >= (1 << 18) {
            Parallelism::Rayon(threads)
        } else {
            Parallelism::None
        };
        for (i, dst) in out.chunks_mut(m * n).enumerate() {
            run(dst, i, par);
        }
    }
}

pub(crate) fn matmul(
    s: &MatmulSpec,
    a: &CpuData,
    al: &Layout,
    b: &CpuData,
    bl: &Layout,
    out: &mut CpuData,
) -> Result<()> {
    if s.k == 0 {
        return super::elementwise::fill(out, 0.0);
    }
    product(s, a, al, b, bl, out, None)
}

/// `out = a @ b + beta·out`; beta = 0 does not read `out` (a NaN there does not survive).
pub(crate) fn matmul_acc(
    s: &MatmulSpec,
    a: &CpuData,
    al: &Layout,
    b: &CpuData,
    bl: &Layout,
    out: &mut CpuData,
    beta: f64,
) -> Result<()> {
    if beta == 0.0 {
        return matmul(s, a, al, b, bl, out);
    }
    // The gemm crate handles k = 0 itself (out = beta·out).
    product(s, a, al, b, bl, out, Some(beta))
}

fn product(
    s: &MatmulSpec,
    a: &CpuData,
    al: &Layout,
    b: &CpuData,
    bl: &Layout,
    out: &mut CpuData,
    beta: Option<f64>,
) -> Result<()> {
    match (a, b, out) {
        (CpuData::F32(x), CpuData::F32(y), CpuData::F32(o)) => {
            gemm_typed(s, operand(x, al), operand(y, bl), o, beta.map(|v| v as f32))
        }
        (CpuData::F64(x), CpuData::F64(y), CpuData::F64(o)) => {
            gemm_typed(s, operand(x, al), operand(y, bl), o, beta)
        }
        (CpuData::F16(x), CpuData::F16(y), CpuData::F16(o)) if s.k <= 2 => {
            small_k_f16(s, operand(x, al), operand(y, bl), o, beta)
        }
        (CpuData::F16(x), CpuData::F16(y), CpuData::F16(o)) => gemm_typed(
            s,
            operand(x, al),
            operand(y, bl),
            o,
            beta.map(crate::base::f16_of),
        ),
        (CpuData::BF16(x), CpuData::BF16(y), CpuData::F32(o)) => {
            let (xw, yw) = (widen(x)?, widen(y)?);
            gemm_typed(
                s,
                operand(&xw, al),
                operand(&yw, bl),
                o,
                beta.map(|v| v as f32),
            );
        }
        (CpuData::F16(x), CpuData::F16(y), CpuData::F32(o)) => {
            let (xw, yw) = (widen(x)?, widen(y)?);
            gemm_typed(
                s,
                operand(&xw, al),
                operand(&yw, bl),
                o,
                beta.map(|v| v as f32),
            );
        }
        (CpuData::BF16(x), CpuData::BF16(y), CpuData::BF16(o)) => {
            let (xw, yw) = (widen(x)?, widen(y)?);
            // Accumulating reads the output: widen it too (else gemm does not read it).
            let mut ow = widen(o)?;
            gemm_typed(
                s,
                operand(&xw, al),
                operand(&yw, bl),
                &mut ow,
                beta.map(|v| v as f32),
            );
            o.iter_mut()
                .zip(ow.iter())
                .for_each(|(d, &v)| *d = bf16::from_f32(v));
        }
        (x, y, _) => {
            return Err(Error::DType {
                op: "matmul",
                expected: x.dtype(),
                got: y.dtype(),
            });
        }
    }
    Ok(())
}

/// An f32 copy of half-precision operand elements: workspace the allocator counts while the
/// product runs (the planner's meta backend takes the same blocks).
fn widen<H: Copy + Into<f32>>(v: &[H]) -> Result<Scratch<f32>> {
    let mut w = Scratch::uninit(v.len(), "matmul_bf16_widen")?;
    w.iter_mut().zip(v).for_each(|(w, &h)| *w = h.into());
    Ok(w)
}

/// `out = a @ b (+ beta·out)` for k ≤ 2 in f16. The gemm crate's f16 kernel for such k rounds
/// every multiply-add to f16 (300·300 overflows before -300·300 cancels it); here products
/// accumulate in f32 and round once, as PyTorch does. Needs no scratch.
fn small_k_f16(
    s: &MatmulSpec,
    a: Operand<half::f16>,
    b: Operand<half::f16>,
    out: &mut [half::f16],
    beta: Option<f64>,
) {
    let (m, n, k) = (s.m, s.n, s.k);
    let at = |base: usize, rs: isize, cs: isize, r: usize, c: usize| {
        (base as isize + r as isize * rs + c as isize * cs) as usize
    };
    for (i, dst) in out.chunks_mut((m * n).max(1)).enumerate().take(s.batch) {
        for (j, d) in dst.iter_mut().enumerate() {
            let (r, c) = (j / n, j % n);
            let mut acc = beta.map_or(0.0, |bt| bt as f32 * d.to_f32());
            for p in 0..k {
                let x = a.data[at(a.bases[i], a.rs, a.cs, r, p)];
                let y = b.data[at(b.bases[i], b.rs, b.cs, p, c)];
                acc += x.to_f32() * y.to_f32();
            }
            *d = half::f16::from_f32(acc);
        }
    }
}

impl MatmulKernels for CpuBackend {
    fn matmul(&self, m: &Matmul) -> Result<()> {
        let (a, b, beta) = (m.a, m.b, m.beta);
        let ad = read(a.storage)?;
        if a.storage.same(b.storage) {
            return write(m.out, |o| {
                matmul_acc(&m.spec, &ad, a.layout, &ad, b.layout, o, beta)
            });
        }
        let bd = read(b.storage)?;
        write(m.out, |o| {
            matmul_acc(&m.spec, &ad, a.layout, &bd, b.layout, o, beta)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// a (2, 3) @ bᵀ where b is (2, 3) read transposed, into out (2, 2), with a previous out.
    fn case(beta: f64, wrap: impl Fn(Vec<f64>) -> CpuData) -> Vec<f64> {
        let a = wrap(vec![1., 2., 3., 4., 5., 6.]);
        let b = wrap(vec![1., 0., -1., 2., 1., 0.]);
        let mut out = wrap(vec![f64::NAN, 10., 20., 30.]);
        if beta != 0.0 {
            out = wrap(vec![5., 10., 20., 30.]);
        }
        let spec = MatmulSpec {
            batch: 1,
            m: 2,
            n: 2,
            k: 3,
        };
        let (al, bl) = (
            Layout::contiguous(&[2, 3]),
            Layout::new(vec![3, 2], vec![1, 3], 0),
        );
        matmul_acc(&spec, &a, &al, &b, &bl, &mut out, beta).unwrap();
        match out {
            CpuData::F32(v) => v.iter().map(|&x| x as f64).collect(),
            CpuData::F64(v) => v,
            CpuData::F16(v) => v.iter().map(|x| x.to_f64()).collect(),
            CpuData::BF16(v) => v.iter().map(|x| x.to_f64()).collect(),
            _ => unreachable!(),
        }
    }

    #[test]
    fn accumulating_products() {
        // a @ bᵀ = [[-2, 4], [-2, 13]]
        let wraps: [fn(Vec<f64>) -> CpuData; 4] = [
            |v| CpuData::F32(v.iter().map(|&x| x as f32).collect()),
            CpuData::F64,
            |v| CpuData::F16(v.iter().map(|&x| crate::base::f16_of(x)).collect()),
            |v| CpuData::BF16(v.iter().map(|&x| crate::base::bf16_of(x)).collect()),
        ];
        for w in wraps {
            // beta = 0 ignores the previous values, NaN included.
            assert_eq!(case(0.0, w), [-2., 4., -2., 13.]);
            assert_eq!(case(1.0, w), [3., 14., 18., 43.]);
            assert_eq!(case(0.5, w), [0.5, 9., 8., 28.]);
        }
    }
}
