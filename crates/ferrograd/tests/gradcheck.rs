//! Finite-difference checks of the core ops' backward rules, in f64: central differences
//! (eps 1e-6) of `sum(f(x) * w)` against autograd, for every input, including broadcasting,
//! batched and transposed matmul, strided views and inputs used more than once.

mod common;

use common::{away64, gradcheck, pos64, randn64};
use ferrograd::ops::GeluApprox;

// ---- elementwise ----------------------------------------------------------------------------

#[test]
fn add_broadcast() {
    gradcheck(
        "add (2,3,4)+(4)",
        |x| x[0].add(&x[1]),
        &[randn64(&[2, 3, 4], 1), randn64(&[4], 2)],
    );
    gradcheck(
        "add (2,1,4)+(3,1)",
        |x| x[0].add(&x[1]),
        &[randn64(&[2, 1, 4], 3), randn64(&[3, 1], 4)],
    );
    gradcheck(
        "add ()+(2,3)",
        |x| x[0].add(&x[1]),
        &[randn64(&[], 5), randn64(&[2, 3], 6)],
    );
}

#[test]
fn sub_broadcast() {
    gradcheck(
        "sub (3,4)-(4)",
        |x| x[0].sub(&x[1]),
        &[randn64(&[3, 4], 1), randn64(&[4], 2)],
    );
    gradcheck(
        "sub (1,4)-(3,1)",
        |x| x[0].sub(&x[1]),
        &[randn64(&[1, 4], 3), randn64(&[3, 1], 4)],
    );
}

#[test]
fn mul_broadcast() {
    gradcheck(
        "mul (2,3,4)*(3,1)",
        |x| x[0].mul(&x[1]),
        &[randn64(&[2, 3, 4], 1), randn64(&[3, 1], 2)],
    );
    gradcheck("mul x*x", |x| x[0].mul(&x[0]), &[randn64(&[3, 4], 3)]);
}

#[test]
fn div_broadcast() {
    gradcheck(
        "div (3,4)/(4)",
        |x| x[0].div(&x[1]),
        &[randn64(&[3, 4], 1), pos64(&[4], 2)],
    );
    gradcheck(
        "div (4)/(3,4)",
        |x| x[0].div(&x[1]),
        &[randn64(&[4], 3), pos64(&[3, 4], 4)],
    );
}

#[test]
fn pow_tensor_and_scalar() {
    gradcheck(
        "pow a^b",
        |x| x[0].pow(&x[1]),
        &[pos64(&[3, 4], 1), randn64(&[3, 4], 2)],
    );
    gradcheck(
        "pow a^b bcast",
        |x| x[0].pow(&x[1]),
        &[pos64(&[3, 4], 3), randn64(&[4], 4)],
    );
    gradcheck(
        "pow_scalar 3",
        |x| x[0].pow_scalar(3.0),
        &[randn64(&[3, 4], 5)],
    );
    gradcheck(
        "pow_scalar -0.5",
        |x| x[0].pow_scalar(-0.5),
        &[pos64(&[3, 4], 6)],
    );
}

#[test]
fn scalar_ops() {
    gradcheck("neg", |x| x[0].neg(), &[randn64(&[3, 4], 1)]);
    gradcheck(
        "add_scalar",
        |x| x[0].add_scalar(2.5),
        &[randn64(&[3, 4], 2)],
    );
    gradcheck(
        "sub_scalar",
        |x| x[0].sub_scalar(0.5),
        &[randn64(&[3, 4], 3)],
    );
    gradcheck(
        "mul_scalar",
        |x| x[0].mul_scalar(-1.5),
        &[randn64(&[3, 4], 4)],
    );
    gradcheck(
        "div_scalar",
        |x| x[0].div_scalar(4.0),
        &[randn64(&[3, 4], 5)],
    );
}

#[test]
fn unary() {
    gradcheck("exp", |x| x[0].exp(), &[randn64(&[3, 4], 1)]);
    gradcheck("log", |x| x[0].log(), &[pos64(&[3, 4], 2)]);
    gradcheck("sqrt", |x| x[0].sqrt(), &[pos64(&[3, 4], 3)]);
    gradcheck("tanh", |x| x[0].tanh(), &[randn64(&[3, 4], 4)]);
    gradcheck("sigmoid", |x| x[0].sigmoid(), &[randn64(&[3, 4], 5)]);
    gradcheck("relu", |x| x[0].relu(), &[away64(&[3, 4], 6)]);
    gradcheck(
        "gelu tanh",
        |x| x[0].gelu(GeluApprox::Tanh),
        &[randn64(&[3, 4], 7)],
    );
    gradcheck(
        "gelu erf",
        |x| x[0].gelu(GeluApprox::None),
        &[randn64(&[3, 4], 8)],
    );
}

