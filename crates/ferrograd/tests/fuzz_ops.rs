//! A property-based fuzz target over the op API (proptest, a bounded number of cases so CI
//! stays fast). Each case draws an input (shape of rank 0 to 3 with sizes 0 to 4, so zero-size
//! tensors and size-1 dims that broadcast are common; any CPU dtype; a NaN or an infinity in
//! a quarter of the float inputs) and a chain of up to six
//! ops with raw parameters (dims, starts, lengths and operand shapes that may be out of range
//! or incompatible), runs the chain, then backward. Properties:
//! - no panic and no abort, whatever the parameters;
//! - an op the reference model calls valid succeeds, and one it calls invalid fails with a
//!   typed shape, index or argument error;
//! - every float result equals the plain f64 reference (reference/ below) applied to the
//!   op's actual input, rounded once to the dtype, within a tolerance of a few units of that
//!   dtype's precision;
//! - backward gives every input a gradient of its shape and dtype; in f64, smooth chains'
//!   gradients match central differences of the reference;
//! - `memory_allocated` is back to its starting value after every case.
//!
//! One test in its own binary, so no other test allocates while a case measures. Set
//! FERROGRAD_FUZZ_CASES to run more cases than the default.

#[path = "fuzz_ops/reference.rs"]
mod reference;

use ferrograd::memory::memory_allocated;
use ferrograd::{DType, Device, Error, Generator, Tensor};
use half::{bf16, f16};
use proptest::prelude::*;
use reference::Nd;

const CPU: Device = Device::Cpu;

#[derive(Clone, Debug)]
enum Op {
    Unary(u8),
    Scalar(u8, i8),
    /// A broadcast operand: each of the input's dims kept, set to 1 or dropped (leading),
    /// or (`clash`) one dim changed so the shapes cannot broadcast.
    Binary {
        kind: u8,
        pattern: Vec<u8>,
        clash: bool,
        seed: u64,
    },
    Sum {
        dims: Vec<i8>,
        keepdim: bool,
    },
    Mean {
        dims: Vec<i8>,
        keepdim: bool,
    },
    /// max_dim, or min_dim when `min`.
    Max {
        dim: i8,
        keepdim: bool,
        min: bool,
    },
    Transpose(i8, i8),
    Narrow {
        dim: i8,
        start: u8,
        len: u8,
    },
    Expand {
        lead: u8,
    },
    Flatten,
    Unsqueeze(i8),
    Softmax {
        dim: i8,
        log: bool,
    },
    LayerNorm,
    Matmul {
        n: u8,
        seed: u64,
    },
    Contiguous,
}

fn op_strategy() -> impl Strategy<Value = Op> {
    let dims = prop::collection::vec(-4i8..4, 0..3);
    prop_oneof![
        (0u8..5).prop_map(Op::Unary),
        (0u8..2, -3i8..4).prop_map(|(k, c)| Op::Scalar(k, c)),
        (
            0u8..3,
            prop::collection::vec(0u8..4, 0..4),
            prop::bool::weighted(0.15),
            any::<u64>()
        )
            .prop_map(|(kind, pattern, clash, seed)| Op::Binary {
                kind,
                pattern,
                clash,
                seed
            }),
        (dims.clone(), any::<bool>()).prop_map(|(dims, keepdim)| Op::Sum { dims, keepdim }),
        (dims, any::<bool>()).prop_map(|(dims, keepdim)| Op::Mean { dims, keepdim }),
        (-4i8..4, any::<bool>(), any::<bool>()).prop_map(|(dim, keepdim, min)| Op::Max {
            dim,
            keepdim,
            min
        }),
        (-4i8..4, -4i8..4).prop_map(|(a, b)| Op::Transpose(a, b)),
        (-4i8..4, 0u8..6, 0u8..6).prop_map(|(dim, start, len)| Op::Narrow { dim, start, len }),
        (0u8..3).prop_map(|lead| Op::Expand { lead }),
        Just(Op::Flatten),
        (-4i8..5).prop_map(Op::Unsqueeze),
        (-4i8..4, any::<bool>()).prop_map(|(dim, log)| Op::Softmax { dim, log }),
        Just(Op::LayerNorm),
        (0u8..4, any::<u64>()).prop_map(|(n, seed)| Op::Matmul { n, seed }),
        Just(Op::Contiguous),
    ]
}

