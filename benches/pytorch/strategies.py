"""PyTorch twin of crates/ferrograd/benches/strategies.rs: one training step of a model under
each memory strategy, with the same flags and the same JSON line ("impl": "pytorch"): median
step time, torch.cuda.max_memory_allocated / max_memory_reserved over the measured steps (the
peak statistics are reset after warm-up; null on a CPU, where PyTorch does not count bytes),
and the last loss. Not a dependency of the project: run it in any environment that has torch.

Models: `mlp` = Linear(d, d) -> ReLU -> Linear(d, d), MSE to a random target, SGD momentum 0.9,
lr 1e-3. `gpt2` = GPT-2 124M written out as nanoGPT does (pre-norm blocks, GELU tanh, tied
head, dropout 0) with AdamW (defaults, lr 6e-4, foreach default, not fused); `tiny-gpt` = the
same with 2 layers, 4 heads, width 64, vocab 65, context 64. Attention is written by hand,
q @ k^T * 1/sqrt(hs), masked_fill(-inf), softmax, @ v: the same math (and saved tensors) as
ferrograd's, NOT scaled_dot_product_attention (whose fused kernels save far less).

Strategies (as the Rust bench): baseline, bf16 (torch.autocast), f16 (autocast + GradScaler),
recompute (torch.utils.checkpoint, use_reentrant=False: the whole MLP forward / every GPT
block), recompute-bf16 (recompute's checkpointing inside bf16's autocast region: with
use_reentrant=False the recomputation in backward runs under the forward's autocast state),
accum4 (4 micro-batches of B/4, each loss / 4), freeze (MLP "0.*"; GPT embeddings and
the first half of the blocks), step-in-backward (PyTorch has no built-in: one optimizer per
parameter stepped from register_post_accumulate_grad_hook, as PyTorch's tutorial "How to save
memory by fusing the optimizer step into the backward pass").

Usage: python benches/pytorch/strategies.py --model mlp|gpt2|tiny-gpt --strategy S
       [--device cpu|cuda] [--steps 10] [--warmup 3] [--dim 10000] [--batch B] [--seq T]
       [--vocab V] [--sdpa] [--compile] [--fused-adam]
--sdpa, --compile and --fused-adam give the fastest PyTorch configuration to compare speed
against (its peak is then no longer the same-math comparison).
"""
import argparse
import fnmatch
import json
import math
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

STRATEGIES = [
    "baseline",
    "bf16",
    "f16",
    "recompute",
    "recompute-bf16",
    "accum4",
    "freeze",
    "step-in-backward",
]
# The strategies whose forward is recomputed in backward.
RECOMPUTE = ("recompute", "recompute-bf16")
MODELS = ["mlp", "gpt2", "tiny-gpt"]
MICRO_BATCHES = 4
# --sdpa: attention through scaled_dot_product_attention (PyTorch's fused kernels).
SDPA = False

GPT_CONFIGS = {
    "gpt2": dict(vocab=50257, block=1024, n_layer=12, n_head=12, n_embd=768),
    "tiny-gpt": dict(vocab=65, block=64, n_layer=2, n_head=4, n_embd=64),
}


class CausalSelfAttention(nn.Module):
    def __init__(self, c, n_head):
        super().__init__()
        self.c_attn = nn.Linear(c, 3 * c)
        self.c_proj = nn.Linear(c, c)
        self.n_head = n_head

    def forward(self, x, masked):
        # x: (B, T, C); masked: (T', T') bool, True above the diagonal.
        b, t, c = x.size()
        hs = c // self.n_head
        q, k, v = self.c_attn(x).split(c, dim=2)
        q = q.view(b, t, self.n_head, hs).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(b, t, self.n_head, hs).transpose(1, 2)
        v = v.view(b, t, self.n_head, hs).transpose(1, 2)
        if SDPA:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hs))  # (B, nh, T, T)
            att = att.masked_fill(masked[:t, :t], float("-inf"))
            att = F.softmax(att, dim=-1)
            y = att @ v
        y = y.transpose(1, 2).contiguous().view(b, t, c)
        return self.c_proj(y)


class Mlp(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.c_fc = nn.Linear(c, 4 * c)
        self.c_proj = nn.Linear(4 * c, c)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, c, n_head):
        super().__init__()
        self.ln_1 = nn.LayerNorm(c)
        self.attn = CausalSelfAttention(c, n_head)
        self.ln_2 = nn.LayerNorm(c)
        self.mlp = Mlp(c)

    def forward(self, x, masked):
        x = x + self.attn(self.ln_1(x), masked)
        return x + self.mlp(self.ln_2(x))