#[test]
fn unary_on_strided_views() {
    // The kernels walk strided inputs row by row; the gradients must land in the right places.
    gradcheck(
        "exp of transpose",
        |x| x[0].t()?.exp(),
        &[randn64(&[3, 4], 1)],
    );
    gradcheck(
        "tanh of narrow",
        |x| x[0].narrow(1, 1, 2)?.tanh(),
        &[randn64(&[3, 4], 2)],
    );
    gradcheck(
        "relu of expand",
        |x| x[0].expand(&[3, 4])?.relu(),
        &[away64(&[3, 1], 3)],
    );
}

// ---- matmul and linear ------------------------------------------------------------------------

#[test]
fn matmul_shapes() {
    gradcheck(
        "matmul 2d",
        |x| x[0].matmul(&x[1]),
        &[randn64(&[3, 4], 1), randn64(&[4, 5], 2)],
    );
    gradcheck(
        "matmul batched",
        |x| x[0].matmul(&x[1]),
        &[randn64(&[2, 3, 4], 3), randn64(&[2, 4, 5], 4)],
    );
    gradcheck(
        "matmul (2,3,4)@(4,5)",
        |x| x[0].matmul(&x[1]),
        &[randn64(&[2, 3, 4], 5), randn64(&[4, 5], 6)],
    );
    gradcheck(
        "matmul (3,4)@(2,4,5)",
        |x| x[0].matmul(&x[1]),
        &[randn64(&[3, 4], 7), randn64(&[2, 4, 5], 8)],
    );
    gradcheck(
        "matmul (2,1,3,4)@(3,4,2)",
        |x| x[0].matmul(&x[1]),
        &[randn64(&[2, 1, 3, 4], 9), randn64(&[3, 4, 2], 10)],
    );
    gradcheck(
        "matmul vec@mat",
        |x| x[0].matmul(&x[1]),
        &[randn64(&[4], 11), randn64(&[4, 5], 12)],
    );
    gradcheck(
        "matmul mat@vec",
        |x| x[0].matmul(&x[1]),
        &[randn64(&[3, 4], 13), randn64(&[4], 14)],
    );
    gradcheck(
        "matmul vec@batch",
        |x| x[0].matmul(&x[1]),
        &[randn64(&[4], 15), randn64(&[2, 4, 5], 16)],
    );
    gradcheck(
        "matmul vec@vec",
        |x| x[0].matmul(&x[1]),
        &[randn64(&[4], 17), randn64(&[4], 18)],
    );
}

#[test]
fn matmul_transposed_operands() {
    gradcheck(
        "a @ b.t()",
        |x| x[0].matmul(&x[1].t()?),
        &[randn64(&[3, 4], 1), randn64(&[5, 4], 2)],
    );
    gradcheck(
        "a.t() @ b",
        |x| x[0].t()?.matmul(&x[1]),
        &[randn64(&[4, 3], 3), randn64(&[4, 5], 4)],
    );
    gradcheck(
        "batched a @ b^T",
        |x| x[0].matmul(&x[1].transpose(-1, -2)?),
        &[randn64(&[2, 3, 4], 5), randn64(&[2, 5, 4], 6)],
    );
    // A permuted (non-contiguous) 3-D operand takes the general batched path.
    gradcheck(
        "permuted (3,2,4)->(2,3,4) @ (4,5)",
        |x| x[0].permute(&[1, 0, 2])?.matmul(&x[1]),
        &[randn64(&[3, 2, 4], 7), randn64(&[4, 5], 8)],
    );
}

#[test]
fn linear_variants() {
    let (x, w, b) = (randn64(&[4, 6], 1), randn64(&[5, 6], 2), randn64(&[5], 3));
    gradcheck(
        "linear with bias",
        |x| x[0].linear(&x[1], Some(&x[2])),
        &[x.clone(), w.clone(), b],
    );
    gradcheck("linear no bias", |x| x[0].linear(&x[1], None), &[x, w]);
    gradcheck(
        "linear 3-d input",
        |x| x[0].linear(&x[1], Some(&x[2])),
        &[
            randn64(&[2, 3, 6], 4),
            randn64(&[5, 6], 5),
            randn64(&[5], 6),
        ],
    );
    gradcheck(
        "linear strided input",
        |x| x[0].t()?.linear(&x[1], Some(&x[2])),
        &[randn64(&[6, 4], 7), randn64(&[5, 6], 8), randn64(&[5], 9)],
    );
}

#[test]
fn mlp_gelu_every_input() {
    // x (2, 3, 4) → 6 hidden → 5 out.
    let inputs = [
        randn64(&[2, 3, 4], 11),
        randn64(&[6, 4], 12),
        randn64(&[6], 13),
        randn64(&[5, 6], 14),
        randn64(&[5], 15),
    ];
    gradcheck(
        "mlp_gelu",
        |x| x[0].mlp_gelu(&x[1], &x[2], &x[3], &x[4]),
        &inputs,
    );
}

// ---- reductions -----------------------------------------------------------------------------

