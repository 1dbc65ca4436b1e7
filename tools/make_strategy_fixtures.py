"""Generate golden fixtures for ferrograd's memory-strategy tests from PyTorch.

One small MLP, ``Sequential(Linear(6, 12), ReLU(), Linear(12, 4))`` in float64, an MSE loss
on x (8, 6) and targets y (8, 4), and SGD(lr=0.1, momentum=0.9) for three steps, trained once
per memory strategy, each written the way PyTorch users write it:

- ``baseline``: forward, backward, step, ``zero_grad(set_to_none=True)``.
- ``zero_grad_false``: the same with ``zero_grad(set_to_none=False)``.
- ``accum4``: 4 micro-batches of 2 rows, backward of ``loss / 4`` for each, one step.
- ``clip``: ``clip_grad_norm_(params, 0.05)`` before each step (every norm is above 0.05).
- ``freeze``: the first Linear's weight and bias ``requires_grad_(False)``; SGD over the rest.
- ``recompute``: ``torch.utils.checkpoint.checkpoint(model, x, use_reentrant=False)``.
- ``step_in_backward``: one SGD per parameter stepped by a post-accumulate-grad hook, as in
  PyTorch's tutorial "How to save memory by fusing the optimizer step into the backward pass".

Written to ``tests/fixtures/strategies.safetensors``. How to run it (from the repository
root, in a venv with ``pip install torch==2.11.0 safetensors numpy``)::

    python tools/make_strategy_fixtures.py

Keys (all float64). Shared: ``init.P`` for each parameter name P in ``0.weight``, ``0.bias``,
``2.weight``, ``2.bias`` (PyTorch's default initialisation, seed 0), ``data.x`` (8, 6),
``data.y`` (8, 4), and ``eval.out`` (8, 4): the model's output on x under ``torch.no_grad()``
with the initial parameters. For each case NAME: ``NAME.losses`` (3,), the loss of each step
(for ``accum4`` the sum of the four ``loss / 4``); ``NAME.step{k}.P``, the parameters after
step k = 1..3; ``NAME.grad1.P``, the gradients of the first step just before ``step()``
(after clipping, for ``clip``; absent for frozen parameters and for ``step_in_backward``,
whose gradients never exist together). ``clip.norms`` (3,) holds the norms
``clip_grad_norm_`` returned; ``zero_grad_false.grad_end.P`` the gradients left after the
last ``zero_grad(set_to_none=False)`` (zeros that exist).

The configuration of each case is in ``__metadata__`` under the case name, as JSON, next to
{"format": "ferrograd-strategy-fixtures", "version": "1", "torch_version", "generator"}.
"""

import json
import os
import sys

import torch
import torch.utils.checkpoint

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from stable_safetensors import serialize  # noqa: E402

OUT_PATH = os.path.join("tests", "fixtures", "strategies.safetensors")
STEPS = 3
LR = 0.1
MOMENTUM = 0.9
ACCUM = 4
MAX_NORM = 0.05
NAMES = ["0.weight", "0.bias", "2.weight", "2.bias"]

CASES = {
    "baseline": dict(set_to_none=True),
    "zero_grad_false": dict(set_to_none=False),
    "accum4": dict(accum=ACCUM),
    "clip": dict(max_norm=MAX_NORM, norm_type=2.0),
    "freeze": dict(frozen="0.*"),
    "recompute": dict(checkpoint="whole model", use_reentrant=False),
    "step_in_backward": dict(hook="register_post_accumulate_grad_hook"),
}


def make_model(tensors):
    """The MLP with the fixture's initial parameters."""
    model = torch.nn.Sequential(
        torch.nn.Linear(6, 12), torch.nn.ReLU(), torch.nn.Linear(12, 4)
    ).double()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(tensors[f"init.{name}"])
    return model


def make_shared(tensors):
    model = torch.nn.Sequential(
        torch.nn.Linear(6, 12), torch.nn.ReLU(), torch.nn.Linear(12, 4)
    ).double()
    for name, p in model.named_parameters():
        tensors[f"init.{name}"] = p.detach().clone()
    tensors["data.x"] = torch.randn(8, 6, dtype=torch.float64)
    tensors["data.y"] = torch.randn(8, 4, dtype=torch.float64)
    with torch.no_grad():
        tensors["eval.out"] = model(tensors["data.x"]).clone()


def loss_fn(out, y):
    return torch.nn.functional.mse_loss(out, y)


def record_grads(name, model, tensors):
    """The first step's gradients, taken just before step(); frozen parameters have none."""
    for pname, p in model.named_parameters():
        if p.grad is not None:
            tensors[f"{name}.grad1.{pname}"] = p.grad.detach().clone()