const DTYPES: [DType; 6] = [
    DType::F32,
    DType::F64,
    DType::F16,
    DType::BF16,
    DType::I64,
    DType::U8,
];

/// Uniform values in [-2, 2) of `shape` stored as `dtype` (integers truncate to -2..=1).
fn input(shape: &[usize], dtype: DType, seed: u64) -> Tensor {
    let mut g = Generator::new(seed);
    Tensor::uniform_with(shape, -2.0, 2.0, dtype, CPU, &mut g).unwrap()
}

fn nd(t: &Tensor) -> Nd {
    Nd::new(t.shape(), t.to_vec::<f64>().unwrap())
}

fn round_to(dtype: DType, x: f64) -> f64 {
    match dtype {
        DType::F32 => x as f32 as f64,
        DType::F16 => f16::from_f64(x).to_f64(),
        DType::BF16 => bf16::from_f64(x).to_f64(),
        _ => x,
    }
}

/// Relative precision allowed per op: a few units of the dtype's epsilon.
fn tolerance(dtype: DType) -> f64 {
    match dtype {
        DType::F64 => 1e-10,
        DType::F32 => 2e-5,
        DType::F16 => 1e-2,
        _ => 6e-2,
    }
}

/// `x` with its first element made NaN (poison 0), +inf (1) or -inf (2); others unchanged.
fn poisoned(x: Tensor, poison: u8) -> Tensor {
    let special = [f64::NAN, f64::INFINITY, f64::NEG_INFINITY];
    match special.get(poison as usize) {
        Some(&v) if x.numel() > 0 && x.dtype().is_float() => {
            let mut values = x.to_vec::<f64>().unwrap();
            values[0] = v;
            Tensor::from_vec_as(values, x.shape(), x.dtype(), CPU).unwrap()
        }
        _ => x,
    }
}

/// A dim seed resolved PyTorch-style against `rank` (-1 = last), or None when out of range.
fn dim_of(d: i8, rank: usize) -> Option<usize> {
    let r = rank.max(1) as i64;
    let d = if d < 0 { d as i64 + r } else { d as i64 };
    (0..r).contains(&d).then_some(d as usize)
}

/// The operand of a binary op: the input's shape with each dim kept, set to 1, or (leading
/// dims only) dropped, as `pattern` says; `clash` makes one dim incompatible.
fn operand_shape(shape: &[usize], pattern: &[u8], clash: bool) -> Vec<usize> {
    let mut out: Vec<usize> = shape
        .iter()
        .enumerate()
        .map(|(i, &n)| match pattern.get(i).copied().unwrap_or(0) {
            1 => 1,
            _ => n,
        })
        .collect();
    let drop = pattern
        .iter()
        .take_while(|&&p| p == 2)
        .count()
        .min(out.len());
    out.drain(..drop);
    if clash {
        match out.iter_mut().find(|n| **n > 1) {
            Some(n) => *n += 1,
            None => out.push(7),
        }
    }
    out
}

/// What one op did: its output and the reference's, or an error the reference expected.
enum Step {
    Done(Tensor, Nd),
    Refused,
}