#[test]
fn sums_and_means() {
    let x = || randn64(&[2, 3, 4], 1);
    gradcheck("sum_all", |x| x[0].sum_all(), &[x()]);
    gradcheck("sum dim 1", |x| x[0].sum(&[1], false), &[x()]);
    gradcheck("sum dim -1 keep", |x| x[0].sum(&[-1], true), &[x()]);
    gradcheck("sum dims 0,2", |x| x[0].sum(&[0, 2], false), &[x()]);
    gradcheck("mean dim 0", |x| x[0].mean(&[0], false), &[x()]);
    gradcheck("mean dims 1,2 keep", |x| x[0].mean(&[1, 2], true), &[x()]);
    gradcheck("mean_all", |x| x[0].mean_all(), &[x()]);
    gradcheck(
        "sum of transpose",
        |x| x[0].transpose(0, 2)?.sum(&[1], false),
        &[x()],
    );
}

#[test]
fn zero_dim_reductions() {
    // A 0-dim tensor takes dim 0 or -1 and has nothing to reduce (PyTorch).
    let x = || randn64(&[], 1);
    gradcheck("sum dim 0 of ()", |x| x[0].sum(&[0], false), &[x()]);
    gradcheck("mean dim -1 of ()", |x| x[0].mean(&[-1], true), &[x()]);
    gradcheck("max dim 0 of ()", |x| Ok(x[0].max_dim(0, true)?.0), &[x()]);
}

#[test]
fn max_dim() {
    let x = || randn64(&[2, 3, 4], 1);
    gradcheck("max dim 1", |x| Ok(x[0].max_dim(1, false)?.0), &[x()]);
    gradcheck("max dim -1 keep", |x| Ok(x[0].max_dim(-1, true)?.0), &[x()]);
    gradcheck(
        "max dim 0 of permute",
        |x| Ok(x[0].permute(&[2, 0, 1])?.max_dim(0, false)?.0),
        &[x()],
    );
}

#[test]
fn mse_loss() {
    gradcheck(
        "mse_loss",
        |x| x[0].mse_loss(&x[1]),
        &[randn64(&[3, 4], 1), randn64(&[3, 4], 2)],
    );
}

// ---- movement -------------------------------------------------------------------------------

#[test]
fn views() {
    let x = || randn64(&[2, 3, 4], 1);
    gradcheck(
        "transpose contiguous",
        |x| x[0].transpose(0, 2)?.contiguous(),
        &[x()],
    );
    gradcheck("permute", |x| x[0].permute(&[1, 2, 0]), &[x()]);
    gradcheck("narrow", |x| x[0].narrow(2, 1, 2), &[x()]);
    gradcheck("reshape", |x| x[0].reshape(&[4, 6]), &[x()]);
    gradcheck("reshape_infer", |x| x[0].reshape_infer(&[-1, 2]), &[x()]);
    gradcheck(
        "expand",
        |x| x[0].expand(&[2, 3, 4]),
        &[randn64(&[3, 1], 2)],
    );
    gradcheck(
        "unsqueeze/squeeze",
        |x| x[0].unsqueeze(1)?.mul_scalar(2.0)?.squeeze(1),
        &[x()],
    );
}

#[test]
fn view_chains() {
    let x = || randn64(&[3, 6], 1);
    gradcheck(
        "narrow->permute->expand",
        |x| x[0].narrow(1, 2, 3)?.t()?.unsqueeze(0)?.expand(&[2, 3, 3]),
        &[x()],
    );
    gradcheck(
        "permute->reshape (copy)",
        |x| x[0].t()?.reshape(&[2, 9]),
        &[x()],
    );
    gradcheck(
        "narrow twice then mul",
        |x| {
            x[0].narrow(0, 1, 2)?
                .narrow(1, 1, 4)?
                .mul(&x[0].narrow(0, 0, 2)?.narrow(1, 0, 4)?)
        },
        &[x()],
    );
    gradcheck(
        "expand then sum over other dim",
        |x| x[0].expand(&[3, 4])?.sum(&[0], false),
        &[randn64(&[3, 1], 2)],
    );
}

// ---- graphs ---------------------------------------------------------------------------------

#[test]
fn shared_inputs_and_diamonds() {
    // x feeds two branches that meet again: gradients from both must be summed.
    gradcheck(
        "diamond",
        |x| x[0].exp()?.mul(&x[0].tanh()?)?.add(&x[0]),
        &[randn64(&[3, 4], 1)],
    );
    gradcheck(
        "mlp",
        |x| {
            x[0].linear(&x[1], Some(&x[2]))?
                .tanh()?
                .linear(&x[3], None)?
                .sum(&[1], false)
        },
        &[
            randn64(&[4, 3], 2),
            randn64(&[5, 3], 3),
            randn64(&[5], 4),
            randn64(&[2, 5], 5),
        ],
    );
    gradcheck(
        "sigmoid chain",
        |x| x[0].sigmoid()?.mul(&x[1])?.tanh()?.sum(&[0], false),
        &[randn64(&[3, 4], 6), randn64(&[3, 4], 7)],
    );
}
