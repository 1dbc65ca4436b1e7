//! Elementwise CPU kernels: unary, binary (inputs pre-broadcast), in-place binary, strided
//! copy with dtype conversion, fill. Strided inputs are walked row by row (the last dim is the
//! inner loop); all-contiguous inputs take a flat, chunked, parallel path. A binary op may
//! read one f16/bf16 operand beside f32 ones, widening each element as it reads it.

use rayon::prelude::*;

use super::data::{CpuData, Elem, with_float, with_float_pair};
use super::vmath::simd_fn;
use super::{CpuBackend, read, write};
use crate::backend::{BinaryOp, ElementwiseKernels, Storage, UnaryOp, View};
use crate::base::Layout;
use crate::base::{Error, Result};

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
    let outer = Layout::new(
        shape[..r].to_vec(),
        layout.strides()[..r].to_vec(),
        layout.offset(),
    );
    Rows {
        inner: shape[r],
        stride: layout.strides()[r],
        bases: outer.offsets().collect(),
    }
}

#[inline(always)]
pub(crate) fn at<T: Copy>(v: &[T], base: usize, stride: isize, j: usize) -> T {
    v[(base as isize + stride * j as isize) as usize]
}

/// Applies `f(out_chunk, start_index_in_row_space)` over `out` in parallel where it pays.
/// For the flat case rows are split into chunks; otherwise each row is one unit.
pub(crate) fn for_each_out<T: Send>(
    out: &mut [T],
    r: &Rows,
    f: impl Fn(&mut [T], usize, usize) + Sync,
) {
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
            out.chunks_mut(r.inner)
                .enumerate()
                .for_each(|(i, ch)| f(ch, i, 0));
        }
    }
}

