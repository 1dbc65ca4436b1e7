"""Generate golden fixtures for ferrograd's higher-order gradient tests from PyTorch.

Writes ``tests/fixtures/gradgrad.safetensors``: small MLP critics trained one SGD step with a
gradient penalty (WGAN-GP style), which needs the gradient of a gradient, and one case of
``backward(create_graph=True)`` followed by a penalty on the parameters' ``.grad``.

How to run it (from the repository root, in a venv with
``pip install torch==2.11.0 safetensors numpy``)::

    python tools/make_gradgrad_fixtures.py

Everything is float64 (second derivatives compared to 1e-9, not float32 noise). Keys:

Gradient-penalty cases NAME (``gp_tanh_gelu``, ``gp_relu_sigmoid``), a 3-layer MLP
``x (8, 4) → 16 → 16 → 1`` with the case's two activations:

- ``NAME.x``, ``NAME.target`` (8, 1), ``NAME.w{i}``, ``NAME.b{i}`` (i = 1, 2, 3): inputs and
  initial parameters (weights (out, in), biases (out,)).
- ``NAME.gx``: d(sum out)/dx, taken with ``torch.autograd.grad(create_graph=True)``.
- ``NAME.penalty``: ``mean((sqrt(sum(gx², dim 1) + 1e-12) - 1)²)``; ``NAME.fit``: the case's
  fit loss (``mse_loss(out, target)`` for gp_tanh_gelu; ``mean(log(1 + exp(out)) / 2)`` for
  gp_relu_sigmoid); ``NAME.loss`` = fit + 10 · penalty.
- ``NAME.grad.w{i}``, ``NAME.grad.b{i}``: the parameters' ``.grad`` after ``loss.backward()``.
- ``NAME.step.w{i}``, ``NAME.step.b{i}``: the parameters after ``SGD(lr=0.1).step()``.

The ``.grad`` penalty case ``grad_penalty`` (x (6, 3) → 5 (tanh) → 2, mse to target (6, 2)):

- ``grad_penalty.x``, ``.target``, ``.w1``, ``.b1``, ``.w2``, ``.b2``.
- ``grad_penalty.grad1.P``: ``P.grad`` after ``loss.backward(create_graph=True)``.
- ``grad_penalty.grad2.P``: ``P.grad`` after then ``sum_P sum(P.grad²)``'s ``backward()``
  (accumulated onto the first, as PyTorch does).

``__metadata__``: {"format": "ferrograd-gradgrad-fixtures", "version": "1", "torch_version",
"generator"} and, per case, its activations as JSON.
"""

import json
import os

import torch
import torch.nn.functional as F

from stable_safetensors import serialize

OUT_PATH = os.path.join("tests", "fixtures", "gradgrad.safetensors")
LAMBDA = 10.0
LR = 0.1

ACTS = {
    "tanh": torch.tanh,
    "gelu": lambda t: F.gelu(t),
    "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"),
    "relu": torch.relu,
    "sigmoid": torch.sigmoid,
}

GP_CASES = {
    "gp_tanh_gelu": ("tanh", "gelu", "mse"),
    "gp_relu_sigmoid": ("relu", "sigmoid", "softplus"),
    "gp_gelu_tanh_approx": ("gelu_tanh", "tanh", "mse"),
}


def randn(*shape, scale=1.0):
    return torch.randn(shape, dtype=torch.float64) * scale


def mlp_params(sizes):
    params = {}
    for i, (n_in, n_out) in enumerate(zip(sizes, sizes[1:]), start=1):
        params[f"w{i}"] = randn(n_out, n_in, scale=n_in**-0.5).requires_grad_()
        params[f"b{i}"] = randn(n_out, scale=0.1).requires_grad_()
    return params


def gp_case(name, act1, act2, fit_kind, tensors, metadata):
    x = randn(8, 4).requires_grad_()
    target = randn(8, 1)
    p = mlp_params([4, 16, 16, 1])
    tensors[f"{name}.x"] = x.detach().clone()
    tensors[f"{name}.target"] = target
    for k, v in p.items():
        tensors[f"{name}.{k}"] = v.detach().clone()
    h = ACTS[act1](F.linear(x, p["w1"], p["b1"]))
    h = ACTS[act2](F.linear(h, p["w2"], p["b2"]))
    out = F.linear(h, p["w3"], p["b3"])
    (gx,) = torch.autograd.grad(out.sum(), x, create_graph=True)
    norm = (gx.pow(2).sum(1) + 1e-12).sqrt()
    penalty = (norm - 1.0).pow(2).mean()
    if fit_kind == "mse":
        fit = F.mse_loss(out, target)
    else:
        fit = (out.exp() + 1.0).log().div(2.0).mean()
    loss = fit + LAMBDA * penalty
    loss.backward()
    tensors[f"{name}.gx"] = gx.detach().clone()
    tensors[f"{name}.penalty"] = penalty.detach().clone()
    tensors[f"{name}.fit"] = fit.detach().clone()
    tensors[f"{name}.loss"] = loss.detach().clone()
    opt = torch.optim.SGD(p.values(), lr=LR)
    for k, v in p.items():
        tensors[f"{name}.grad.{k}"] = v.grad.detach().clone()
    opt.step()
    for k, v in p.items():
        tensors[f"{name}.step.{k}"] = v.detach().clone()
    metadata[name] = json.dumps(dict(act1=act1, act2=act2, fit=fit_kind), sort_keys=True)


def grad_penalty_case(tensors, metadata):
    name = "grad_penalty"
    x = randn(6, 3)
    target = randn(6, 2)
    p = mlp_params([3, 5, 2])
    tensors[f"{name}.x"] = x
    tensors[f"{name}.target"] = target
    for k, v in p.items():
        tensors[f"{name}.{k}"] = v.detach().clone()
    out = F.linear(torch.tanh(F.linear(x, p["w1"], p["b1"])), p["w2"], p["b2"])
    F.mse_loss(out, target).backward(create_graph=True)
    for k, v in p.items():
        tensors[f"{name}.grad1.{k}"] = v.grad.detach().clone()
    sum(v.grad.pow(2).sum() for v in p.values()).backward()
    for k, v in p.items():
        tensors[f"{name}.grad2.{k}"] = v.grad.detach().clone()
    metadata[name] = json.dumps(dict(act="tanh", fit="mse"), sort_keys=True)


def main():
    torch.manual_seed(0)
    tensors = {}
    metadata = {
        "format": "ferrograd-gradgrad-fixtures",
        "version": "1",
        "torch_version": str(torch.__version__),
        "generator": "tools/make_gradgrad_fixtures.py",
    }
    for name, (a1, a2, fit) in GP_CASES.items():
        gp_case(name, a1, a2, fit, tensors, metadata)
    grad_penalty_case(tensors, metadata)
    os.makedirs(os.path.dirname(OUT_PATH), exist_ok=True)
    with open(OUT_PATH, "wb") as f:
        f.write(serialize(tensors, metadata))
    cases = len(metadata) - 4
    print(f"wrote {OUT_PATH}: {cases} cases, {len(tensors)} tensors")


if __name__ == "__main__":
    main()
