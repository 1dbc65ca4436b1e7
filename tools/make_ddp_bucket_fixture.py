"""Generate the DDP bucket-assignment fixture from PyTorch's own bucketing function.

torch.distributed._compute_bucket_assignment_by_size (reducer.cpp
``compute_bucket_assignment_by_size``) decides which parameters share one all-reduce in
DistributedDataParallel. This script calls it on a model of mixed parameter sizes and dtypes
(no process group is needed: the function only reads sizes, dtypes and devices) and writes
the assignments to ``tests/fixtures/ddp_buckets.json``.

How to run it (from the repository root, in a venv with ``pip install torch==2.11.0``)::

    python tools/make_ddp_bucket_fixture.py

Format: {"format": "ferrograd-ddp-bucket-fixtures", "version": "1", "torch_version",
"generator", "first_bucket_bytes", "bucket_cap_bytes", "params": [{"shape", "dtype"}, ...],
"cases": [{"name", "limits", "order" (null or parameter indices in visiting order),
"buckets" (lists of parameter indices, in the order the function returns them),
"open_order_hashed" (true when buckets still open at the end come in the order of
PyTorch's hash map: several dtypes and no sorting)}]}.
Cases: DDP's constructor without find_unused_parameters (one bucket per dtype), with it
(1 MiB then 25 MiB over the parameter order, sorted), and the rebuild after the first step
(the same limits over an arrival order: reversed, and a seeded shuffle) for the mixed model
and for an f32-only model. The output is deterministic.
"""

import json
import os
import random
import sys

import torch
import torch.distributed as dist

OUT_PATH = os.path.join("tests", "fixtures", "ddp_buckets.json")
FIRST = dist._DEFAULT_FIRST_BUCKET_BYTES
CAP = 25 * 1024 * 1024
DTYPES = {"f32": torch.float32, "f64": torch.float64, "f16": torch.float16}

# A GPT-like stack of mixed sizes: embeddings (MiBs), blocks of matrices and vectors, a few
# f64 and f16 parameters so that buckets are kept per dtype.
MIXED = (
    [((8192, 512), "f32"), ((1024, 512), "f32")]
    + [
        p
        for i in range(6)
        for p in [
            ((512,), "f32"),
            ((1536, 512), "f32"),
            ((1536,), "f32"),
            ((512, 512), "f32"),
            ((2048, 512), "f16" if i % 3 == 0 else "f32"),
            ((2048,), "f64" if i % 2 == 0 else "f32"),
            ((512, 2048), "f32"),
        ]
    ]
    + [((512,), "f32"), ((300, 700), "f64"), ((8192,), "f32")]
)
F32_ONLY = [(shape, "f32") for shape, _ in MIXED]


def assign(params, limits, order):
    tensors = [torch.empty(shape, dtype=DTYPES[d]) for shape, d in params]
    if order is None:
        buckets, _ = dist._compute_bucket_assignment_by_size(tensors, limits)
    else:
        visited = [tensors[i] for i in order]
        buckets, _ = dist._compute_bucket_assignment_by_size(visited, limits, [False] * len(tensors), order)
    return [list(b) for b in buckets]


def cases(name, params):
    n = len(params)
    shuffled = list(range(n))
    random.Random(0).shuffle(shuffled)
    several = len({d for _, d in params}) > 1
    out = []
    for case, limits, order in [
        ("constructor_default", [sys.maxsize], None),
        ("constructor_find_unused", [FIRST, CAP], None),
        ("rebuild_reversed", [FIRST, CAP], list(reversed(range(n)))),
        ("rebuild_shuffled", [FIRST, CAP], shuffled),
    ]:
        out.append(
            {
                "name": f"{name}.{case}",
                "model": name,
                "limits": limits,
                "order": order,
                "buckets": assign(params, limits, order),
                "open_order_hashed": several and order is not None,
            }
        )
    return out


def main():
    doc = {
        "format": "ferrograd-ddp-bucket-fixtures",
        "version": "1",
        "torch_version": torch.__version__,
        "generator": "tools/make_ddp_bucket_fixture.py",
        "first_bucket_bytes": FIRST,
        "bucket_cap_bytes": CAP,
        "models": {
            name: [{"shape": list(s), "dtype": d} for s, d in params]
            for name, params in [("mixed", MIXED), ("f32", F32_ONLY)]
        },
        "cases": cases("mixed", MIXED) + cases("f32", F32_ONLY),
    }
    os.makedirs(os.path.dirname(OUT_PATH), exist_ok=True)
    with open(OUT_PATH, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
    print(f"wrote {OUT_PATH}: {len(doc['cases'])} cases")


if __name__ == "__main__":
    main()
