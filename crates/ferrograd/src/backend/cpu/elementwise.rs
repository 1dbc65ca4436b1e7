//! Elementwise CPU kernels: unary, binary (inputs pre-broadcast), in-place binary, strided
//! copy with dtype conversion, fill. Strided inputs are walked row by row (the last dim is the
//! inner loop); all-contiguous inputs take a flat, chunked, parallel path.

use rayon::prelude::*;

use super::data::{CpuData, Elem, with_float, with_float_pair};
use crate::backend::{BinaryOp, UnaryOp};
use crate::error::{Error, Result};
use crate::tensor::Layout;

/// Below this many elements a kernel runs on the calling thread.
pub(crate) const PAR_MIN: usize = 1 << 15;
const CHUNK: usize = 1 << 13;

/// How to walk a layout: `bases.len()` rows of `inner` elements `stride` apart.
pub(crate) struct Rows {
    pub inner: usize,
    pub stride: isize,
    pub bases: Vec<usize>,
}

/// Row plan shared by operands of the same shape; `flat` = every operand contiguous.
pub(crate) fn rows(layout: &Layout, flat: bool) -> Rows {
    let shape = layout.shape();
    if flat || shape.is_empty() {
        return Rows {
            inner: layout.numel(),
            stride: 1,
            bases: vec![layout.offset()],
        };
    }
    let r = shape.len() - 1;
    let outer = Layout::new(shape[..r].to_vec(), layout.strides()[..r].to_vec(), layout.offset());
    Rows {
        inner: shape[r],
        stride: layout.strides()[r],
        bases: outer.offsets().collect(),
    }
}

#[inline(always)]
fn at<T: Copy>(v: &[T], base: usize, stride: isize, j: usize) -> T {
    v[(base as isize + stride * j as isize) as usize]
}

/// Applies `f(out_chunk, start_index_in_row_space)` over `out` in parallel where it pays.
/// For the flat case rows are split into chunks; otherwise each row is one unit.
fn for_each_out<T: Send>(out: &mut [T], r: &Rows, f: impl Fn(&mut [T], usize, usize) + Sync) {
    // f(chunk, row, offset within row)
    if r.bases.len() == 1 {
        if out.len() >= PAR_MIN {
            out.par_chunks_mut(CHUNK)
                .enumerate()
                .for_each(|(c, ch)| f(ch, 0, c * CHUNK));
        } else {
            f(out, 0, 0);
        }
    } else if r.inner > 0 {
        if out.len() >= PAR_MIN {
            out.par_chunks_mut(r.inner)
                .enumerate()
                .for_each(|(i, ch)| f(ch, i, 0));
        } else {
            out.chunks_mut(r.inner).enumerate().for_each(|(i, ch)| f(ch, i, 0));
        }
    }
}

#[inline(always)]
pub(crate) fn unary_scalar<T: Elem>(op: UnaryOp, x: T) -> T {
    let half = T::from_f64(0.5);
    let one = T::one();
    match op {
        UnaryOp::Neg => -x,
        UnaryOp::Exp => x.exp(),
        UnaryOp::Log => x.ln(),
        UnaryOp::Sqrt => x.sqrt(),
        UnaryOp::Tanh => x.tanh(),
        UnaryOp::Sigmoid => one / (one + (-x).exp()),
        UnaryOp::Relu => {
            if x > T::zero() {
                x
            } else {
                T::zero()
            }
        }
        UnaryOp::GeluTanh => {
            let u = T::from_f64(GELU_C) * (x + T::from_f64(GELU_A) * x * x * x);
            half * x * (one + u.tanh())
        }
        UnaryOp::GeluErf => T::from_f64(0.5 * x.to_f64() * (1.0 + libm::erf(x.to_f64() * FRAC_1_SQRT_2))),
        UnaryOp::Abs => x.abs(),
        UnaryOp::AddScalar(c) => x + T::from_f64(c),
        UnaryOp::MulScalar(c) => x * T::from_f64(c),
        UnaryOp::PowScalar(c) => x.powf(T::from_f64(c)),
        UnaryOp::Step => {
            if x > T::zero() {
                one
            } else {
                T::zero()
            }
        }
    }
}