def record_params(name, k, model, tensors):
    """The parameters after step k."""
    for pname, p in model.named_parameters():
        tensors[f"{name}.step{k}.{pname}"] = p.detach().clone()


def run_plain(name, tensors, set_to_none=True, max_norm=None, frozen=False, recompute=False):
    """The ordinary loop: backward, [clip], step, zero_grad."""
    model = make_model(tensors)
    x, y = tensors["data.x"], tensors["data.y"]
    if frozen:
        model[0].weight.requires_grad_(False)
        model[0].bias.requires_grad_(False)
    opt = torch.optim.SGD(
        [p for p in model.parameters() if p.requires_grad], lr=LR, momentum=MOMENTUM
    )
    losses, norms = [], []
    for k in range(1, STEPS + 1):
        if recompute:
            out = torch.utils.checkpoint.checkpoint(model, x, use_reentrant=False)
        else:
            out = model(x)
        loss = loss_fn(out, y)
        loss.backward()
        if max_norm is not None:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
            # Every step must actually clip, or the case would test nothing.
            assert norm.item() > max_norm, norm
            norms.append(norm.item())
        if k == 1:
            record_grads(name, model, tensors)
        opt.step()
        opt.zero_grad(set_to_none=set_to_none)
        losses.append(loss.item())
        record_params(name, k, model, tensors)
    tensors[f"{name}.losses"] = torch.tensor(losses, dtype=torch.float64)
    if max_norm is not None:
        tensors[f"{name}.norms"] = torch.tensor(norms, dtype=torch.float64)
    if not set_to_none:
        for pname, p in model.named_parameters():
            assert p.grad is not None and not p.grad.any()
            tensors[f"{name}.grad_end.{pname}"] = p.grad.detach().clone()


def run_accum(name, tensors):
    """4 micro-batches of 2 rows, backward of loss / 4 each, then one step."""
    model = make_model(tensors)
    x, y = tensors["data.x"], tensors["data.y"]
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    rows = x.shape[0] // ACCUM
    losses = []
    for k in range(1, STEPS + 1):
        total = 0.0
        for i in range(ACCUM):
            xs, ys = x[i * rows : (i + 1) * rows], y[i * rows : (i + 1) * rows]
            loss = loss_fn(model(xs), ys) / ACCUM
            loss.backward()
            total += loss.item()
        if k == 1:
            record_grads(name, model, tensors)
        opt.step()
        opt.zero_grad()
        losses.append(total)
        record_params(name, k, model, tensors)
    tensors[f"{name}.losses"] = torch.tensor(losses, dtype=torch.float64)


def run_step_in_backward(name, tensors):
    """PyTorch's tutorial: one optimizer per parameter, stepped from its gradient hook."""
    model = make_model(tensors)
    x, y = tensors["data.x"], tensors["data.y"]
    opts = {p: torch.optim.SGD([p], lr=LR, momentum=MOMENTUM) for p in model.parameters()}

    def hook(p):
        opts[p].step()
        opts[p].zero_grad()

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(hook)
    losses = []
    for k in range(1, STEPS + 1):
        loss = loss_fn(model(x), y)
        loss.backward()
        assert all(p.grad is None for p in model.parameters())
        losses.append(loss.item())
        record_params(name, k, model, tensors)
    tensors[f"{name}.losses"] = torch.tensor(losses, dtype=torch.float64)


def main():
    torch.manual_seed(0)
    tensors = {}
    metadata = {
        "format": "ferrograd-strategy-fixtures",
        "version": "1",
        "torch_version": str(torch.__version__),
        "generator": "tools/make_strategy_fixtures.py",
    }
    make_shared(tensors)
    run_plain("baseline", tensors)
    run_plain("zero_grad_false", tensors, set_to_none=False)
    run_accum("accum4", tensors)
    run_plain("clip", tensors, max_norm=MAX_NORM)
    run_plain("freeze", tensors, frozen=True)
    run_plain("recompute", tensors, recompute=True)
    run_step_in_backward("step_in_backward", tensors)
    for name, cfg in CASES.items():
        metadata[name] = json.dumps(dict(lr=LR, momentum=MOMENTUM, steps=STEPS, **cfg),
                                    sort_keys=True)
    os.makedirs(os.path.dirname(OUT_PATH), exist_ok=True)
    with open(OUT_PATH, "wb") as f:
        f.write(serialize({k: v.contiguous() for k, v in tensors.items()}, metadata))
    print(f"wrote {OUT_PATH}: {len(CASES)} cases, {len(tensors)} tensors")


if __name__ == "__main__":
    main()
