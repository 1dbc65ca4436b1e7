"""Generate golden fixtures for ferrograd's fused causal attention from PyTorch.

Writes ``tests/fixtures/attention.safetensors``: causal multi-head self-attention computed by
``torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)`` from a QKV
projection's output, and the gradient of that output's weighted sum with respect to qkv.

How to run it (from the repository root, in a venv with
``pip install torch==2.11.0 safetensors numpy``)::

    python tools/make_attention_fixtures.py

Cases NAME, each with qkv (B, T, 3C) holding q, k and v side by side, split into H heads of
D = C / H (as GPT-2's attention does):

- ``NAME.qkv`` (B, T, 3C) and ``NAME.gout`` (B, T, C): the input and the output's gradient.
- ``NAME.out`` (B, T, C): the heads' outputs merged back.
- ``NAME.gqkv`` (B, T, 3C): d(sum(out * gout))/d qkv.

The cases cover one key tile and several (T beyond 64, so the online softmax rescales),
B > 1, a single head and a head dim of 64, in float64 and float32.

``__metadata__``: {"format": "ferrograd-attention-fixtures", "version": "1", "torch_version",
"generator"} and, per case, {"n_head": H} as JSON.
"""

import json
import os

import torch
import torch.nn.functional as F

from stable_safetensors import serialize

OUT_PATH = os.path.join("tests", "fixtures", "attention.safetensors")

# name: (B, T, H, D, dtype)
CASES = {
    "small_f64": (2, 7, 3, 4, torch.float64),
    "tiles_f64": (1, 150, 2, 16, torch.float64),
    "one_head_f64": (3, 65, 1, 8, torch.float64),
    "gpt_f32": (2, 96, 2, 64, torch.float32),
}


def case(name, b, t, h, d, dtype, tensors, metadata):
    c = h * d
    qkv = (torch.randn(b, t, 3 * c, dtype=torch.float64) * 1.5).to(dtype).requires_grad_()
    gout = torch.randn(b, t, c, dtype=torch.float64).to(dtype)
    q, k, v = qkv.split(c, dim=2)
    heads = [x.view(b, t, h, d).transpose(1, 2) for x in (q, k, v)]
    y = F.scaled_dot_product_attention(*heads, is_causal=True)
    out = y.transpose(1, 2).reshape(b, t, c)
    (out * gout).sum().backward()
    tensors[f"{name}.qkv"] = qkv.detach()
    tensors[f"{name}.gout"] = gout
    tensors[f"{name}.out"] = out.detach()
    tensors[f"{name}.gqkv"] = qkv.grad
    metadata[name] = json.dumps(dict(n_head=h), sort_keys=True)


def main():
    torch.manual_seed(0)
    tensors = {}
    metadata = {
        "format": "ferrograd-attention-fixtures",
        "version": "1",
        "torch_version": str(torch.__version__),
        "generator": "tools/make_attention_fixtures.py",
    }
    for name, (b, t, h, d, dtype) in CASES.items():
        case(name, b, t, h, d, dtype, tensors, metadata)
    os.makedirs(os.path.dirname(OUT_PATH), exist_ok=True)
    with open(OUT_PATH, "wb") as f:
        f.write(serialize(tensors, metadata))
    print(f"wrote {OUT_PATH}: {len(CASES)} cases, {len(tensors)} tensors")


if __name__ == "__main__":
    main()