const GELU_C: f64 = 0.797_884_560_802_865_4; // sqrt(2/pi)
const GELU_A: f64 = 0.044_715;
const FRAC_1_SQRT_2: f64 = std::f64::consts::FRAC_1_SQRT_2;

#[inline(always)]
pub(crate) fn binary_scalar<T: Elem>(op: BinaryOp, a: T, b: T) -> T {
    let one = T::one();
    match op {
        BinaryOp::Add => a + b,
        BinaryOp::Sub => a - b,
        BinaryOp::Mul => a * b,
        BinaryOp::Div => a / b,
        BinaryOp::Pow => a.powf(b),
        BinaryOp::Maximum => a.max(b),
        BinaryOp::AddScaled(alpha) => a + T::from_f64(alpha) * b,
        BinaryOp::Assign => b,
        BinaryOp::ReluBackward => {
            if b > T::zero() {
                a
            } else {
                T::zero()
            }
        }
        BinaryOp::TanhBackward => a * (one - b * b),
        BinaryOp::SigmoidBackward => a * b * (one - b),
        BinaryOp::GeluTanhBackward => {
            let (c, k) = (T::from_f64(GELU_C), T::from_f64(GELU_A));
            let half = T::from_f64(0.5);
            let t = (c * (b + k * b * b * b)).tanh();
            let d = half * (one + t) + half * b * (one - t * t) * c * (one + T::from_f64(3.0) * k * b * b);
            a * d
        }
        BinaryOp::GeluErfBackward => {
            let x = b.to_f64();
            let cdf = 0.5 * (1.0 + libm::erf(x * FRAC_1_SQRT_2));
            let pdf = (-0.5 * x * x).exp() / (2.0 * std::f64::consts::PI).sqrt();
            a * T::from_f64(cdf + x * pdf)
        }
        BinaryOp::Eq => {
            if a == b {
                one
            } else {
                T::zero()
            }
        }
    }
}

pub(crate) fn unary(op: UnaryOp, x: &CpuData, xl: &Layout, out: &mut CpuData) -> Result<()> {
    with_float_pair!(x, out, "unary", xv, ov => unary_typed(op, xv, xl, ov));
    Ok(())
}

fn unary_typed<T: Elem>(op: UnaryOp, x: &[T], xl: &Layout, out: &mut [T]) {
    let r = rows(xl, xl.is_contiguous());
    for_each_out(out, &r, |ch, row, off| {
        let base = r.bases[row];
        for (j, o) in ch.iter_mut().enumerate() {
            *o = unary_scalar(op, at(x, base, r.stride, off + j));
        }
    });
}

pub(crate) fn binary(
    op: BinaryOp,
    a: &CpuData,
    al: &Layout,
    b: &CpuData,
    bl: &Layout,
    out: &mut CpuData,
) -> Result<()> {
    with_float_pair!(a, b, "binary", av, bv => {
        let ov = same_type_out(av, out)?;
        binary_typed(op, av, al, bv, bl, ov);
    });
    Ok(())
}

/// The output buffer typed like the input (outputs are allocated with the inputs' dtype).
fn same_type_out<'a, T: Elem>(_like: &[T], out: &'a mut CpuData) -> Result<&'a mut [T]> {
    let dtype = out.dtype();
    let any: &mut dyn std::any::Any = match out {
        CpuData::F32(v) => v,
        CpuData::F64(v) => v,
        CpuData::F16(v) => v,
        CpuData::BF16(v) => v,
        CpuData::I64(v) => v,
        CpuData::U8(v) => v,
    };
    any.downcast_mut::<Vec<T>>()
        .map(|v| v.as_mut_slice())
        .ok_or_else(|| Error::invalid("binary", format!("output dtype {dtype} differs from the inputs'")))
}

fn binary_typed<T: Elem>(op: BinaryOp, a: &[T], al: &Layout, b: &[T], bl: &Layout, out: &mut [T]) {
    let flat = al.is_contiguous() && bl.is_contiguous();
    let (ra, rb) = (rows(al, flat), rows(bl, flat));
    for_each_out(out, &ra, |ch, row, off| {
        let (ba, bb) = (ra.bases[row], rb.bases[row]);
        for (j, o) in ch.iter_mut().enumerate() {
            *o = binary_scalar(op, at(a, ba, ra.stride, off + j), at(b, bb, rb.stride, off + j));
        }
    });
}

