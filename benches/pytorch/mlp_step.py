"""PyTorch twin of crates/ferrograd/benches/mlp_step.rs: one training step of
Linear(d,d)-ReLU-Linear(d,d), MSE loss, backward, SGD(momentum=0.9) step, zero_grad, f32.
Prints the median step time after 3 warm-up steps. Not a dependency of the project: run it
in any environment that has torch.

Usage: python benches/pytorch/mlp_step.py [--dim 2048] [--batch 256] [--steps 20] [--device cpu]
"""
import argparse
import time

import torch


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dim", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--device", default="cpu")
    a = ap.parse_args()
    dev = torch.device(a.device)
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(a.dim, a.dim), torch.nn.ReLU(), torch.nn.Linear(a.dim, a.dim)
    ).to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    x = torch.randn(a.batch, a.dim, device=dev)
    y = torch.randn(a.batch, a.dim, device=dev)
    times = []
    for i in range(a.steps + 3):
        if dev.type == "cuda":
            torch.cuda.synchronize()
            if i == 3:
                torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        if i >= 3:
            times.append((time.perf_counter() - t0) * 1e3)
    times.sort()
    peak = torch.cuda.max_memory_allocated() if dev.type == "cuda" else -1
    print(
        f"pytorch mlp_step d={a.dim} B={a.batch} threads={torch.get_num_threads()} "
        f"median_ms={times[len(times) // 2]:.2f} min_ms={times[0]:.2f} peak_bytes={peak}"
    )


if __name__ == "__main__":
    main()