/// Applies `op` to `x` (whose values are `r`), checking validity against the reference.
/// `operands` collects the values of any operand drawn, for replaying the chain.
fn apply(op: &Op, x: &Tensor, r: &Nd, operands: &mut Vec<Nd>) -> Result<Step, TestCaseError> {
    let rank = r.shape.len();
    let float = x.dtype().is_float();
    // The operand drawn, kept for the replay only if the op runs.
    let mut drawn = None;
    let (got, want): (ferrograd::Result<Tensor>, Option<Nd>) = match op {
        Op::Unary(k) => {
            let (t, f): (_, fn(f64) -> f64) = match k {
                0 => (x.neg(), |v| -v),
                1 => (x.tanh(), f64::tanh),
                2 => (x.sigmoid(), |v| 1.0 / (1.0 + (-v).exp())),
                3 => (x.relu(), |v| v.max(0.0)),
                _ => (x.exp(), f64::exp),
            };
            (t, float.then(|| r.map(f)))
        }
        Op::Scalar(k, c) => {
            let c = *c as f64;
            match k {
                0 => (x.add_scalar(c), float.then(|| r.map(|v| v + c))),
                _ => (x.mul_scalar(c), float.then(|| r.map(|v| v * c))),
            }
        }
        Op::Binary {
            kind,
            pattern,
            clash,
            seed,
        } => {
            let shape = operand_shape(&r.shape, pattern, *clash);
            let y = input(&shape, x.dtype(), *seed);
            let ry = nd(&y);
            let f: fn(f64, f64) -> f64 = match kind {
                0 => |a, b| a + b,
                1 => |a, b| a - b,
                _ => |a, b| a * b,
            };
            let t = match kind {
                0 => x.add(&y),
                1 => x.sub(&y),
                _ => x.mul(&y),
            };
            let want = if float { r.zip(&ry, f) } else { None };
            drawn = Some(ry);
            (t, want)
        }
        Op::Sum { dims, keepdim } | Op::Mean { dims, keepdim } => {
            let resolved: Option<Vec<usize>> = dims.iter().map(|&d| dim_of(d, rank)).collect();
            let isize_dims: Vec<isize> = dims.iter().map(|&d| d as isize).collect();
            let mean = matches!(op, Op::Mean { .. });
            let t = if mean {
                x.mean(&isize_dims, *keepdim)
            } else {
                x.sum(&isize_dims, *keepdim)
            };
            let want = resolved
                .filter(|d| unique(d))
                .filter(|_| float)
                .map(|mut d| {
                    d.retain(|&i| i < rank);
                    d.sort();
                    match (mean, d.is_empty()) {
                        (_, true) => r.clone(),
                        (true, false) => r.mean(&d, *keepdim),
                        (false, false) => r.sum(&d, *keepdim),
                    }
                });
            (t, want)
        }
        Op::Max { dim, keepdim, min } => {
            let t = if *min {
                x.min_dim(*dim as isize, *keepdim)
            } else {
                x.max_dim(*dim as isize, *keepdim)
            };
            let want = dim_of(*dim, rank)
                .filter(|_| float)
                .and_then(|d| match rank {
                    0 => Some(r.clone()),
                    _ if r.shape[d] == 0 => None,
                    _ if *min => Some(r.map(|v| -v).max(d, *keepdim).map(|v| -v)),
                    _ => Some(r.max(d, *keepdim)),
                });
            (t.map(|(v, _)| v), want)
        }
        Op::Transpose(a, b) => {
            let t = x.transpose(*a as isize, *b as isize);
            let want = match (dim_of(*a, rank), dim_of(*b, rank)) {
                (Some(_), Some(_)) if rank == 0 => Some(r.clone()),
                (Some(a), Some(b)) => Some(r.transpose(a, b)),
                _ => None,
            };
            (t, want)
        }
        Op::Narrow { dim, start, len } => {
            let (start, len) = (*start as usize, *len as usize);
            let t = x.narrow(*dim as isize, start, len);
            let want = dim_of(*dim, rank)
                .filter(|&d| rank > 0 && start + len <= r.shape[d])
                .map(|d| r.narrow(d, start, len));
            (t, want)
        }
        Op::Expand { lead } => {
            // A leading dim of `lead` and every size-1 dim stretched to 3.
            let mut shape = vec![*lead as usize];
            shape.extend(r.shape.iter().map(|&n| if n == 1 { 3 } else { n }));
            (x.expand(&shape), Some(r.broadcast_to(&shape)))
        }
        Op::Flatten => (x.reshape_infer(&[-1]), Some(r.reshape(&[r.data.len()]))),
        Op::Unsqueeze(d) => {
            let t = x.unsqueeze(*d as isize);
            let want = dim_of(*d, rank + 1).map(|d| {
                let mut shape = r.shape.clone();
                shape.insert(d, 1);
                r.reshape(&shape)
            });
            (t, want)
        }
        Op::Softmax { dim, log } => {
            let t = if *log {
                x.log_softmax(*dim as isize)
            } else {
                x.softmax(*dim as isize)
            };
            let want = dim_of(*dim, rank).filter(|_| float).map(|d| match rank {
                0 => r.reshape(&[1]).softmax(0, *log).reshape(&[]),
                _ => r.softmax(d, *log),
            });
            (t, want)
        }
        Op::LayerNorm => {
            let last = r.shape.last().copied();
            let t = x.layer_norm(&last.into_iter().collect::<Vec<_>>(), None, None, 1e-5);
            let want = last.filter(|_| float).map(|_| r.layer_norm_last(1e-5));
            (t, want)
        }
        Op::Matmul { n, seed } => {
            let k = r.shape.last().copied().unwrap_or(0);
            let y = input(&[k, *n as usize], x.dtype(), *seed);
            let ry = nd(&y);
            let want = (rank == 2 && float).then(|| r.matmul(&ry));
            // Only (m, k) @ (k, n) is checked against the reference; other ranks must not
            // panic, whatever they answer.
            if rank != 2 && float {
                let _ = x.matmul(&y);
                operands.push(ry);
                return Ok(Step::Done(x.clone(), r.clone()));
            }
            drawn = Some(ry);
            (x.matmul(&y), want)
        }
        Op::Contiguous => (x.contiguous(), Some(r.clone())),
    };
    match (got, want) {
        (Ok(t), Some(w)) => {
            check_close(op, &t, &w)?;
            operands.extend(drawn);
            Ok(Step::Done(t.clone(), nd(&t)))
        }
        (Err(e), None) => {
            prop_assert!(
                matches!(
                    e,
                    Error::Shape { .. }
                        | Error::Index { .. }
                        | Error::InvalidArgument { .. }
                        | Error::UnsupportedDType { .. }
                ),
                "{op:?}: untyped or unexpected error {e:?}"
            );
            Ok(Step::Refused)
        }
        (Ok(t), None) if !float => {
            operands.extend(drawn);
            Ok(Step::Done(t.clone(), nd(&t)))
        }
        (Ok(t), None) => Err(TestCaseError::fail(format!(
            "{op:?} on {:?} should have been refused, gave {:?}",
            r.shape,
            t.shape()
        ))),
        (Err(e), Some(_)) => Err(TestCaseError::fail(format!(
            "{op:?} on {:?} {:?} failed: {e}",
            r.shape,
            x.dtype()
        ))),
    }
}

