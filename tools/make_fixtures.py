"""Generate golden fixtures for ferrograd's op tests from PyTorch.

For every op case this computes, in float32 with PyTorch on the CPU, the
forward output and the gradients of ``(out * gout).sum()`` with respect to
each float input, and writes them all to one safetensors file that the Rust
tests compare against.

How to run it (from the repository root, in a venv with
``pip install torch==2.11.0 safetensors numpy``)::

    python tools/make_fixtures.py

It writes ``tests/fixtures/ops.safetensors``.

File format (the Rust tests rely on it exactly):

* ``__metadata__``: {"format": "ferrograd-fixtures", "version": "1",
  "torch_version": torch.__version__, "generator": "tools/make_fixtures.py"}.
* For each case NAME:
  - ``NAME.in0``, ``NAME.in1``, ...: the inputs, in order;
  - ``NAME.out``: the forward output (``NAME.out0``, ``NAME.out1``, ... for
    cases with several outputs);
  - ``NAME.gout``: the upstream gradient, same shape as the output, random
    normal (``NAME.gout0``, ``NAME.gout1``, ... for several outputs);
  - ``NAME.grad0``, ``NAME.grad1``, ...: the gradient of
    ``sum_i (out_i * gout_i).sum()`` with respect to input ``NAME.inK``, for
    float inputs only (integer and mask inputs get no grad key).
* Float tensors are float32, integer tensors (indices, targets) are int64,
  masks/conditions are uint8 (0/1). Scalar outputs (losses) are 0-dim.

Generation is deterministic: torch.manual_seed(0), every random tensor is
drawn as float64 normal and then cast to float32; all computation is float32.
"""

import os
import sys

import torch
import torch.nn.functional as F
from stable_safetensors import serialize

OUT_PATH = os.path.join("tests", "fixtures", "ops.safetensors")

torch.manual_seed(0)
torch.set_num_threads(1)
torch.use_deterministic_algorithms(True)


def randn(*shape):
    """Random normal, drawn in float64 then cast to float32."""
    return torch.randn(tuple(shape), dtype=torch.float64).to(torch.float32)


def pos(*shape):
    """Strictly positive input: |x| + 0.5."""
    return randn(*shape).abs() + 0.5


def mask(*shape):
    """Random 0/1 mask stored as uint8 (drawn from the same float64 stream)."""
    return (torch.randn(tuple(shape), dtype=torch.float64) > 0).to(torch.uint8)


def idx(values):
    return torch.tensor(values, dtype=torch.int64)


TENSORS = {}
CASES = []


def put(key, t):
    assert key not in TENSORS, key
    # A fresh contiguous copy: safetensors refuses views and shared storage.
    TENSORS[key] = t.detach().contiguous().clone()


def case(name, inputs, fn):
    """Record one case.

    inputs: list of tensors. Float tensors become leaves that require grad;
    int64 / uint8 tensors are passed as they are (uint8 masks are handed to
    ``fn`` as bool tensors).
    fn: takes the prepared inputs, returns a tensor or a tuple of tensors.
    """
    assert name not in CASES, name
    CASES.append(name)
    prepared = []
    for i, t in enumerate(inputs):
        put(f"{name}.in{i}", t)
        if t.dtype == torch.float32:
            prepared.append(t.clone().requires_grad_(True))
        elif t.dtype == torch.uint8:
            prepared.append(t.to(torch.bool))
        elif t.dtype == torch.int64:
            prepared.append(t.clone())
        else:
            raise TypeError(f"{name}.in{i}: unexpected dtype {t.dtype}")

    out = fn(*prepared)
    multi = isinstance(out, (tuple, list))
    outs = list(out) if multi else [out]
    gouts = [randn(*o.shape) for o in outs]

    loss = sum((o * g).sum() for o, g in zip(outs, gouts))
    grad_inputs = [p for p in prepared if p.dtype == torch.float32]
    grads = torch.autograd.grad(loss, grad_inputs, allow_unused=True)
    grads = iter(grads)

    for k, (o, g) in enumerate(zip(outs, gouts)):
        assert o.dtype == torch.float32, f"{name}: output dtype {o.dtype}"
        suffix = str(k) if multi else ""
        put(f"{name}.out{suffix}", o)
        put(f"{name}.gout{suffix}", g)
    for i, p in enumerate(prepared):
        if p.dtype == torch.float32:
            gr = next(grads)
            if gr is None:
                gr = torch.zeros_like(p)
            assert gr.shape == p.shape
            put(f"{name}.grad{i}", gr)