#[inline(always)]
pub(crate) fn unary_scalar<T: Elem>(op: UnaryOp, x: T) -> T {
    let one = T::one();
    match op {
        UnaryOp::Neg => -x,
        UnaryOp::Exp => x.exp_v(),
        UnaryOp::Log => x.ln_v(),
        UnaryOp::Sqrt => x.sqrt(),
        UnaryOp::Tanh => x.tanh_v(),
        UnaryOp::Sigmoid => one / (one + (-x).exp_v()),
        UnaryOp::Relu => {
            if x > T::zero() {
                x
            } else {
                T::zero()
            }
        }
        UnaryOp::GeluTanh => {
            // 0.5·x·(1 + tanh(u)) = x·sigmoid(2u): one exp instead of tanh (which costs an
            // expm1 and more), and no cancellation in 1 + tanh(u) for very negative u.
            let u = T::from_f64(GELU_C) * (x + T::from_f64(GELU_A) * x * x * x);
            x / (one + (-(u + u)).exp_v())
        }
        UnaryOp::GeluErf => {
            T::from_f64(0.5 * x.to_f64() * (1.0 + libm::erf(x.to_f64() * FRAC_1_SQRT_2)))
        }
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
        UnaryOp::Clamp { lo, hi } => {
            // Comparisons with NaN are false: NaN passes through, as in torch.clamp.
            let (lo, hi) = (T::from_f64(lo), T::from_f64(hi));
            let y = if x < lo { lo } else { x };
            if y > hi { hi } else { y }
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
            // With s = sigmoid(2u) = 0.5·(1 + tanh(u)), 1 − tanh² = 4s(1 − s), so
            // d/dx = s + x·2s(1 − s)·u'.
            let (c, k) = (T::from_f64(GELU_C), T::from_f64(GELU_A));
            let u = c * (b + k * b * b * b);
            let s = one / (one + (-(u + u)).exp_v());
            let du = c * (one + T::from_f64(3.0) * k * b * b);
            let d = s + (b + b) * s * (one - s) * du;
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

/// Calls `$k(closure)` with the op fixed per arm, so each op gets its own loop that the
/// compiler can vectorise (a `match` inside the element loop would block that).
macro_rules! per_unary_op {
    ($op:expr, $k:ident($($arg:expr),*)) => {
        match $op {
            UnaryOp::Neg => $k($($arg,)* |v| unary_scalar(UnaryOp::Neg, v)),
            UnaryOp::Exp => $k($($arg,)* |v| unary_scalar(UnaryOp::Exp, v)),
            UnaryOp::Log => $k($($arg,)* |v| unary_scalar(UnaryOp::Log, v)),
            UnaryOp::Sqrt => $k($($arg,)* |v| unary_scalar(UnaryOp::Sqrt, v)),
            UnaryOp::Tanh => $k($($arg,)* |v| unary_scalar(UnaryOp::Tanh, v)),
            UnaryOp::Sigmoid => $k($($arg,)* |v| unary_scalar(UnaryOp::Sigmoid, v)),
            UnaryOp::Relu => $k($($arg,)* |v| unary_scalar(UnaryOp::Relu, v)),
            UnaryOp::GeluTanh => $k($($arg,)* |v| unary_scalar(UnaryOp::GeluTanh, v)),
            UnaryOp::GeluErf => $k($($arg,)* |v| unary_scalar(UnaryOp::GeluErf, v)),
            UnaryOp::Abs => $k($($arg,)* |v| unary_scalar(UnaryOp::Abs, v)),
            UnaryOp::AddScalar(c) => $k($($arg,)* move |v| unary_scalar(UnaryOp::AddScalar(c), v)),
            UnaryOp::MulScalar(c) => $k($($arg,)* move |v| unary_scalar(UnaryOp::MulScalar(c), v)),
            UnaryOp::PowScalar(c) => $k($($arg,)* move |v| unary_scalar(UnaryOp::PowScalar(c), v)),
            UnaryOp::Step => $k($($arg,)* |v| unary_scalar(UnaryOp::Step, v)),
            UnaryOp::Clamp { lo, hi } => $k($($arg,)* move |v| unary_scalar(UnaryOp::Clamp { lo, hi }, v)),
        }
    };
}

macro_rules! per_binary_op {
    ($op:expr, $k:ident($($arg:expr),*)) => {
        match $op {
            BinaryOp::Add => $k($($arg,)* |a, b| binary_scalar(BinaryOp::Add, a, b)),
            BinaryOp::Sub => $k($($arg,)* |a, b| binary_scalar(BinaryOp::Sub, a, b)),
            BinaryOp::Mul => $k($($arg,)* |a, b| binary_scalar(BinaryOp::Mul, a, b)),
            BinaryOp::Div => $k($($arg,)* |a, b| binary_scalar(BinaryOp::Div, a, b)),
            BinaryOp::Pow => $k($($arg,)* |a, b| binary_scalar(BinaryOp::Pow, a, b)),
            BinaryOp::Maximum => $k($($arg,)* |a, b| binary_scalar(BinaryOp::Maximum, a, b)),
            BinaryOp::AddScaled(c) => $k($($arg,)* move |a, b| binary_scalar(BinaryOp::AddScaled(c), a, b)),
            BinaryOp::Assign => $k($($arg,)* |a, b| binary_scalar(BinaryOp::Assign, a, b)),
            BinaryOp::ReluBackward => $k($($arg,)* |a, b| binary_scalar(BinaryOp::ReluBackward, a, b)),
            BinaryOp::TanhBackward => $k($($arg,)* |a, b| binary_scalar(BinaryOp::TanhBackward, a, b)),
            BinaryOp::SigmoidBackward => $k($($arg,)* |a, b| binary_scalar(BinaryOp::SigmoidBackward, a, b)),
            BinaryOp::GeluTanhBackward => $k($($arg,)* |a, b| binary_scalar(BinaryOp::GeluTanhBackward, a, b)),
            BinaryOp::GeluErfBackward => $k($($arg,)* |a, b| binary_scalar(BinaryOp::GeluErfBackward, a, b)),
            BinaryOp::Eq => $k($($arg,)* |a, b| binary_scalar(BinaryOp::Eq, a, b)),
        }
    };
}

/// One row segment of an operand: contiguous, a broadcast scalar, or strided.
#[derive(Clone, Copy)]
enum Seg<'a, T> {
    Slice(&'a [T]),
    Splat(T),
    Strided(&'a [T], usize, isize),
}

#[inline(always)]
fn seg<T: Copy>(v: &[T], base: usize, stride: isize, off: usize, len: usize) -> Seg<'_, T> {
    match stride {
        1 => Seg::Slice(&v[base + off..base + off + len]),
        0 => Seg::Splat(v[base]),
        s => Seg::Strided(v, (base as isize + s * off as isize) as usize, s),
    }
}

#[inline(always)]
fn map1<T: Elem>(out: &mut [T], x: Seg<T>, f: &impl Fn(T) -> T) {
    match x {
        Seg::Slice(xs) => out.iter_mut().zip(xs).for_each(|(o, &v)| *o = f(v)),
        Seg::Splat(v) => out.fill(f(v)),
        Seg::Strided(xs, b, s) => out
            .iter_mut()
            .enumerate()
            .for_each(|(j, o)| *o = f(at(xs, b, s, j))),
    }
}

#[inline(always)]
fn map2<T: Elem>(out: &mut [T], a: Seg<T>, b: Seg<T>, f: &impl Fn(T, T) -> T) {
    match (a, b) {
        (Seg::Slice(xa), Seg::Slice(xb)) => out
            .iter_mut()
            .zip(xa.iter().zip(xb))
            .for_each(|(o, (&p, &q))| *o = f(p, q)),
        (Seg::Slice(xa), Seg::Splat(q)) => out.iter_mut().zip(xa).for_each(|(o, &p)| *o = f(p, q)),
        (Seg::Splat(p), Seg::Slice(xb)) => out.iter_mut().zip(xb).for_each(|(o, &q)| *o = f(p, q)),
        (a, b) => out
            .iter_mut()
            .enumerate()
            .for_each(|(j, o)| *o = f(get(a, j), get(b, j))),
    }
}

/// In place: `out[j] = f(out[j], b[j])`.
#[inline(always)]
fn update<T: Elem>(out: &mut [T], b: Seg<T>, f: &impl Fn(T, T) -> T) {
    match b {
        Seg::Slice(xb) => out.iter_mut().zip(xb).for_each(|(o, &q)| *o = f(*o, q)),
        Seg::Splat(q) => out.iter_mut().for_each(|o| *o = f(*o, q)),
        b => out
            .iter_mut()
            .enumerate()
            .for_each(|(j, o)| *o = f(*o, get(b, j))),
    }
}

simd_fn!(fn map1_v[T: Elem](out: &mut [T], x: Seg<T>, f: &impl Fn(T) -> T) = map1;);
simd_fn!(fn map2_v[T: Elem](out: &mut [T], a: Seg<T>, b: Seg<T>, f: &impl Fn(T, T) -> T) = map2;);
simd_fn!(fn update_v[T: Elem](out: &mut [T], b: Seg<T>, f: &impl Fn(T, T) -> T) = update;);

#[inline(always)]
fn get<T: Copy>(s: Seg<T>, j: usize) -> T {
    match s {
        Seg::Slice(v) => v[j],
        Seg::Splat(v) => v,
        Seg::Strided(v, b, st) => at(v, b, st, j),
    }
}

fn unary_typed<T: Elem>(op: UnaryOp, x: &[T], xl: &Layout, out: &mut [T]) {
    per_unary_op!(op, unary_run(x, xl, out))
}

fn unary_run<T: Elem>(x: &[T], xl: &Layout, out: &mut [T], f: impl Fn(T) -> T + Sync) {
    let r = rows(xl, xl.is_contiguous());
    for_each_out(out, &r, |ch, row, off| {
        map1_v(ch, seg(x, r.bases[row], r.stride, off, ch.len()), &f)
    })
}

pub(crate) fn binary(
    op: BinaryOp,
    a: &CpuData,
    al: &Layout,
    b: &CpuData,
    bl: &Layout,
    out: &mut CpuData,
) -> Result<()> {
    if a.dtype() != b.dtype() {
        return binary_widened(op, a, al, b, bl, out);
    }
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
        .ok_or_else(|| {
            Error::invalid(
                "binary",
                format!("output dtype {dtype} differs from the inputs'"),
            )
        })
}

fn binary_typed<T: Elem>(op: BinaryOp, a: &[T], al: &Layout, b: &[T], bl: &Layout, out: &mut [T]) {
    per_binary_op!(op, binary_run(a, al, b, bl, out))
}

fn binary_run<T: Elem>(
    a: &[T],
    al: &Layout,
    b: &[T],
    bl: &Layout,
    out: &mut [T],
    f: impl Fn(T, T) -> T + Sync,
) {
    let flat = al.is_contiguous() && bl.is_contiguous();
    let (ra, rb) = (rows(al, flat), rows(bl, flat));
    for_each_out(out, &ra, |ch, row, off| {
        let n = ch.len();
        let sa = seg(a, ra.bases[row], ra.stride, off, n);
        map2_v(ch, sa, seg(b, rb.bases[row], rb.stride, off, n), &f)
    })
}

/// out (f32) = op(a, b) where one operand is f16/bf16 and the other f32 (the family
/// validated that): the half operand is read widened to f32 as a cast would store it, so the
/// result is the f32 kernel's on the cast operand, bit for bit.
fn binary_widened(
    op: BinaryOp,
    a: &CpuData,
    al: &Layout,
    b: &CpuData,
    bl: &Layout,
    out: &mut CpuData,
) -> Result<()> {
    let mismatch = || Error::DType {
        op: "binary",
        expected: a.dtype(),
        got: b.dtype(),
    };
    let CpuData::F32(out) = out else {
        return Err(mismatch());
    };
    match (a, b) {
        (CpuData::F32(a), CpuData::F16(b)) => per_binary_op!(op, widened_run(a, al, b, bl, out)),
        (CpuData::F32(a), CpuData::BF16(b)) => per_binary_op!(op, widened_run(a, al, b, bl, out)),
        (CpuData::F16(a), CpuData::F32(b)) => per_binary_op!(op, widened_run(a, al, b, bl, out)),
        (CpuData::BF16(a), CpuData::F32(b)) => per_binary_op!(op, widened_run(a, al, b, bl, out)),
        _ => return Err(mismatch()),
    }
    Ok(())
}

/// `binary_run` with operands of two element types, each widened to f32 as it is read.
fn widened_run<A: Elem, B: Elem>(
    a: &[A],
    al: &Layout,
    b: &[B],
    bl: &Layout,
    out: &mut [f32],
    f: impl Fn(f32, f32) -> f32 + Sync,
) {
    let flat = al.is_contiguous() && bl.is_contiguous();
    let (ra, rb) = (rows(al, flat), rows(bl, flat));
    for_each_out(out, &ra, |ch, row, off| {
        let n = ch.len();
        let sa = seg(a, ra.bases[row], ra.stride, off, n);
        map2_widened_v(ch, sa, seg(b, rb.bases[row], rb.stride, off, n), &f)
    })
}

/// An element as f32, converted as `copy` converts it (exact from f16/bf16).
#[inline(always)]
fn widen<T: Elem>(v: T) -> f32 {
    <f32 as Elem>::from_f64(v.to_f64())
}

#[inline(always)]
fn map2_widened<A: Elem, B: Elem>(
    out: &mut [f32],
    a: Seg<A>,
    b: Seg<B>,
    f: &impl Fn(f32, f32) -> f32,
) {
    match (a, b) {
        (Seg::Slice(xa), Seg::Slice(xb)) => out
            .iter_mut()
            .zip(xa.iter().zip(xb))
            .for_each(|(o, (&p, &q))| *o = f(widen(p), widen(q))),
        (a, b) => out
            .iter_mut()
            .enumerate()
            .for_each(|(j, o)| *o = f(widen(get(a, j)), widen(get(b, j)))),
    }
}

simd_fn!(fn map2_widened_v[A: Elem, B: Elem](out: &mut [f32], a: Seg<A>, b: Seg<B>, f: &impl Fn(f32, f32) -> f32) = map2_widened;);

pub(crate) fn binary_inplace(
    op: BinaryOp,
    dst: &mut CpuData,
    src: &CpuData,
    sl: &Layout,
) -> Result<()> {
    with_float_pair!(dst, src, "binary_inplace", dv, sv => per_binary_op!(op, inplace_run(dv, sv, sl)));
    Ok(())
}

fn inplace_run<T: Elem>(dst: &mut [T], src: &[T], sl: &Layout, f: impl Fn(T, T) -> T + Sync) {
    let r = rows(sl, sl.is_contiguous());
    for_each_out(dst, &r, |ch, row, off| {
        update_v(ch, seg(src, r.bases[row], r.stride, off, ch.len()), &f)
    })
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
    // Strided destination (cat, narrow backward): row by row over the dims merged as far as
    // both layouts allow, on one thread.
    let (shape, ss, ds) = coalesce(sl.shape(), sl.strides(), dl.strides());
    let r = shape.len() - 1;
    let (n, si, di) = (shape[r], ss[r], ds[r]);
    let outer =
        |strides: &[isize], offset| Layout::new(shape[..r].to_vec(), strides[..r].to_vec(), offset);
    let (so, dout) = (outer(&ss, sl.offset()), outer(&ds, dl.offset()));
    macro_rules! typed {
        ($s:ident, $d:ident, $conv:expr) => {{
            for (sb, db) in so.offsets().zip(dout.offsets()) {
                if si == 1 && di == 1 {
                    let (sr, dr) = (&$s[sb..sb + n], &mut $d[db..db + n]);
                    dr.iter_mut().zip(sr).for_each(|(o, &x)| *o = $conv(x));
                } else {
                    for j in 0..n {
                        $d[(db as isize + di * j as isize) as usize] = $conv(at($s, sb, si, j));
                    }
                }
            }
        }};
    }
    if sl.numel() > 0 {
        convert_dispatch!(src, dst, typed);
    }
    Ok(())
}

/// The shape and two layouts' strides with size-1 dims dropped and each dim merged into the
/// next where both layouts step through them as one (so a narrowed or permuted view walks in
/// the fewest, longest rows). Always at least one dim.
pub(crate) fn coalesce(
    shape: &[usize],
    a: &[isize],
    b: &[isize],
) -> (Vec<usize>, Vec<isize>, Vec<isize>) {
    let (mut sh, mut sa, mut sb) = (Vec::new(), Vec::new(), Vec::new());
    for d in 0..shape.len() {
        if shape[d] == 1 {
            continue;
        }
        if let (Some(&n), Some(&pa), Some(&pb)) = (sh.last(), sa.last(), sb.last()) {
            let n: usize = n;
            if pa == a[d] * shape[d] as isize && pb == b[d] * shape[d] as isize {
                let k = sh.len() - 1;
                sh[k] = n * shape[d];
                sa[k] = a[d];
                sb[k] = b[d];
                continue;
            }
        }
        sh.push(shape[d]);
        sa.push(a[d]);
        sb.push(b[d]);
    }
    if sh.is_empty() {
        return (vec![1], vec![1], vec![1]);
    }
    (sh, sa, sb)
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

/// `out[i] = x[i] · (1/keep where Philox's draw for i is below keep, else 0)`, in chunks
/// across threads (each element depends on its index alone), one Philox call per eight
/// elements. `x` is the input's contiguous elements.
fn dropout_apply<T: Elem>(x: &[T], out: &mut [T], keep: f64, key: u64) {
    use crate::backend::philox::{DRAWS_PER_CALL, uniforms8};
    use rayon::prelude::*;
    // A multiple of 8, so every chunk starts a call's eight draws.
    const CHUNK: usize = 1 << 14;
    const PER: usize = DRAWS_PER_CALL as usize;
    let scale = T::from_f64(1.0 / keep);
    let zero = T::from_f64(0.0);
    out.par_chunks_mut(CHUNK)
        .zip(x.par_chunks(CHUNK))
        .enumerate()
        .for_each(|(c, (chunk, xs))| {
            let first_call = (c * CHUNK / PER) as u64;
            for (g, (eight, x8)) in chunk.chunks_mut(PER).zip(xs.chunks(PER)).enumerate() {
                let u = uniforms8(key, first_call + g as u64);
                for ((e, &x), u) in eight.iter_mut().zip(x8).zip(u) {
                    *e = binary_scalar(BinaryOp::Mul, x, if u < keep { scale } else { zero });
                }
            }
        });
}

impl ElementwiseKernels for CpuBackend {
    fn copy(&self, src: View, dst: View) -> Result<()> {
        let s = read(src.storage)?;
        write(dst.storage, |d| copy(&s, src.layout, d, dst.layout))
    }

    fn fill(&self, dst: &Storage, value: f64) -> Result<()> {
        write(dst, |d| fill(d, value))
    }

    fn dropout_apply(&self, x: View, out: &Storage, keep: f64, key: u64) -> Result<()> {
        let xd = read(x.storage)?;
        let off = x.layout.offset();
        write(out, |o| {
            with_float_pair!(&*xd, o, "dropout", xv, ov => {
                dropout_apply(&xv[off..off + ov.len()], ov, keep, key);
            });
            Ok(())
        })
    }

    fn unary(&self, op: UnaryOp, x: View, out: &Storage) -> Result<()> {
        let xd = read(x.storage)?;
        write(out, |o| unary(op, &xd, x.layout, o))
    }

    fn binary(&self, op: BinaryOp, a: View, b: View, out: &Storage) -> Result<()> {
        let ad = read(a.storage)?;
        if a.storage.same(b.storage) {
            return write(out, |o| binary(op, &ad, a.layout, &ad, b.layout, o));
        }
        let bd = read(b.storage)?;
        write(out, |o| binary(op, &ad, a.layout, &bd, b.layout, o))
    }

    fn binary_inplace(&self, op: BinaryOp, dst: &Storage, src: View) -> Result<()> {
        if dst.same(src.storage) {
            // Read a private copy of src first: the kernel writes dst while it reads.
            let copy = {
                let s = read(src.storage)?;
                let mut c = CpuData::zeros(s.dtype(), src.layout.numel())?;
                copy(
                    &s,
                    src.layout,
                    &mut c,
                    &Layout::contiguous(src.layout.shape()),
                )?;
                c
            };
            let l = Layout::contiguous(src.layout.shape());
            return write(dst, |d| binary_inplace(op, d, &copy, &l));
        }
        let s = read(src.storage)?;
        write(dst, |d| binary_inplace(op, d, &s, src.layout))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every strided-destination copy equals the element-by-element walk of both layouts.
    #[test]
    fn strided_copy_matches_the_offset_walk() {
        let base = Layout::contiguous(&[3, 4, 5, 2]);
        let dsts = [
            base.narrow(1, 1, 2).unwrap(),
            base.permute(&[2, 0, 3, 1])
                .unwrap()
                .narrow(3, 1, 3)
                .unwrap(),
            base.narrow(0, 2, 1).unwrap().narrow(3, 1, 1).unwrap(),
            base.narrow(2, 0, 0).unwrap(),
        ];
        for dl in dsts {
            let shape = dl.shape().to_vec();
            let n = dl.numel();
            // The source: a transposed view of a contiguous buffer where rank allows.
            let sl = if shape.len() >= 2 {
                let mut s = shape.clone();
                let r = s.len();
                s.swap(r - 2, r - 1);
                let mut perm: Vec<usize> = (0..r).collect();
                perm.swap(r - 2, r - 1);
                Layout::contiguous(&s).permute(&perm).unwrap()
            } else {
                Layout::contiguous(&shape)
            };
            let src = CpuData::F32((0..n.max(1)).map(|i| i as f32).collect());
            let mut got = CpuData::F64(vec![-1.0; base.numel()]);
            copy(&src, &sl, &mut got, &dl).unwrap();
            let mut want = vec![-1.0f64; base.numel()];
            for (i, j) in sl.offsets().zip(dl.offsets()) {
                want[j] = i as f64;
            }
            let CpuData::F64(got) = got else {
                unreachable!()
            };
            assert_eq!(got, want, "dst {dl:?}");
        }
    }

    #[test]
    fn coalesce_merges_what_both_layouts_walk_as_one() {
        let (s, a, b) = coalesce(&[2, 3, 4], &[12, 4, 1], &[32, 8, 1]);
        assert_eq!((s, a, b), (vec![2, 3, 4], vec![12, 4, 1], vec![32, 8, 1]));
        let (s, a, b) = coalesce(&[2, 3, 4], &[12, 4, 1], &[24, 8, 1]);
        assert_eq!((s, a, b), (vec![6, 4], vec![4, 1], vec![8, 1]));
        let (s, a, b) = coalesce(&[2, 1, 3, 4], &[12, 99, 4, 1], &[24, 7, 4, 1]);
        assert_eq!((s, a, b), (vec![2, 12], vec![12, 1], vec![24, 1]));
        assert_eq!(coalesce(&[1, 1], &[5, 5], &[3, 3]).0, vec![1]);
    }
}