fn unique(d: &[usize]) -> bool {
    let mut s = d.to_vec();
    s.sort();
    s.windows(2).all(|w| w[0] != w[1])
}

fn check_close(op: &Op, got: &Tensor, want: &Nd) -> Result<(), TestCaseError> {
    prop_assert_eq!(got.shape(), &want.shape[..], "{:?}: shape", op);
    let dtype = got.dtype();
    let values = got.to_vec::<f64>().unwrap();
    let scale = want
        .data
        .iter()
        .filter(|v| v.is_finite())
        .fold(1.0f64, |m, v| m.max(v.abs()));
    let tol = tolerance(dtype) * scale;
    for (i, (&g, &w)) in values.iter().zip(&want.data).enumerate() {
        let w = round_to(dtype, w);
        let same = g == w || (g.is_nan() && w.is_nan()) || (g - w).abs() <= tol;
        prop_assert!(
            same,
            "{:?} element {}: got {}, want {} ({:?})",
            op,
            i,
            g,
            w,
            dtype
        );
    }
    Ok(())
}

/// Replays the chain on the reference alone (for finite differences).
fn replay(ops: &[Op], x: &Nd, operands: &[Nd]) -> Option<Nd> {
    let mut r = x.clone();
    let mut next = operands.iter();
    for op in ops {
        let rank = r.shape.len();
        r = match op {
            Op::Unary(k) => r.map(match k {
                0 => |v: f64| -v,
                1 => f64::tanh,
                2 => |v: f64| 1.0 / (1.0 + (-v).exp()),
                3 => |v: f64| v.max(0.0),
                _ => f64::exp,
            }),
            Op::Scalar(0, c) => r.map(|v| v + *c as f64),
            Op::Scalar(_, c) => r.map(|v| v * *c as f64),
            Op::Binary { kind, .. } => {
                let y = next.next()?;
                r.zip(
                    y,
                    match kind {
                        0 => |a, b| a + b,
                        1 => |a, b| a - b,
                        _ => |a, b| a * b,
                    },
                )?
            }
            Op::Sum { dims, keepdim } | Op::Mean { dims, keepdim } => {
                let mut d: Vec<usize> = dims
                    .iter()
                    .map(|&d| dim_of(d, rank))
                    .collect::<Option<_>>()?;
                d.retain(|&i| i < rank);
                d.sort();
                match (matches!(op, Op::Mean { .. }), d.is_empty()) {
                    (_, true) => r,
                    (true, false) => r.mean(&d, *keepdim),
                    (false, false) => r.sum(&d, *keepdim),
                }
            }
            Op::Transpose(a, b) if rank > 0 => r.transpose(dim_of(*a, rank)?, dim_of(*b, rank)?),
            Op::Transpose(..) | Op::Contiguous => r,
            Op::Narrow { dim, start, len } => {
                r.narrow(dim_of(*dim, rank)?, *start as usize, *len as usize)
            }
            Op::Expand { lead } => {
                let mut shape = vec![*lead as usize];
                shape.extend(r.shape.iter().map(|&n| if n == 1 { 3 } else { n }));
                r.broadcast_to(&shape)
            }
            Op::Flatten => r.reshape(&[r.data.len()]),
            Op::Unsqueeze(d) => {
                let mut shape = r.shape.clone();
                shape.insert(dim_of(*d, rank + 1)?, 1);
                r.reshape(&shape)
            }
            Op::Softmax { dim, log } if rank > 0 => r.softmax(dim_of(*dim, rank)?, *log),
            Op::LayerNorm => r.layer_norm_last(1e-5),
            Op::Matmul { .. } => {
                let y = next.next()?;
                if rank == 2 { r.matmul(y) } else { r }
            }
            Op::Max { .. } | Op::Softmax { .. } => return None,
        };
    }
    Some(r)
}