class Gpt(nn.Module):
    def __init__(self, vocab, block, n_layer, n_head, n_embd):
        super().__init__()
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(vocab, n_embd),
                wpe=nn.Embedding(block, n_embd),
                h=nn.ModuleList([Block(n_embd, n_head) for _ in range(n_layer)]),
                ln_f=nn.LayerNorm(n_embd),
            )
        )
        self.lm_head = nn.Linear(n_embd, vocab, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # tied, as GPT-2
        # One mask shared by every layer (as ferrograd's), not one buffer per layer.
        self.register_buffer(
            "masked", torch.ones(block, block, dtype=torch.bool).triu(1), persistent=False
        )
        self.recompute = False
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))

    @staticmethod
    def _init_weights(m):
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)

    def forward(self, ids, targets):
        t = ids.size(1)
        pos = torch.arange(0, t, dtype=torch.long, device=ids.device)
        x = self.transformer.wte(ids) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            if self.recompute:
                x = checkpoint(block, x, self.masked, use_reentrant=False)
            else:
                x = block(x, self.masked)
        logits = self.lm_head(self.transformer.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-100)


def micro(t, i, n):
    """Rows i*B/n .. (i+1)*B/n of t (a view)."""
    if n == 1:
        return t
    rows = t.size(0) // n
    return t.narrow(0, i * rows, rows)


def freeze(model, pattern):
    names = [n for n, p in model.named_parameters() if fnmatch.fnmatchcase(n, pattern)]
    if not names:
        raise SystemExit(f"strategies.py: pattern {pattern!r} matches no parameter")
    for n, p in model.named_parameters():
        if n in names:
            p.requires_grad_(False)


