"""PyTorch twin of crates/ferrograd/benches/attention.rs: causal scaled_dot_product_attention
alone (PyTorch picks the kernel: flash, cuDNN, memory-efficient or math; the JSON's `sdpa_backend`
names its choice; `--backend flash|cudnn|efficient|math` makes it use one) from a (B, T, 3C) QKV
tensor, the heads split as views exactly as GPT-2's attention does, forward and forward +
backward, median milliseconds per call and TFLOP/s counted the same way, and calls queued back
to back (`*_queued_ms`: the device's own time per call, Python's overhead hidden). Prints one JSON line.

Usage: python benches/pytorch/attention.py [--batch 8] [--heads 12] [--seq 1024] [--head-dim 64]
       [--dtype bf16|f16|f32] [--iters 50] [--device cuda|cpu] [--dropout 0]
       [--backend auto|flash|cudnn|efficient|math]
"""
import argparse
import contextlib
import json
import time

import torch
import torch.nn.functional as F


def sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def median_ms(fn, iters, device):
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
    times.sort()
    return times[len(times) // 2]


def queued_ms(fn, iters, device):
    """Milliseconds per call over `iters` calls queued back to back, one sync before and after."""
    for _ in range(3):
        fn()
    sync(device)
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    sync(device)
    return (time.perf_counter() - t0) * 1e3 / max(iters, 1)


def sdpa_backend(q, k, v, dropout):
    """The backend scaled_dot_product_attention picks for these operands (a private PyTorch
    call, so None where this build lacks it)."""
    try:
        from torch.nn.attention import SDPBackend
        return SDPBackend(torch._fused_sdp_choice(q, k, v, dropout_p=dropout, is_causal=True)).name
    except Exception:  # noqa: BLE001 - any failure only means the name is unknown
        return None


BACKENDS = {"flash": "FLASH_ATTENTION", "cudnn": "CUDNN_ATTENTION",
            "efficient": "EFFICIENT_ATTENTION", "math": "MATH"}


def only_backend(name):
    """A context in which SDPA runs on backend `name` alone (PyTorch's choice for "auto")."""
    if name == "auto":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel
    return sdpa_kernel(getattr(SDPBackend, BACKENDS[name]))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--dtype", default="bf16")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--device", default="cuda")
    p.add_argument("--dropout", type=float, default=0.0)
    p.add_argument("--backend", default="auto", choices=["auto", *BACKENDS])
    a = p.parse_args()
    b, h, t, d = a.batch, a.heads, a.seq, a.head_dim
    dtype = {"f16": torch.float16, "f32": torch.float32}.get(a.dtype, torch.bfloat16)
    c = h * d
    qkv = torch.randn(b, t, 3 * c, device=a.device, dtype=dtype, requires_grad=True)
    gout = torch.randn(b, h, t, d, device=a.device, dtype=dtype)

    def attention():
        q, k, v = qkv.split(c, dim=2)
        q, k, v = (x.view(b, t, h, d).transpose(1, 2) for x in (q, k, v))
        return F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                              dropout_p=a.dropout)

    def both():
        attention().backward(gout)
        qkv.grad = None

    with only_backend(a.backend):
        with torch.no_grad():
            q, k, v = (x.view(b, t, h, d).transpose(1, 2) for x in qkv.split(c, dim=2))
            backend = sdpa_backend(q, k, v, a.dropout) if a.backend == "auto" \
                else BACKENDS[a.backend]
            fwd = median_ms(attention, a.iters, a.device)
            fwd_q = queued_ms(attention, a.iters, a.device)
        fb = median_ms(both, a.iters, a.device)
        fb_q = queued_ms(both, a.iters, a.device)
    flops = 4.0 * b * h * t * t * d / 2.0
    print(json.dumps({"impl": "pytorch", "batch": b, "heads": h, "seq": t, "head_dim": d,
                      "dtype": a.dtype, "dropout": a.dropout, "sdpa_backend": backend, "fwd_ms": round(fwd, 4), "fwd_bwd_ms": round(fb, 4),
                      "fwd_queued_ms": round(fwd_q, 4), "fwd_bwd_queued_ms": round(fb_q, 4),
                      "fwd_tflops": round(flops / fwd / 1e9, 1),
                      "fwd_bwd_tflops": round(3.5 * flops / fb / 1e9, 1)}))


if __name__ == "__main__":
    main()