/// Central differences of sum(chain(x)) at a few elements against the library's gradient.
fn check_gradient(ops: &[Op], x: &Nd, operands: &[Nd], grad: &[f64]) -> Result<(), TestCaseError> {
    let smooth = ops
        .iter()
        .all(|op| !matches!(op, Op::Max { .. } | Op::Unary(3)));
    if !smooth || x.data.iter().any(|v| !v.is_finite()) {
        return Ok(());
    }
    let total = |x: &Nd| replay(ops, x, operands).map(|r| r.data.iter().sum::<f64>());
    let h = 1e-6;
    for i in (0..x.data.len()).step_by((x.data.len() / 3).max(1)) {
        let (mut up, mut down) = (x.clone(), x.clone());
        up.data[i] += h;
        down.data[i] -= h;
        let (Some(a), Some(b)) = (total(&up), total(&down)) else {
            return Ok(());
        };
        if !(a.is_finite() && b.is_finite()) || a.abs().max(b.abs()) > 1e6 {
            return Ok(());
        }
        let fd = (a - b) / (2.0 * h);
        tally(|t| t.gradients_vs_finite_differences += 1);
        prop_assert!(
            (fd - grad[i]).abs() <= 1e-4 * (1.0 + fd.abs()),
            "gradient of element {}: finite differences {}, backward {} ({:?})",
            i,
            fd,
            grad[i],
            ops
        );
    }
    Ok(())
}

