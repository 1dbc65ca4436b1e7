"""Generate golden fixtures for ferrograd's optimizer tests from PyTorch.

For each optimizer configuration: initial parameters, a fixed sequence of gradients, and the
parameters after each ``step()``; for gradient clipping, gradients before and after and the
returned norm. Written to ``tests/fixtures/optim.safetensors``.

How to run it (from the repository root, in a venv with
``pip install torch==2.11.0 safetensors numpy``)::

    python tools/make_optim_fixtures.py

Keys, for each SGD case NAME (one parameter): ``NAME.p0`` (initial parameter), ``NAME.g1`` ..
``NAME.gK`` (gradient fed before step k), ``NAME.p1`` .. ``NAME.pK`` (parameter after step k).

Adam / AdamW cases have two parameters, shapes (3, 4) and (5,); for parameter j the keys are
``NAME.j.p0``, ``NAME.j.gk``, ``NAME.j.pk`` as above, plus ``NAME.j.exp_avg`` and
``NAME.j.exp_avg_sq`` after the last step. The schedule case ``adam_sched`` also holds
``adam_sched.lrs``: the learning rate of each step (warmup then cosine, set with LambdaLR).

Clipping cases CASE hold ``CASE.g{j}`` (gradient j before), ``CASE.c{j}`` (after) and
``CASE.norm`` (the returned total norm, shape (1,)).

The configuration of each case is in ``__metadata__`` under the case name, as JSON, next to
{"format": "ferrograd-optim-fixtures", "version": "1", "torch_version": ...}.
"""

import json
import math
import os

import torch
from safetensors.torch import save_file

OUT_PATH = os.path.join("tests", "fixtures", "optim.safetensors")
STEPS = 3
ADAM_SHAPES = [(3, 4), (5,)]

SGD_CASES = {
    "sgd_plain": dict(lr=0.1),
    "sgd_momentum": dict(lr=0.1, momentum=0.9),
    "sgd_nesterov": dict(lr=0.1, momentum=0.9, nesterov=True),
    "sgd_damp_wd": dict(lr=0.1, momentum=0.9, dampening=0.1, weight_decay=0.01),
}

ADAM_CASES = {
    "adam": ("adam", dict(lr=0.01)),
    "adam_betas_eps": ("adam", dict(lr=0.05, betas=(0.8, 0.99), eps=1e-6)),
    "adam_l2": ("adam", dict(lr=0.01, weight_decay=0.1)),
    "adamw": ("adamw", dict(lr=0.01, weight_decay=0.1)),
    # A lerp weight above one half takes torch's other lerp formula.
    "adamw_low_beta1": ("adamw", dict(lr=0.02, betas=(0.3, 0.9), weight_decay=0.05)),
}

# Warmup then cosine (the WarmupCosine schedule), 7 steps: warmup, decay, and past the end.
SCHED = dict(max_lr=0.02, min_lr=0.002, warmup_steps=2, total_steps=5)
SCHED_STEPS = 7

# (norm_type, max_norm, error_if_nonfinite=False); the gradients' norm is far above 1.
CLIP_NORM_CASES = {
    "clip_norm2": (2.0, 1.0),
    "clip_norm_inf": (math.inf, 0.5),
    "clip_norm1": (1.0, 2.0),
    "clip_norm2_unclipped": (2.0, 1000.0),
}
CLIP_VALUE = 0.5
CLIP_SHAPES = [(3, 4), (5,), (2, 3)]


def randn(*shape):
    return torch.randn(shape, dtype=torch.float64).to(torch.float32)


def lr_at(step, max_lr, min_lr, warmup_steps, total_steps):
    """WarmupCosine.lr_at in optim/schedule.rs."""
    if step < warmup_steps:
        return max_lr * (step + 1) / warmup_steps
    if step > total_steps or total_steps == warmup_steps:
        return min_lr
    ratio = (step - warmup_steps) / (total_steps - warmup_steps)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (max_lr - min_lr)


def sgd_cases(tensors, metadata):
    for name, cfg in SGD_CASES.items():
        p = torch.nn.Parameter(randn(3, 4))
        tensors[f"{name}.p0"] = p.detach().clone()
        opt = torch.optim.SGD([p], **cfg)
        for k in range(1, STEPS + 1):
            g = randn(3, 4)
            p.grad = g.clone()
            opt.step()
            tensors[f"{name}.g{k}"] = g
            tensors[f"{name}.p{k}"] = p.detach().clone()
        metadata[name] = json.dumps(cfg, sort_keys=True)


