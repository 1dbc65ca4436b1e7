"""PyTorch twin of the main job's training loop (`ferrograd train` on its defaults): a
character-level GPT-2 style model (nanoGPT's: pre-norm blocks, GELU tanh, tied head,
F.scaled_dot_product_attention with is_causal=True) of 4 layers, 4 heads, width 128, context 64,
batch 16, AdamW (betas 0.9/0.99, weight decay 0.1) with warmup and cosine decay from 2e-3 to
2e-4, f32, trained on the shipped corpus. Times the training steps only (batch sampling
included, evaluation excluded) and prints tokens/s. Not a dependency of the project: run it in
any environment that has torch.

Usage: python benches/pytorch/gpt_step.py [--steps 200] [--corpus data/shakespeare.txt]
       [--device cpu|cuda] [--n-layer 4] [--n-head 4] [--n-embd 128] [--batch 16] [--block 64]
       [--dropout 0.0] [--amp off|bf16|f16] [--clip NORM] [--warmup-steps 0]
The same flags as `ferrograd train` for the model, so one config runs on both (dropout as
nanoGPT applies it: embeddings, attention probabilities inside SDPA, residual branches).
--amp f16: autocast to float16 with torch.amp.GradScaler (unscaled before clipping), as
`ferrograd train --amp f16` runs it.
--warmup-steps: steps run before the clock starts (GPU: compilation of kernels, allocator
warm-up); the peak statistics are reset after them.
"""
import argparse
import math
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, c, nh, dropout):
        super().__init__()
        self.nh = nh
        self.p = dropout
        self.drop = nn.Dropout(dropout)
        self.ln_1 = nn.LayerNorm(c)
        self.c_attn = nn.Linear(c, 3 * c)
        self.attn_proj = nn.Linear(c, c)
        self.ln_2 = nn.LayerNorm(c)
        self.c_fc = nn.Linear(c, 4 * c)
        self.mlp_proj = nn.Linear(4 * c, c)

    def attn(self, x):
        b, t, c = x.shape
        # (B, T, 3C) -> 3 x (B, nh, T, hs)
        q, k, v = self.c_attn(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.nh, c // self.nh).transpose(1, 2) for z in (q, k, v))
        p = self.p if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=p)
        return self.drop(self.attn_proj(y.transpose(1, 2).contiguous().view(b, t, c)))

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.drop(self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh")))


class Gpt(nn.Module):
    def __init__(self, vocab, block, n_layer, nh, c, dropout=0.0):
        super().__init__()
        self.drop = nn.Dropout(dropout)
        self.wte = nn.Embedding(vocab, c)
        self.wpe = nn.Embedding(block, c)
        self.h = nn.ModuleList(Block(c, nh, dropout) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(c)
        for name, p in self.named_parameters():
            if p.dim() == 2:
                std = 0.02 / math.sqrt(2 * n_layer) if name.endswith("proj.weight") else 0.02
                nn.init.normal_(p, 0.0, std)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, idx, targets):
        t = idx.shape[1]
        x = self.drop(self.wte(idx) + self.wpe(torch.arange(t, device=idx.device)))
        for blk in self.h:
            x = blk(x)
        logits = self.ln_f(x) @ self.wte.weight.T
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))


def lr_at(step, total, warmup=30, peak=2e-3, floor=2e-4):
    if step < warmup:
        return peak * (step + 1) / warmup
    frac = (step - warmup) / max(1, total - warmup)
    return floor + 0.5 * (peak - floor) * (1 + math.cos(math.pi * min(1.0, frac)))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--block", type=int, default=64)
    ap.add_argument("--corpus", default="data/shakespeare.txt")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--n-layer", type=int, default=4)
    ap.add_argument("--n-head", type=int, default=4)
    ap.add_argument("--n-embd", type=int, default=128)
    ap.add_argument("--dropout", type=float, default=0.0)
    ap.add_argument("--amp", default="off", choices=["off", "bf16", "f16"])
    ap.add_argument("--clip", type=float, default=None)
    ap.add_argument("--warmup-steps", type=int, default=0)
    a = ap.parse_args()
    dev = torch.device(a.device)
    cuda = dev.type == "cuda"
    torch.manual_seed(0)
    text = open(a.corpus, encoding="utf-8").read()
    chars = sorted(set(text))
    stoi = {ch: i for i, ch in enumerate(chars)}
    data = torch.tensor([stoi[ch] for ch in text], dtype=torch.long)
    train = data[: int(0.9 * len(data))]
    model = Gpt(len(chars), a.block, a.n_layer, a.n_head, a.n_embd, a.dropout).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, betas=(0.9, 0.99), weight_decay=0.1)
    half = {"bf16": torch.bfloat16, "f16": torch.float16}.get(a.amp)
    scaler = torch.amp.GradScaler(dev.type, enabled=a.amp == "f16")

    def batch():
        ix = torch.randint(len(train) - a.block - 1, (a.batch,))
        x = torch.stack([train[i : i + a.block] for i in ix])
        y = torch.stack([train[i + 1 : i + 1 + a.block] for i in ix])
        return x.to(dev), y.to(dev)

    def step(i):
        for g in opt.param_groups:
            g["lr"] = lr_at(i, a.steps)
        x, y = batch()
        with torch.autocast(dev.type, dtype=half or torch.bfloat16, enabled=half is not None):
            loss = model(x, y)
        scaler.scale(loss).backward()
        if a.clip is not None:
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), a.clip)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        return loss

    for i in range(a.warmup_steps):
        step(i)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    for i in range(a.steps):
        loss = step(i)
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    tokens = a.steps * a.batch * a.block
    print(
        f"pytorch gpt_step steps={a.steps} threads={torch.get_num_threads()} "
        f"capability={torch.backends.cpu.get_cpu_capability()} loss={loss.item():.4f} "
        f"seconds={seconds:.2f} tokens_per_s={tokens / seconds:.0f}"
        + (f" peak_bytes={torch.cuda.max_memory_allocated()}" if cuda else "")
    )


if __name__ == "__main__":
    main()