def build(a, dev):
    """(model, loss_of(i, n), make_optimizer(params))"""
    torch.manual_seed(0)
    if a.model == "mlp":
        model = nn.Sequential(nn.Linear(a.dim, a.dim), nn.ReLU(), nn.Linear(a.dim, a.dim)).to(dev)
        x = torch.randn(a.batch, a.dim, device=dev)
        y = torch.randn(a.batch, a.dim, device=dev)
        if a.strategy == "freeze":
            freeze(model, "0.*")
        if a.strategy in RECOMPUTE:
            # The whole forward is recomputed in backward; only x is kept.
            def loss_of(i, n):
                out = checkpoint(model, micro(x, i, n), use_reentrant=False)
                return F.mse_loss(out, micro(y, i, n))
        else:
            def loss_of(i, n):
                return F.mse_loss(model(micro(x, i, n)), micro(y, i, n))

        def make_opt(params, **kw):
            return torch.optim.SGD(params, lr=1e-3, momentum=0.9, **kw)

        return model, loss_of, make_opt
    cfg = dict(GPT_CONFIGS[a.model])
    if a.vocab is not None:
        cfg["vocab"] = a.vocab
    model = Gpt(**cfg).to(dev)
    if a.strategy in RECOMPUTE:
        model.recompute = True
    if a.strategy == "freeze":
        for pattern in ["transformer.wte.*", "transformer.wpe.*"] + [
            f"transformer.h.{i}.*" for i in range(cfg["n_layer"] // 2)
        ]:
            freeze(model, pattern)
    g = torch.Generator(device="cpu").manual_seed(1)
    ids = torch.randint(0, cfg["vocab"], (a.batch, a.seq), generator=g).to(dev)
    targets = torch.randint(0, cfg["vocab"], (a.batch, a.seq), generator=g).to(dev)

    def loss_of(i, n):
        return model(micro(ids, i, n), micro(targets, i, n))

    def make_opt(params, **kw):
        if a.fused_adam and "foreach" not in kw:
            kw["fused"] = True
        return torch.optim.AdamW(params, lr=6e-4, **kw)

    if a.compile:
        model = torch.compile(model)
    return model, loss_of, make_opt


def make_step(a, dev, model, loss_of, make_opt):
    """A function running one training step; returns the loss (a tensor or a float)."""
    params = [p for p in model.parameters() if p.requires_grad]
    s = a.strategy
    if s == "step-in-backward":
        # The tutorial's recipe: each parameter's optimizer steps as soon as its gradient is
        # accumulated, then frees that gradient.
        opts = {p: make_opt([p], foreach=False) for p in params}

        def hook(p):
            opts[p].step()
            opts[p].zero_grad()

        for p in params:
            p.register_post_accumulate_grad_hook(hook)

        def step():
            loss = loss_of(0, 1)
            loss.backward()
            return loss

        return step
    opt = make_opt(params)
    if s == "accum4":
        def step():
            total = 0.0
            for i in range(MICRO_BATCHES):
                loss = loss_of(i, MICRO_BATCHES)
                total += loss.item()
                (loss * (1.0 / MICRO_BATCHES)).backward()
            opt.step()
            opt.zero_grad()
            return total / MICRO_BATCHES

        return step
    if s == "f16":
        scaler = torch.amp.GradScaler(dev.type)

        def step():
            with torch.autocast(dev.type, dtype=torch.float16):
                loss = loss_of(0, 1)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            return loss

        return step
    dtype = torch.bfloat16 if s in ("bf16", "recompute-bf16") else None

    def step():
        if dtype is not None:
            with torch.autocast(dev.type, dtype=dtype):
                loss = loss_of(0, 1)
        else:
            loss = loss_of(0, 1)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    return step


def print_kernel_times(prof):
    """The measured steps' GPU kernels, the most time first, in the layout of ours."""
    rows = [e for e in prof.key_averages() if e.self_device_time_total > 0]
    rows.sort(key=lambda e: -e.self_device_time_total)
    total = sum(e.self_device_time_total for e in rows)
    print(f"{total / 1e3:>9.3f} ms device busy (all kernels)", file=sys.stderr)
    for e in rows[:60]:
        print(
            f"{e.self_device_time_total / 1e3:>9.3f} ms {100 * e.self_device_time_total / total:>5.1f}% "
            f"{e.count:>7} calls  {e.key[:110]}",
            file=sys.stderr,
        )


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True, choices=MODELS)
    ap.add_argument("--strategy", required=True, choices=STRATEGIES)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--dim", type=int, default=10000)
    ap.add_argument("--batch", type=int, default=None)
    ap.add_argument("--seq", type=int, default=None)
    ap.add_argument("--vocab", type=int, default=None, help="the GPT's vocabulary (e.g. 50304)")
    ap.add_argument("--sdpa", action="store_true", help="GPT attention through F.scaled_dot_product_attention")
    ap.add_argument("--compile", action="store_true", help="torch.compile the GPT model")
    ap.add_argument("--fused-adam", action="store_true", help="AdamW(fused=True)")
    ap.add_argument(
        "--profile", action="store_true",
        help="print the GPU kernels of the measured steps, the most time first (to stderr)",
    )
    a = ap.parse_args()
    global SDPA
    SDPA = a.sdpa
    if a.batch is None:
        a.batch = {"mlp": 1000, "gpt2": 8}.get(a.model, 4)
    if a.seq is None:
        a.seq = {"gpt2": 1024, "tiny-gpt": 64}.get(a.model, 0)
    if a.steps < 1:
        ap.error("--steps must be at least 1")
    if a.strategy == "accum4" and a.batch % MICRO_BATCHES:
        ap.error(f"accum4 splits the batch in {MICRO_BATCHES}: --batch {a.batch} is not a multiple")
    dev = torch.device(a.device)
    cuda = dev.type == "cuda"
    # Plain f32 matmuls on both sides: TF32 is off by default in PyTorch and in ferrograd.
    assert not torch.backends.cuda.matmul.allow_tf32, "TF32 matmuls must stay off"
    model, loss_of, make_opt = build(a, dev)
    step = make_step(a, dev, model, loss_of, make_opt)
    times, last = [], float("nan")
    prof = None
    for i in range(a.warmup + a.steps):
        if a.profile and i == a.warmup:
            prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
            prof.__enter__()
        if cuda:
            if i == a.warmup:
                torch.cuda.reset_peak_memory_stats()
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = step()
        if cuda:
            torch.cuda.synchronize()
        if i >= a.warmup:
            times.append((time.perf_counter() - t0) * 1e3)
        last = loss if isinstance(loss, float) else loss.item()
    if prof is not None:
        prof.__exit__(None, None, None)
        print_kernel_times(prof)
    times.sort()
    peak = torch.cuda.max_memory_allocated() if cuda else None
    reserved = torch.cuda.max_memory_reserved() if cuda else None
    median = times[len(times) // 2]
    print(
        f"pytorch {a.model} {a.strategy} device={dev} median_ms={median:.2f} "
        f"peak_bytes={peak} reserved_bytes={reserved} loss={last:.4f}",
        file=sys.stderr,
    )
    line = {
        "impl": "pytorch",
        "model": a.model,
        "strategy": a.strategy,
        "device": str(dev),
        "batch": a.batch,
        "dim": a.dim if a.model == "mlp" else None,
        "seq": None if a.model == "mlp" else a.seq,
        "steps": a.steps,
        "step_ms": median,
        "peak_bytes": peak,
        "reserved_bytes": reserved,
        "loss": last if math.isfinite(last) else None,
    }
    print(json.dumps(line, sort_keys=True))


if __name__ == "__main__":
    main()
