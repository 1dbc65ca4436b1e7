//! Batched GEMM on the CPU through the `gemm` crate, which takes arbitrary row and column
//! strides: transposed operands (`x @ w.T`) and broadcast gradients (stride 0) need no copy.
//! bf16 has no kernel there, so it is widened to f32 and narrowed back.

use gemm::{Parallelism, gemm};
use half::bf16;
use rayon::prelude::*;

use super::data::CpuData;
use crate::backend::MatmulSpec;
use crate::error::{Error, Result};
use crate::tensor::Layout;

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
) {
    let (m, n, k) = (s.m, s.n, s.k);
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
                false,
                a.data.as_ptr().add(a.bases[i]),
                a.cs,
                a.rs,
                b.data.as_ptr().add(b.bases[i]),
                b.cs,
                b.rs,
                T::zero(),
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
    match (a, b, out) {
        (CpuData::F32(x), CpuData::F32(y), CpuData::F32(o)) => {
            gemm_typed(s, operand(x, al), operand(y, bl), o)
        }
        (CpuData::F64(x), CpuData::F64(y), CpuData::F64(o)) => {
            gemm_typed(s, operand(x, al), operand(y, bl), o)
        }
        (CpuData::F16(x), CpuData::F16(y), CpuData::F16(o)) => {
            gemm_typed(s, operand(x, al), operand(y, bl), o)
        }
        (CpuData::BF16(x), CpuData::BF16(y), CpuData::BF16(o)) => {
            let widen = |v: &[bf16]| v.iter().map(|h| h.to_f32()).collect::<Vec<f32>>();
            let (xw, yw) = (widen(x), widen(y));
            let mut ow = vec![0f32; o.len()];
            gemm_typed(s, operand(&xw, al), operand(&yw, bl), &mut ow);
            o.iter_mut()
                .zip(ow)
                .for_each(|(d, v)| *d = bf16::from_f32(v));
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