def run_adam(name, kind, cfg, steps, tensors, lrs=None):
    params = [torch.nn.Parameter(randn(*s)) for s in ADAM_SHAPES]
    for j, p in enumerate(params):
        tensors[f"{name}.{j}.p0"] = p.detach().clone()
    cls = {"adam": torch.optim.Adam, "adamw": torch.optim.AdamW}[kind]
    # foreach=False: the single-tensor formula that ferrograd follows.
    opt = cls(params, foreach=False, **cfg)
    sched = None
    if lrs is not None:
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lrs(s) / cfg["lr"])
    used = []
    for k in range(1, steps + 1):
        used.append(opt.param_groups[0]["lr"])
        for j, p in enumerate(params):
            g = randn(*ADAM_SHAPES[j])
            p.grad = g.clone()
            tensors[f"{name}.{j}.g{k}"] = g
        opt.step()
        if sched is not None:
            sched.step()
        for j, p in enumerate(params):
            tensors[f"{name}.{j}.p{k}"] = p.detach().clone()
    for j, p in enumerate(params):
        st = opt.state[p]
        tensors[f"{name}.{j}.exp_avg"] = st["exp_avg"].clone()
        tensors[f"{name}.{j}.exp_avg_sq"] = st["exp_avg_sq"].clone()
    return used


def adam_cases(tensors, metadata):
    for name, (kind, cfg) in ADAM_CASES.items():
        run_adam(name, kind, cfg, STEPS, tensors)
        metadata[name] = json.dumps(dict(kind=kind, **cfg), sort_keys=True)
    cfg = dict(lr=SCHED["max_lr"])
    used = run_adam(
        "adam_sched", "adam", cfg, SCHED_STEPS, tensors, lrs=lambda s: lr_at(s, **SCHED)
    )
    tensors["adam_sched.lrs"] = torch.tensor(used, dtype=torch.float32)
    metadata["adam_sched"] = json.dumps(dict(kind="adam", schedule=SCHED, **cfg), sort_keys=True)


def clip_grads(name, tensors):
    """Leaf parameters with gradients of norm well above 1; records them as NAME.g{j}."""
    params = []
    for j, s in enumerate(CLIP_SHAPES):
        p = torch.nn.Parameter(torch.zeros(s))
        p.grad = randn(*s) * 3.0
        tensors[f"{name}.g{j}"] = p.grad.clone()
        params.append(p)
    return params


def clip_cases(tensors, metadata):
    for name, (norm_type, max_norm) in CLIP_NORM_CASES.items():
        params = clip_grads(name, tensors)
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type=norm_type)
        for j, p in enumerate(params):
            tensors[f"{name}.c{j}"] = p.grad.clone()
        tensors[f"{name}.norm"] = norm.reshape(1).to(torch.float32)
        metadata[name] = json.dumps(
            dict(norm_type=str(norm_type), max_norm=max_norm), sort_keys=True
        )
    params = clip_grads("clip_value", tensors)
    torch.nn.utils.clip_grad_value_(params, CLIP_VALUE)
    for j, p in enumerate(params):
        tensors[f"clip_value.c{j}"] = p.grad.clone()
    metadata["clip_value"] = json.dumps(dict(clip_value=CLIP_VALUE), sort_keys=True)


def main():
    torch.manual_seed(0)
    tensors = {}
    metadata = {
        "format": "ferrograd-optim-fixtures",
        "version": "1",
        "torch_version": str(torch.__version__),
        "generator": "tools/make_optim_fixtures.py",
    }
    # SGD first: its draws from the seeded generator come first, so they are unchanged.
    sgd_cases(tensors, metadata)
    adam_cases(tensors, metadata)
    clip_cases(tensors, metadata)
    os.makedirs(os.path.dirname(OUT_PATH), exist_ok=True)
    save_file(tensors, OUT_PATH, metadata=metadata)
    cases = len(metadata) - 4
    print(f"wrote {OUT_PATH}: {cases} cases, {len(tensors)} tensors")


if __name__ == "__main__":
    main()
