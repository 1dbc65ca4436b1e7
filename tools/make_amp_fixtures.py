"""Generate golden fixtures for ferrograd's autocast tests from PyTorch.

ferrograd's autocast follows PyTorch's **CUDA** op policy (matmul and linear in the region's
f16/bf16; softmax, log_softmax, layer_norm, cross_entropy, mse_loss, sum, exp, log, pow in
float32; everything else in its inputs' dtype). PyTorch's CPU autocast has another policy
(other op lists, and bf16 only), and this generator runs on a CPU, so it does not use
``torch.autocast`` at all: it reproduces the CUDA policy with explicit casts, e.g.
``F.linear(x.to(bf16), w.to(bf16), b.to(bf16))`` for a linear layer and
``F.softmax(s.float(), -1)`` for a softmax of half-precision scores. The parameters and
inputs are float32 leaves, so their gradients come back through the casts in float32, as
autocast's master weights do.

How to run it (from the repository root, in a venv with
``pip install torch==2.11.0 safetensors numpy``)::

    python tools/make_amp_fixtures.py

Cases (each once with bf16 and once with f16, suffix ``_bf16`` / ``_f16``):

- ``mlp``: linear(8 → 16) → GELU (tanh) → linear(16 → 6) → mse_loss against a target, on
  (4, 8) inputs. Intermediates ``h`` (first linear), ``a`` (GELU), ``o`` (second linear) are
  half, ``loss`` float32.
- ``attn``: q, k, v (2, 4, 8); ``s = (q @ kᵀ) · 8^-½`` (half), ``p = softmax(s, -1)``
  (float32), ``o = p @ v`` (half), ``loss = sum(o · w)`` with a fixed float32 ``w`` (the
  product type-promotes to float32).
- ``lnce``: x (6, 8) → layer_norm(8) with weight and bias (``n``, float32) → linear(8 → 5)
  (``logits``, half) → cross_entropy against int64 targets, one of them -100 (ignored)
  (``loss``, float32).

Keys, for each case NAME: ``NAME.in.X`` the inputs and parameters (float32; targets int64),
``NAME.out.Y`` the intermediates and the loss **in the dtype the policy gives them** (bf16,
f16 or f32, so the file states each expected dtype), ``NAME.grad.X`` the float32 gradient of
the loss with respect to each float input. ``__metadata__`` holds {"format":
"ferrograd-amp-fixtures", "version": "1", "torch_version": ..., "generator": ...} and, under
each case name, its configuration as JSON. The output is deterministic (seed 0).
"""

import json
import os
import sys

import torch
import torch.nn.functional as F
from stable_safetensors import serialize

OUT_PATH = os.path.join("tests", "fixtures", "amp.safetensors")
DTYPES = {"bf16": torch.bfloat16, "f16": torch.float16}


def leaf(*shape, scale=1.0):
    """A float32 leaf requiring grad, drawn as float64 normals."""
    t = (torch.randn(shape, dtype=torch.float64) * scale).to(torch.float32)
    return t.requires_grad_(True)


def record(name, tensors, inputs, outs, loss):
    loss.backward()
    for k, v in inputs.items():
        tensors[f"{name}.in.{k}"] = v.detach().clone()
        if v.requires_grad:
            tensors[f"{name}.grad.{k}"] = v.grad.clone()
    for k, v in outs.items():
        tensors[f"{name}.out.{k}"] = v.detach().clone()
    tensors[f"{name}.out.loss"] = loss.detach().clone()


def mlp(name, low, tensors):
    inputs = dict(
        x=leaf(4, 8),
        w1=leaf(16, 8, scale=0.35),
        b1=leaf(16, scale=0.1),
        w2=leaf(6, 16, scale=0.25),
        b2=leaf(6, scale=0.1),
    )
    y = torch.randn(4, 6, dtype=torch.float64).to(torch.float32)
    i = inputs
    h = F.linear(i["x"].to(low), i["w1"].to(low), i["b1"].to(low))
    a = F.gelu(h, approximate="tanh")
    o = F.linear(a, i["w2"].to(low), i["b2"].to(low))
    loss = F.mse_loss(o.float(), y)
    tensors[f"{name}.in.y"] = y
    record(name, tensors, inputs, dict(h=h, a=a, o=o), loss)


def attn(name, low, tensors):
    inputs = dict(q=leaf(2, 4, 8), k=leaf(2, 4, 8), v=leaf(2, 4, 8))
    w = torch.randn(2, 4, 8, dtype=torch.float64).to(torch.float32)
    i = inputs
    s = (i["q"].to(low) @ i["k"].to(low).transpose(-1, -2)) * (8**-0.5)
    p = F.softmax(s.float(), dim=-1)
    o = p.to(low) @ i["v"].to(low)
    loss = (o * w).sum()
    tensors[f"{name}.in.w"] = w
    record(name, tensors, inputs, dict(s=s, p=p, o=o), loss)


def lnce(name, low, tensors):
    inputs = dict(
        x=leaf(6, 8),
        ln_w=(1.0 + 0.1 * torch.randn(8, dtype=torch.float64)).float().requires_grad_(True),
        ln_b=leaf(8, scale=0.1),
        w=leaf(5, 8, scale=0.4),
        b=leaf(5, scale=0.1),
    )
    targets = torch.randint(0, 5, (6,), dtype=torch.long)
    targets[2] = -100
    i = inputs
    n = F.layer_norm(i["x"], (8,), i["ln_w"], i["ln_b"], 1e-5)
    logits = F.linear(n.to(low), i["w"].to(low), i["b"].to(low))
    loss = F.cross_entropy(logits.float(), targets, ignore_index=-100)
    tensors[f"{name}.in.targets"] = targets
    record(name, tensors, inputs, dict(n=n, logits=logits), loss)


CASES = {"mlp": mlp, "attn": attn, "lnce": lnce}


def main():
    torch.manual_seed(0)
    tensors = {}
    metadata = {
        "format": "ferrograd-amp-fixtures",
        "version": "1",
        "torch_version": str(torch.__version__),
        "generator": "tools/make_amp_fixtures.py",
    }
    for case, make in CASES.items():
        for dname, low in DTYPES.items():
            name = f"{case}_{dname}"
            make(name, low, tensors)
            metadata[name] = json.dumps(dict(case=case, dtype=dname), sort_keys=True)
    tensors = {k: v.contiguous() for k, v in tensors.items()}
    os.makedirs(os.path.dirname(OUT_PATH), exist_ok=True)
    with open(OUT_PATH, "wb") as f:
        f.write(serialize(tensors, metadata))
    size = os.path.getsize(OUT_PATH)
    cases = len(metadata) - 4
    print(f"wrote {OUT_PATH}: {cases} cases, {len(tensors)} tensors, {size} bytes")
    if size >= 100 * 1024:
        sys.exit("fixture file is too large (>= 100 KB)")


if __name__ == "__main__":
    main()
