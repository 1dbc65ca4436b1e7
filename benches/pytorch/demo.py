"""PyTorch twin of `ferrograd demo`: Sequential(Linear(d,d), ReLU, Linear(d,d)) on (B, d),
forward, output.sum().backward(); prints one JSON object with the same keys as
`ferrograd demo --json` (before/after backward, peak and reserved bytes on the GPU).

Usage: python benches/pytorch/demo.py [--dim 10000] [--batch 1000]
"""
import argparse
import json

import torch


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dim", type=int, default=10000)
    ap.add_argument("--batch", type=int, default=1000)
    a = ap.parse_args()
    dev = torch.device("cuda")
    torch.manual_seed(0)
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    model = torch.nn.Sequential(
        torch.nn.Linear(a.dim, a.dim), torch.nn.ReLU(), torch.nn.Linear(a.dim, a.dim)
    ).to(dev)
    x = torch.randn(a.batch, a.dim, device=dev)
    out = model(x)
    before = torch.cuda.memory_allocated() - base
    out.sum().backward()
    torch.cuda.synchronize()
    print(json.dumps({
        "engine": "pytorch",
        "before_backward_bytes": before,
        "after_backward_bytes": torch.cuda.memory_allocated() - base,
        "peak_bytes": torch.cuda.max_memory_allocated() - base,
        "reserved_bytes": torch.cuda.memory_reserved(),
    }))


if __name__ == "__main__":
    main()
