"""Generate golden fixtures for ferrograd's optimizer tests from PyTorch.

For each optimizer configuration: an initial parameter, a fixed sequence of gradients, and
the parameter after each ``step()``. Written to ``tests/fixtures/optim.safetensors``.

How to run it (from the repository root, in a venv with
``pip install torch==2.11.0 safetensors numpy``)::

    python tools/make_optim_fixtures.py

Keys, for each case NAME: ``NAME.p0`` (initial parameter), ``NAME.g1`` .. ``NAME.gK``
(gradient fed before step k), ``NAME.p1`` .. ``NAME.pK`` (parameter after step k).
The configuration of each case is in ``__metadata__`` under the case name, as JSON, next to
{"format": "ferrograd-optim-fixtures", "version": "1", "torch_version": ...}.
"""

import json
import os

import torch
from safetensors.torch import save_file

OUT_PATH = os.path.join("tests", "fixtures", "optim.safetensors")
STEPS = 3

CASES = {
    "sgd_plain": ("sgd", dict(lr=0.1)),
    "sgd_momentum": ("sgd", dict(lr=0.1, momentum=0.9)),
    "sgd_nesterov": ("sgd", dict(lr=0.1, momentum=0.9, nesterov=True)),
    "sgd_damp_wd": ("sgd", dict(lr=0.1, momentum=0.9, dampening=0.1, weight_decay=0.01)),
}


def randn(*shape):
    return torch.randn(shape, dtype=torch.float64).to(torch.float32)


def main():
    torch.manual_seed(0)
    tensors = {}
    metadata = {
        "format": "ferrograd-optim-fixtures",
        "version": "1",
        "torch_version": str(torch.__version__),
        "generator": "tools/make_optim_fixtures.py",
    }
    for name, (kind, cfg) in CASES.items():
        p = torch.nn.Parameter(randn(3, 4))
        tensors[f"{name}.p0"] = p.detach().clone()
        opt = {"sgd": torch.optim.SGD}[kind]([p], **cfg)
        for k in range(1, STEPS + 1):
            g = randn(3, 4)
            p.grad = g.clone()
            opt.step()
            tensors[f"{name}.g{k}"] = g
            tensors[f"{name}.p{k}"] = p.detach().clone()
        metadata[name] = json.dumps(cfg, sort_keys=True)
    os.makedirs(os.path.dirname(OUT_PATH), exist_ok=True)
    save_file(tensors, OUT_PATH, metadata=metadata)
    print(f"wrote {OUT_PATH}: {len(CASES)} cases, {len(tensors)} tensors")


if __name__ == "__main__":
    main()