/// One case: the chain, then backward.
fn run_case(
    shape: &[usize],
    dtype: DType,
    seed: u64,
    poison: u8,
    ops: &[Op],
) -> Result<(), TestCaseError> {
    let leaf = poisoned(input(shape, dtype, seed), poison);
    let leaf = if dtype.is_float() {
        leaf.requires_grad_(true).unwrap()
    } else {
        leaf
    };
    let r0 = nd(&leaf);
    let (mut x, mut r) = (leaf.clone(), r0.clone());
    let mut operands = Vec::new();
    let mut ran = Vec::new();
    for op in ops {
        match apply(op, &x, &r, &mut operands)? {
            Step::Done(t, rt) => {
                (x, r) = (t, rt);
                ran.push(op.clone());
                tally(|t| t.ops_run += 1);
            }
            // A refused op leaves the chain where it was.
            Step::Refused => tally(|t| t.ops_refused += 1),
        }
    }
    if !dtype.is_float() {
        return Ok(());
    }
    let loss = x
        .sum_all()
        .map_err(|e| TestCaseError::fail(format!("sum_all: {e}")))?;
    loss.backward()
        .map_err(|e| TestCaseError::fail(format!("backward after {ran:?}: {e}")))?;
    let grad = leaf
        .grad()
        .ok_or_else(|| TestCaseError::fail(format!("no gradient after {ran:?}")))?;
    prop_assert_eq!(grad.shape(), leaf.shape());
    prop_assert_eq!(grad.dtype(), dtype);
    tally(|t| t.backward_checked += 1);
    if dtype == DType::F64 {
        check_gradient(&ran, &r0, &operands, &grad.to_vec::<f64>().unwrap())?;
    }
    Ok(())
}

fn cases() -> u32 {
    std::env::var("FERROGRAD_FUZZ_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1000)
}

/// What the cases did, printed at the end (run with --nocapture to see it).
#[derive(Default, Debug)]
struct Tally {
    cases: usize,
    ops_run: usize,
    ops_refused: usize,
    zero_size_inputs: usize,
    backward_checked: usize,
    gradients_vs_finite_differences: usize,
}

static TALLY: std::sync::Mutex<Option<Tally>> = std::sync::Mutex::new(None);

fn tally(f: impl FnOnce(&mut Tally)) {
    f(TALLY.lock().unwrap().get_or_insert_with(Tally::default));
}

#[test]
fn op_chains_never_panic_match_the_reference_and_free_every_byte() {
    use proptest::test_runner::{Config, TestRunner};
    let mut runner = TestRunner::new(Config {
        cases: cases(),
        failure_persistence: None,
        ..Config::default()
    });
    let case = (
        prop::collection::vec(0usize..5, 0..4),
        prop::sample::select(&DTYPES[..]),
        any::<u64>(),
        0u8..12,
        prop::collection::vec(op_strategy(), 1..7),
    );
    let result = runner.run(&case, |(shape, dtype, seed, poison, ops)| {
        let before = memory_allocated(CPU).unwrap();
        run_case(&shape, dtype, seed, poison, &ops)?;
        prop_assert_eq!(
            memory_allocated(CPU).unwrap(),
            before,
            "bytes left after {:?}",
            ops
        );
        tally(|t| {
            t.cases += 1;
            t.zero_size_inputs += shape.contains(&0) as usize;
        });
        Ok(())
    });
    println!("{:?}", TALLY.lock().unwrap());
    if let Err(e) = result {
        panic!("{e}");
    }
}