pub(crate) fn binary_inplace(op: BinaryOp, dst: &mut CpuData, src: &CpuData, sl: &Layout) -> Result<()> {
    with_float_pair!(dst, src, "binary_inplace", dv, sv => {
        let flat = sl.is_contiguous();
        let r = rows(sl, flat);
        for_each_out(dv.as_mut_slice(), &r, |ch, row, off| {
            let base = r.bases[row];
            for (j, o) in ch.iter_mut().enumerate() {
                *o = binary_scalar(op, *o, at(sv, base, r.stride, off + j));
            }
        });
    });
    Ok(())
}

/// Runs `$typed!(s, d, conv)` for the buffer pair's element types.
macro_rules! convert_dispatch {
    ($src:expr, $dst:expr, $typed:ident) => {
        match ($src, $dst) {
            (CpuData::I64(s), CpuData::I64(d)) => $typed!(s, d, |x| x),
            (CpuData::U8(s), CpuData::U8(d)) => $typed!(s, d, |x| x),
            (CpuData::I64(s), CpuData::U8(d)) => $typed!(s, d, |x: i64| (x != 0) as u8),
            (CpuData::U8(s), CpuData::I64(d)) => $typed!(s, d, |x: u8| x as i64),
            (CpuData::F32(s), CpuData::F32(d)) => $typed!(s, d, |x| x),
            (CpuData::F64(s), CpuData::F64(d)) => $typed!(s, d, |x| x),
            (CpuData::F16(s), CpuData::F16(d)) => $typed!(s, d, |x| x),
            (CpuData::BF16(s), CpuData::BF16(d)) => $typed!(s, d, |x| x),
            (CpuData::I64(s), d) => with_float!(d, "copy", dv => $typed!(s, dv, |x: i64| Elem::from_f64(x as f64))),
            (CpuData::U8(s), d) => with_float!(d, "copy", dv => $typed!(s, dv, |x: u8| Elem::from_f64(x as f64))),
            (s, CpuData::I64(d)) => with_float!(s, "copy", sv => $typed!(sv, d, |x: _| Elem::to_f64(x) as i64)),
            (s, CpuData::U8(d)) => with_float!(s, "copy", sv => $typed!(sv, d, |x: _| (Elem::to_f64(x) != 0.0) as u8)),
            (s, d) => with_float!(s, "copy", sv => with_float!(d, "copy", dv => $typed!(sv, dv, |x: _| Elem::from_f64(Elem::to_f64(x))))),
        }
    };
}

/// Copies a strided source into a strided destination region, converting between dtypes.
pub(crate) fn copy(src: &CpuData, sl: &Layout, dst: &mut CpuData, dl: &Layout) -> Result<()> {
    if dl.is_contiguous() && dl.offset() == 0 && dl.numel() == dst.len() {
        return copy_to_contiguous(src, sl, dst);
    }
    // Strided destination (cat, narrow backward): element by element, on one thread.
    let pairs: Vec<(usize, usize)> = sl.offsets().zip(dl.offsets()).collect();
    macro_rules! typed {
        ($s:ident, $d:ident, $conv:expr) => {{
            for &(i, j) in &pairs {
                $d[j] = $conv($s[i]);
            }
        }};
    }
    convert_dispatch!(src, dst, typed);
    Ok(())
}


fn copy_to_contiguous(src: &CpuData, sl: &Layout, dst: &mut CpuData) -> Result<()> {
    let r = rows(sl, sl.is_contiguous());
    macro_rules! typed {
        ($s:ident, $d:ident, $conv:expr) => {{
            for_each_out($d.as_mut_slice(), &r, |ch, row, off| {
                let base = r.bases[row];
                for (j, o) in ch.iter_mut().enumerate() {
                    *o = $conv(at($s, base, r.stride, off + j));
                }
            })
        }};
    }
    convert_dispatch!(src, dst, typed);
    Ok(())
}

pub(crate) fn fill(dst: &mut CpuData, value: f64) -> Result<()> {
    match dst {
        CpuData::I64(v) => v.fill(value as i64),
        CpuData::U8(v) => v.fill((value != 0.0) as u8),
        d => with_float!(d, "fill", v => v.fill(Elem::from_f64(value))),
    }
    Ok(())
}
