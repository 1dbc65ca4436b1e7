#!/usr/bin/env bash
# The memory-strategy table on a GPU machine, after `scripts/gpu_tests.sh build` (here) has put
# the `strategies` bench into .bin/: for the MLP (d=10000, B=1000) and GPT-2 124M (B=8, T=1024),
# each strategy (baseline, bf16, f16, recompute, accum4, freeze, step-in-backward) runs in
# ferrograd and in PyTorch (benches/pytorch/strategies.py), each run its own process; plus
# step-in-backward-fused, ferrograd only and MLP only (SGD momentum fused into the weight
# GEMMs: no PyTorch twin, and GPT's AdamW cannot fuse). Prints a markdown table of step times
# and peak bytes, and the step-in-backward target line (the better of the two ferrograd
# step-in-backward peaks, named).
#
# Usage: scripts/gpu_strategies.sh [PYTHON_WITH_TORCH] [--smoke]
#   --smoke   tiny sizes (MLP d=256 B=64, tiny-gpt B=4 T=64, 2 steps): checks the script.
# Environment: OUT (a folder: strategies.jsonl and strategies.log are written there),
#   DEVICE (default cuda), STRATEGIES_BIN (default .bin/strategies), MODELS and STRATEGIES
#   (space-separated subsets, to split the table over several calls), DEADLINE_S (default
#   560: no run goes on past it, later runs are skipped), RUN_TIMEOUT_S (default 180 per run).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=python3
SMOKE=0
for arg in "$@"; do
  case "$arg" in
    --smoke) SMOKE=1 ;;
    -h | --help) sed -n '2,16p' "$0"; exit 0 ;;
    *) PY="$arg" ;;
  esac
done
DEVICE="${DEVICE:-cuda}"
BIN="${STRATEGIES_BIN:-.bin/strategies}"
DEADLINE_S="${DEADLINE_S:-560}"
RUN_TIMEOUT_S="${RUN_TIMEOUT_S:-180}"
STRATEGIES="${STRATEGIES:-baseline bf16 f16 recompute recompute-bf16 accum4 freeze step-in-backward step-in-backward-fused}"
if [ "$SMOKE" = 1 ]; then
  MODELS="${MODELS:-mlp tiny-gpt}"
  declare -A FLAGS=([mlp]="--dim 256 --batch 64 --steps 2 --warmup 1"
    [tiny-gpt]="--batch 4 --seq 64 --steps 2 --warmup 1")
else
  MODELS="${MODELS:-mlp gpt2}"
  declare -A FLAGS=([mlp]="--dim 10000 --batch 1000 --steps 10 --warmup 3"
    [gpt2]="--batch 8 --seq 1024 --steps 5 --warmup 3")
fi
if [ ! -x "$BIN" ]; then
  echo "no $BIN: run scripts/gpu_tests.sh build first (or set STRATEGIES_BIN)" >&2
  exit 2
fi
if [ -n "${OUT:-}" ]; then
  mkdir -p "$OUT"
  JSONL="$OUT/strategies.jsonl"
  LOG="$OUT/strategies.log"
else
  JSONL=$(mktemp)
  LOG=$(mktemp)
fi
: >"$JSONL"
: >"$LOG"
START=$SECONDS

# Runs one benchmark process; appends its JSON line, or an error line, to $JSONL.
run_one() {
  local impl="$1" model="$2" strategy="$3"
  shift 3
  local err out rc line left limit
  left=$((DEADLINE_S - (SECONDS - START)))
  if [ "$left" -lt 15 ]; then
    printf '{"impl":"%s","model":"%s","strategy":"%s","error":"skipped: past DEADLINE_S"}\n' \
      "$impl" "$model" "$strategy" >>"$JSONL"
    echo "$impl $model $strategy: skipped (past DEADLINE_S)"
    return
  fi
  limit=$((left < RUN_TIMEOUT_S ? left : RUN_TIMEOUT_S))
  err=$(mktemp)
  out=$(timeout "$limit" "$@" --model "$model" --strategy "$strategy" --device "$DEVICE" \
    ${FLAGS[$model]} 2>"$err")
  rc=$?
  [ "$rc" -eq 124 ] && echo "timed out after $limit s" >>"$err"
  line=$(printf '%s\n' "$out" | grep '^{' | tail -1)
  { echo "== $impl $model $strategy (rc $rc)"; cat "$err"; } >>"$LOG"
  if [ "$rc" -eq 0 ] && [ -n "$line" ]; then
    printf '%s\n' "$line" >>"$JSONL"
    echo "$impl $model $strategy: ok ($((SECONDS - START)) s)"
  else
    local why
    why=$(tail -3 "$err" | tr -d '"\\' | tr '\n' ' ' | cut -c1-300)
    printf '{"impl":"%s","model":"%s","strategy":"%s","error":"rc %s: %s"}\n' \
      "$impl" "$model" "$strategy" "$rc" "$why" >>"$JSONL"
    echo "$impl $model $strategy: FAILED (rc $rc): $why"
  fi
  rm -f "$err"
}

