"""cuBLAS GEMM throughput through PyTorch (the ceiling ferrograd's GEMM is compared with):
n x n x n matmuls in f32 (TF32 off, as PyTorch's default), tf32 and bf16.

Usage: python benches/pytorch/gemm.py [--n 8192] [--iters 20]
"""
import argparse
import time

import torch


def tflops(n, dtype, iters, tf32=False):
    torch.backends.cuda.matmul.allow_tf32 = tf32
    a = torch.randn(n, n, device="cuda", dtype=dtype)
    b = torch.randn(n, n, device="cuda", dtype=dtype)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        a @ b
    torch.cuda.synchronize()
    return 2 * n**3 * iters / (time.perf_counter() - t0) / 1e12


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=8192)
    ap.add_argument("--iters", type=int, default=20)
    a = ap.parse_args()
    for name, dtype, tf32 in [("f32", torch.float32, False), ("tf32", torch.float32, True), ("bf16", torch.bfloat16, False)]:
        print(f"pytorch gemm n={a.n} {name} tflops={tflops(a.n, dtype, a.iters, tf32):.1f}")


if __name__ == "__main__":
    main()