# ---------------------------------------------------------------- elementwise
case("add_bcast", [randn(2, 3, 4), randn(4)], lambda a, b: a + b)
case("add_bcast2", [randn(2, 1, 4), randn(3, 1)], lambda a, b: a + b)
case("sub_bcast", [randn(3, 4), randn(4)], lambda a, b: a - b)
case("mul_bcast", [randn(2, 3, 4), randn(3, 1)], lambda a, b: a * b)
case("div_bcast", [randn(3, 4), pos(4)], lambda a, b: a / b)
case("neg", [randn(3, 4)], lambda a: -a)
case("add_scalar", [randn(3, 4)], lambda a: a + 2.5)
case("mul_scalar", [randn(3, 4)], lambda a: a * -1.5)
case("pow_scalar", [pos(3, 4)], lambda a: a ** 3.0)
case("pow_tensor", [pos(3, 4), randn(3, 4)], lambda a, b: a ** b)
case("exp", [randn(3, 4)], torch.exp)
case("log", [pos(3, 4)], torch.log)
case("sqrt", [pos(3, 4)], torch.sqrt)
case("tanh", [randn(3, 4)], torch.tanh)
case("sigmoid", [randn(3, 4)], torch.sigmoid)
case("relu", [randn(3, 4)], torch.relu)
case("gelu_tanh", [randn(3, 4)], lambda a: F.gelu(a, approximate="tanh"))
case("gelu_erf", [randn(3, 4)], lambda a: F.gelu(a))

# ---------------------------------------------------------------- matmul
case("matmul_2d", [randn(3, 4), randn(4, 5)], lambda a, b: a @ b)
case("matmul_batched", [randn(2, 3, 4), randn(2, 4, 5)], lambda a, b: a @ b)
case("matmul_bcast", [randn(2, 3, 4), randn(4, 5)], lambda a, b: a @ b)
case("matmul_transposed", [randn(3, 4), randn(5, 4)], lambda a, b: a @ b.t())

# ---------------------------------------------------------------- reductions
case("sum_all", [randn(3, 4)], lambda a: a.sum())
case("sum_dim", [randn(2, 3, 4)], lambda a: a.sum(dim=1))
case("sum_dim_keep", [randn(2, 3, 4)], lambda a: a.sum(dim=2, keepdim=True))
case("mean_dim", [randn(2, 3, 4)], lambda a: a.mean(dim=0))
case("mean_all", [randn(3, 4)], lambda a: a.mean())


def max_dim(a):
    # Random normal has no ties in practice; make sure.
    top2 = a.detach().topk(2, dim=1).values
    assert (top2[:, 0] != top2[:, 1]).all(), "max_dim: tie in input"
    return a.max(dim=1).values


case("max_dim", [randn(2, 3, 4)], max_dim)

# ---------------------------------------------------------------- softmax & losses
case("softmax", [randn(2, 3, 5)], lambda a: F.softmax(a, dim=-1))
case("softmax_dim1", [randn(2, 3, 5)], lambda a: F.softmax(a, dim=1))
case("log_softmax", [randn(2, 3, 5)], lambda a: F.log_softmax(a, dim=-1))
case(
    "cross_entropy",
    [randn(4, 5), idx([1, 0, 4, -100])],
    lambda x, t: F.cross_entropy(x, t, ignore_index=-100, reduction="mean"),
)
case("mse_loss", [randn(3, 4), randn(3, 4)], lambda a, b: F.mse_loss(a, b))

# ---------------------------------------------------------------- nn ops
case(
    "layer_norm",
    [randn(2, 3, 8), randn(8), randn(8)],
    lambda x, w, b: F.layer_norm(x, (8,), w, b, eps=1e-5),
)
case(
    "embedding",
    [idx([[1, 3, 1], [0, 9, 3]]), randn(10, 4)],
    lambda i, w: F.embedding(i, w),
)
case("linear", [randn(4, 6), randn(5, 6), randn(5)], lambda x, w, b: F.linear(x, w, b))

# ---------------------------------------------------------------- shape ops
case("cat", [randn(2, 3), randn(2, 2)], lambda a, b: torch.cat([a, b], dim=1))
case("split", [randn(2, 5)], lambda a: torch.split(a, [2, 3], dim=1))
case("masked_fill", [randn(3, 4), mask(3, 4)], lambda a, m: a.masked_fill(m, -2.0))
case("where", [mask(3, 4), randn(3, 4), randn(3, 4)], lambda c, a, b: torch.where(c, a, b))
case("transpose_contig", [randn(2, 3, 4)], lambda a: a.transpose(0, 2).contiguous())
case("permute", [randn(2, 3, 4)], lambda a: a.permute(1, 2, 0))
case("narrow", [randn(3, 6)], lambda a: a.narrow(1, 2, 3))
case("expand", [randn(3, 1)], lambda a: a.expand(3, 4))
case("reshape", [randn(2, 6)], lambda a: a.reshape(3, 4))

# ---------------------------------------------------------------- composite
case(
    "sigmoid_chain",
    [randn(3, 4), randn(3, 4)],
    lambda a, b: torch.tanh(torch.sigmoid(a) * b).sum(dim=0),
)


def main():
    metadata = {
        "format": "ferrograd-fixtures",
        "version": "1",
        "torch_version": str(torch.__version__),
        "generator": "tools/make_fixtures.py",
    }
    os.makedirs(os.path.dirname(OUT_PATH), exist_ok=True)
    with open(OUT_PATH, "wb") as f:
        f.write(serialize(TENSORS, metadata))
    size = os.path.getsize(OUT_PATH)
    print(f"wrote {OUT_PATH}: {len(CASES)} cases, {len(TENSORS)} tensors, {size} bytes")
    if size >= 200 * 1024:
        sys.exit("fixture file is too large (>= 200 KB)")


if __name__ == "__main__":
    main()
