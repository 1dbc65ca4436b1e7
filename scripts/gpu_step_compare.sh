#!/usr/bin/env bash
# Step times of two builds of the `strategies` bench on one GPU, for a regression check
# (a refactor must not slow the step): each (model, strategy) runs in build A and build B
# alternately, REPEAT times each, each run its own process; prints the median step time of
# each build, their ratio, and both peaks.
#
# Usage: scripts/gpu_step_compare.sh BIN_A BIN_B
# Environment: MODELS (default "mlp gpt2"), STRATEGIES (default "baseline bf16"),
#   REPEAT (default 3), DEVICE (default cuda), OUT (a folder for the raw JSON lines).
set -uo pipefail
A="$1"
B="$2"
MODELS="${MODELS:-mlp gpt2}"
STRATEGIES="${STRATEGIES:-baseline bf16}"
REPEAT="${REPEAT:-3}"
DEVICE="${DEVICE:-cuda}"
declare -A FLAGS=([mlp]="--dim 10000 --batch 1000 --steps 10 --warmup 3"
  [gpt2]="--batch 8 --seq 1024 --steps 5 --warmup 3")
JSONL="${OUT:-/tmp}/step_compare.jsonl"
: >"$JSONL"

for model in $MODELS; do
  for strategy in $STRATEGIES; do
    for i in $(seq "$REPEAT"); do
      for build in A B; do
        bin=$A
        [ "$build" = B ] && bin=$B
        line=$("$bin" --model "$model" --strategy "$strategy" --device "$DEVICE" \
          ${FLAGS[$model]} 2>/dev/null | grep '^{' | tail -1)
        [ -n "$line" ] && printf '{"build":"%s","run":%s,"r":%s}\n' "$build" "$i" "$line" >>"$JSONL"
      done
    done
  done
done

python3 - "$JSONL" <<'EOF'
"""Medians per build and the B/A ratio."""
import json
import statistics
import sys

runs = {}
for text in open(sys.argv[1]):
    rec = json.loads(text)
    r = rec["r"]
    runs.setdefault((r["model"], r["strategy"]), {}).setdefault(rec["build"], []).append(r)

print("| model | strategy | A ms (median) | B ms (median) | B/A | A peak B | B peak B | runs |")
print("|---|---|---:|---:|---:|---:|---:|---|")
for (model, strategy), by in runs.items():
    med = {k: statistics.median(x["step_ms"] for x in v) for k, v in by.items()}
    peak = {k: v[0]["peak_bytes"] for k, v in by.items()}
    a, b = med.get("A"), med.get("B")
    ratio = f"{b / a:.3f}" if a and b else "-"
    all_ms = {k: ", ".join(f"{x['step_ms']:.2f}" for x in v) for k, v in by.items()}
    fmt_ms = lambda v: "-" if v is None else f"{v:.2f}"
    fmt_b = lambda v: "-" if v is None else f"{v:,}"
    print(
        f"| {model} | {strategy} | {fmt_ms(a)} | {fmt_ms(b)} | {ratio} | "
        f"{fmt_b(peak.get('A'))} | {fmt_b(peak.get('B'))} | A: {all_ms.get('A', '')}; B: {all_ms.get('B', '')} |"
    )
EOF
