"""Generate golden fixtures for ferrograd's GradScaler tests from torch.amp.GradScaler.

A two-layer model, ``y = tanh(x W1^T + b1) W2^T + b2`` with an MSE loss, trained by SGD with
momentum under a GradScaler on the CPU for ``STEPS`` iterations:

    opt.zero_grad(); scaler.scale(loss).backward(); [scaler.unscale_(opt); clip_grad_norm_]
    scaler.step(opt); scaler.update()

At chosen iterations a gradient is made non-finite, so the step is skipped and the scale backs
off: an inf in the input (event 1), a NaN written into one gradient element after backward
(event 2), the loss multiplied by inf (event 3). Written to ``tests/fixtures/scaler.safetensors``.

How to run it (from the repository root, in a venv with
``pip install torch==2.11.0 safetensors numpy``)::

    python tools/make_scaler_fixtures.py

Keys. Shared by all cases: ``init.{W1,b1,W2,b2}`` (initial parameters, f32),
``data.x{k}`` (8, 4) and ``data.t{k}`` (8, 2) (input and target of iteration k = 1..STEPS),
``events`` (STEPS,) int64 (0 = clean, 1 = inf input, 2 = NaN gradient, 3 = inf loss).
For each case NAME: ``NAME.scale`` (STEPS,) f32, the scale after each update();
``NAME.tracker`` (STEPS,) int64, the growth tracker after each update();
``NAME.skipped`` (STEPS,) int64, 1 where the step found inf/NaN and skipped optimizer.step();
``NAME.step{k}.{W1,b1,W2,b2}``, the parameters after iteration k.

The configuration of each case is in ``__metadata__`` under the case name, as JSON, next to
{"format": "ferrograd-scaler-fixtures", "version": "1", "torch_version", "generator"}.
"""

import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from stable_safetensors import serialize  # noqa: E402

OUT_PATH = os.path.join("tests", "fixtures", "scaler.safetensors")
STEPS = 14
SHAPES = {"W1": (5, 4), "b1": (5,), "W2": (2, 5), "b2": (2,)}
LR = 0.1
MOMENTUM = 0.9
# Iteration (1-based) -> event code.
EVENTS = {4: 1, 8: 2, 9: 2, 12: 3}

CASES = {
    # PyTorch's factors, a short growth interval: growth after 3 clean steps, backoffs.
    "defaults_g3": dict(init_scale=2.0**16, growth_factor=2.0, backoff_factor=0.5,
                        growth_interval=3, clip=None),
    # Factors that are not powers of two: the scale arithmetic (f64 product rounded to f32).
    "odd_factors": dict(init_scale=1000.3, growth_factor=1.7, backoff_factor=0.3,
                        growth_interval=2, clip=None),
    # unscale_ then clip_grad_norm_ before step, as the PyTorch docs show.
    "unscale_clip": dict(init_scale=2.0**10, growth_factor=2.0, backoff_factor=0.5,
                         growth_interval=3, clip=0.05),
    # The largest power-of-two f32 scale: growing it would give inf, so it stays (the tracker
    # still resets).
    "near_max": dict(init_scale=2.0**127, growth_factor=2.0, backoff_factor=0.5,
                     growth_interval=3, clip=None),
    # Targets 8x larger: the scaled loss and gradients overflow f32 by themselves until the
    # scale has backed off far enough.
    "overflow": dict(init_scale=2.0**127, growth_factor=2.0, backoff_factor=0.5,
                     growth_interval=3, clip=None, target_scale=8.0),
}


def randn(*shape):
    return torch.randn(shape, dtype=torch.float64).to(torch.float32)


def make_shared(tensors):
    for name, shape in SHAPES.items():
        tensors[f"init.{name}"] = randn(*shape) * 0.5
    for k in range(1, STEPS + 1):
        tensors[f"data.x{k}"] = randn(8, 4)
        tensors[f"data.t{k}"] = randn(8, 2)
    tensors["events"] = torch.tensor([EVENTS.get(k, 0) for k in range(1, STEPS + 1)],
                                     dtype=torch.int64)


def run_case(name, cfg, tensors):
    params = {n: tensors[f"init.{n}"].clone().requires_grad_(True) for n in SHAPES}
    opt = torch.optim.SGD(list(params.values()), lr=LR, momentum=MOMENTUM)
    scaler = torch.amp.GradScaler(
        "cpu",
        init_scale=cfg["init_scale"],
        growth_factor=cfg["growth_factor"],
        backoff_factor=cfg["backoff_factor"],
        growth_interval=cfg["growth_interval"],
    )
    scales, trackers, skipped = [], [], []
    for k in range(1, STEPS + 1):
        event = EVENTS.get(k, 0)
        x = tensors[f"data.x{k}"].clone()
        if event == 1:
            x[0, 0] = float("inf")
        opt.zero_grad()
        h = torch.tanh(x @ params["W1"].T + params["b1"])
        y = h @ params["W2"].T + params["b2"]
        target = tensors[f"data.t{k}"] * cfg.get("target_scale", 1.0)
        loss = torch.nn.functional.mse_loss(y, target)
        if event == 3:
            loss = loss * float("inf")
        scaler.scale(loss).backward()
        if event == 2:
            params["W2"].grad[1, 2] = float("nan")
        if cfg["clip"] is not None:
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(list(params.values()), cfg["clip"])
        scaler.step(opt)
        found = sum(v.item() for v in scaler._found_inf_per_device(opt).values())
        skipped.append(int(found > 0))
        scaler.update()
        scales.append(scaler.get_scale())
        trackers.append(scaler._get_growth_tracker())
        for n, p in params.items():
            tensors[f"{name}.step{k}.{n}"] = p.detach().clone()
    tensors[f"{name}.scale"] = torch.tensor(scales, dtype=torch.float32)
    tensors[f"{name}.tracker"] = torch.tensor(trackers, dtype=torch.int64)
    tensors[f"{name}.skipped"] = torch.tensor(skipped, dtype=torch.int64)
    return scales, skipped


def main():
    torch.manual_seed(0)
    tensors = {}
    metadata = {
        "format": "ferrograd-scaler-fixtures",
        "version": "1",
        "torch_version": str(torch.__version__),
        "generator": "tools/make_scaler_fixtures.py",
    }
    make_shared(tensors)
    for name, cfg in CASES.items():
        scales, skipped = run_case(name, cfg, tensors)
        metadata[name] = json.dumps(dict(lr=LR, momentum=MOMENTUM, **cfg), sort_keys=True)
        print(f"{name}: scales {scales}, skipped {skipped}")
    os.makedirs(os.path.dirname(OUT_PATH), exist_ok=True)
    with open(OUT_PATH, "wb") as f:
        f.write(serialize({k: v.contiguous() for k, v in tensors.items()}, metadata))
    print(f"wrote {OUT_PATH}: {len(CASES)} cases, {len(tensors)} tensors")


if __name__ == "__main__":
    main()
