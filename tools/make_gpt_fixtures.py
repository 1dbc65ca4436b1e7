"""Generate golden fixtures for ferrograd's GPT model test from PyTorch.

A minimal nanoGPT-style model (same parameter names as ferrograd's ``nn::Gpt``: the
``transformer.wte.weight`` embedding is tied to the output head, GELU is the tanh
approximation, LayerNorm eps 1e-5) is built for each case, given random parameters (larger
than GPT-2's init so every path carries signal), and run forward and backward once on a fixed
batch. Everything is computed in float64 from float32 parameter values, then stored as
float32 (ids and targets as int64) in ``tests/fixtures/gpt.safetensors``.

How to run it (from the repository root, in a venv with
``pip install torch==2.11.0 safetensors numpy``)::

    python tools/make_gpt_fixtures.py

Keys, for each case NAME:

- ``NAME.param.P``: the value of parameter P (``transformer.h.0.attn.c_attn.weight``, ...),
  the tied head counted once, under its embedding name;
- ``NAME.ids`` (B, T) and ``NAME.targets`` (B, T): int64 inputs and targets (one target is
  -100, the ignore index);
- ``NAME.logits`` (B, T, V) and ``NAME.loss`` (0-dim, mean cross-entropy);
- ``NAME.grad.P``: the gradient of the loss with respect to parameter P.

The configuration of each case is in ``__metadata__`` under the case name, as JSON, next to
{"format": "ferrograd-gpt-fixtures", "version": "1", "torch_version": ..., "generator": ...}.
The output is deterministic (seed 0).
"""

import json
import math
import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F
from stable_safetensors import serialize

OUT_PATH = os.path.join("tests", "fixtures", "gpt.safetensors")
BATCH = 2

CASES = {
    "tiny": dict(vocab_size=11, block_size=8, n_layer=2, n_head=2, n_embd=8, bias=True),
    "tiny_nobias": dict(vocab_size=11, block_size=8, n_layer=2, n_head=2, n_embd=8, bias=False),
}


class LayerNorm(nn.Module):
    """LayerNorm with an optional bias (PyTorch's lacks bias=False before 2.1)."""

    def __init__(self, n, bias):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))
        self.bias = nn.Parameter(torch.zeros(n)) if bias else None

    def forward(self, x):
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, 1e-5)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        c = cfg["n_embd"]
        self.c_attn = nn.Linear(c, 3 * c, bias=cfg["bias"])
        self.c_proj = nn.Linear(c, c, bias=cfg["bias"])
        self.n_head = cfg["n_head"]

    def forward(self, x):
        b, t, c = x.shape
        hs = c // self.n_head
        q, k, v = self.c_attn(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, hs).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hs))
        causal = torch.tril(torch.ones(t, t, dtype=torch.bool))
        att = att.masked_fill(~causal, float("-inf"))
        att = F.softmax(att, dim=-1)
        y = (att @ v).transpose(1, 2).contiguous().view(b, t, c)
        return self.c_proj(y)


class Mlp(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        c = cfg["n_embd"]
        self.c_fc = nn.Linear(c, 4 * c, bias=cfg["bias"])
        self.c_proj = nn.Linear(4 * c, c, bias=cfg["bias"])

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.ln_1 = LayerNorm(cfg["n_embd"], cfg["bias"])
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = LayerNorm(cfg["n_embd"], cfg["bias"])
        self.mlp = Mlp(cfg)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class Gpt(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        c = cfg["n_embd"]
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(cfg["vocab_size"], c),
                wpe=nn.Embedding(cfg["block_size"], c),
                h=nn.ModuleList([Block(cfg) for _ in range(cfg["n_layer"])]),
                ln_f=LayerNorm(c, cfg["bias"]),
            )
        )
        self.lm_head = nn.Linear(c, cfg["vocab_size"], bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying, as nanoGPT

    def forward(self, ids, targets):
        t = ids.shape[1]
        pos = torch.arange(t, dtype=torch.long)
        x = self.transformer.wte(ids) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-100)
        return logits, loss


def randn32(shape):
    return torch.randn(shape, dtype=torch.float64).to(torch.float32)


def random_value(name, shape):
    """Values that keep every path busy: LayerNorm weights near 1, others of moderate size."""
    if name.endswith("ln_1.weight") or name.endswith("ln_2.weight") or name.endswith("ln_f.weight"):
        return (1.0 + 0.2 * randn32(shape)).to(torch.float32)
    if name.endswith(".bias"):
        return (0.1 * randn32(shape)).to(torch.float32)
    if name.endswith("wte.weight") or name.endswith("wpe.weight"):
        return (0.5 * randn32(shape)).to(torch.float32)
    fan_in = shape[1]
    return (randn32(shape) / math.sqrt(fan_in)).to(torch.float32)


def run_case(name, cfg, tensors):
    model = Gpt(cfg).to(torch.float64)
    params = dict(model.named_parameters())  # the tied head appears once, as wte
    with torch.no_grad():
        for pname, p in params.items():
            value = random_value(pname, tuple(p.shape))
            p.copy_(value.to(torch.float64))
            tensors[f"{name}.param.{pname}"] = value
    t = cfg["block_size"]
    ids = torch.randint(0, cfg["vocab_size"], (BATCH, t), dtype=torch.long)
    targets = torch.randint(0, cfg["vocab_size"], (BATCH, t), dtype=torch.long)
    targets[1, 3] = -100
    logits, loss = model(ids, targets)
    loss.backward()
    tensors[f"{name}.ids"] = ids
    tensors[f"{name}.targets"] = targets
    tensors[f"{name}.logits"] = logits.detach().to(torch.float32)
    tensors[f"{name}.loss"] = loss.detach().to(torch.float32)
    for pname, p in params.items():
        tensors[f"{name}.grad.{pname}"] = p.grad.to(torch.float32)


def main():
    torch.manual_seed(0)
    tensors = {}
    metadata = {
        "format": "ferrograd-gpt-fixtures",
        "version": "1",
        "torch_version": str(torch.__version__),
        "generator": "tools/make_gpt_fixtures.py",
    }
    for name, cfg in CASES.items():
        run_case(name, cfg, tensors)
        metadata[name] = json.dumps(cfg, sort_keys=True)
    tensors = {k: v.contiguous() for k, v in tensors.items()}
    os.makedirs(os.path.dirname(OUT_PATH), exist_ok=True)
    with open(OUT_PATH, "wb") as f:
        f.write(serialize(tensors, metadata))
    size = os.path.getsize(OUT_PATH)
    print(f"wrote {OUT_PATH}: {len(CASES)} cases, {len(tensors)} tensors, {size} bytes")
    if size >= 300 * 1024:
        sys.exit("fixture file is too large (>= 300 KB)")


if __name__ == "__main__":
    main()