for model in $MODELS; do
  for strategy in $STRATEGIES; do
    if [ "$strategy" = step-in-backward-fused ]; then
      # Ferrograd only (PyTorch has no such step), and SGD only: the MLP models.
      case "$model" in
        mlp) run_one ferrograd "$model" "$strategy" "$BIN" ;;
        *) echo "ferrograd $model $strategy: not run (AdamW cannot fuse)" ;;
      esac
      continue
    fi
    run_one ferrograd "$model" "$strategy" "$BIN"
    run_one pytorch "$model" "$strategy" "$PY" benches/pytorch/strategies.py
  done
done
echo "total $((SECONDS - START)) s; JSON lines in $JSONL, logs in $LOG"

# The table needs only the standard library: python3, else the given interpreter.
FMT_PY=$(command -v python3 || echo "$PY")
"$FMT_PY" - "$JSONL" <<'EOF'
"""Formats the strategy table from the JSON lines."""
import json
import sys

rows = {}
with open(sys.argv[1]) as f:
    for text in f:
        text = text.strip()
        if text:
            r = json.loads(text)
            rows[(r["impl"], r["model"], r["strategy"])] = r


def mib(b):
    return "-" if b is None else f"{b / 2**20:,.1f} MiB"


def ms(r):
    return "-" if r.get("step_ms") is None else f"{r['step_ms']:.2f}"


def ratio(a, b):
    return "-" if a is None or b is None or b == 0 else f"{a / b:.2f}"


order = []
for impl, model, strategy in rows:
    if (model, strategy) not in order:
        order.append((model, strategy))
print()
print("| model | strategy | ours ms | PyTorch ms | time ratio | ours peak | PyTorch peak | peak ratio |")
print("|---|---|---:|---:|---:|---:|---:|---:|")
above, failed = [], []
for model, strategy in order:
    o = rows.get(("ferrograd", model, strategy), {})
    p = rows.get(("pytorch", model, strategy), {})
    for impl, r in (("ours", o), ("PyTorch", p)):
        if impl == "PyTorch" and strategy == "step-in-backward-fused" and not r:
            continue  # no PyTorch twin
        if "error" in r or not r:
            failed.append(f"{impl} {model} {strategy}: {r.get('error', 'no result')}")
    op, pp = o.get("peak_bytes"), p.get("peak_bytes")
    if op is not None and pp is not None and op > pp:
        above.append(f"{model} {strategy}")
    print(
        f"| {model} | {strategy} | {ms(o)} | {ms(p)} | {ratio(o.get('step_ms'), p.get('step_ms'))} "
        f"| {mib(op)} | {mib(pp)} | {ratio(op, pp)} |"
    )
print()
print("ratios are ours / PyTorch; peak = max_memory_allocated over the measured steps")
compared = sum(
    1
    for m, s in order
    if rows.get(("ferrograd", m, s), {}).get("peak_bytes") is not None
    and rows.get(("pytorch", m, s), {}).get("peak_bytes") is not None
)
print(f"peak <= PyTorch's: {compared - len(above)}/{compared}" + (f"; above: {', '.join(above)}" if above else ""))
# The better (lower peak) of the plain and the fused ferrograd step in backward.
candidates = [
    (r["peak_bytes"], s)
    for s in ("step-in-backward", "step-in-backward-fused")
    for r in [rows.get(("ferrograd", "mlp", s), {})]
    if r.get("peak_bytes") is not None
]
ours, which = min(candidates) if candidates else (None, None)
base = rows.get(("pytorch", "mlp", "baseline"), {}).get("peak_bytes")
if ours is not None and base:
    below = 100.0 * (1.0 - ours / base)
    verdict = "met" if below >= 20.0 else "NOT met"
    print(
        f"MLP step-in-backward target: ours ({which}) {mib(ours)} vs PyTorch baseline (SGD momentum) "
        f"{mib(base)}: {below:.1f}% below (target >= 20%: {verdict})"
    )
else:
    print("MLP step-in-backward target: no peak figures (CPU run or a failed run)")
for line in failed:
    print("FAILED", line)
EOF
