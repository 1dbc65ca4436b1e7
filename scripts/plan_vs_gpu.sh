#!/usr/bin/env bash
# The planner against the GPU: each configuration is trained for two steps on the GPU by
# `ferrograd train --json`, whose summary holds the plan it made on the meta device before
# training (predicted_peak_bytes, predicted_peak_reserved_bytes) and the measured peaks
# (peak_bytes, peak_reserved_bytes). Prints one row per configuration with the errors, then
# two budget-fitted GPT-2 runs (`--fit-budget`) and their measured peaks.
#   scripts/plan_vs_gpu.sh [path/to/ferrograd]      (default: .bin/ferrograd)
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${1:-.bin/ferrograd}
LOG=${OUT:-/tmp}/plan_vs_gpu
mkdir -p "$LOG"

GPT2="--n-layer 12 --n-head 12 --n-embd 768 --block-size 1024 --vocab-size 50257"
SHORT="--device cuda --max-steps 2 --warmup 1 --eval-every 0 --eval-batches 1 --sample-chars 0 --json"

rows=(
  "main-job f32|"
  "main-job bf16|--amp bf16"
  "main-job recompute|--recompute every:1"
  "gpt2 f32 B1|$GPT2 --batch-size 1"
  "gpt2 f32 B4|$GPT2 --batch-size 4"
  "gpt2 f32 B8|$GPT2 --batch-size 8"
  "gpt2 bf16 B1|$GPT2 --batch-size 1 --amp bf16"
  "gpt2 bf16 B4|$GPT2 --batch-size 4 --amp bf16"
  "gpt2 bf16 B8|$GPT2 --batch-size 8 --amp bf16"
  "gpt2 bf16 B16|$GPT2 --batch-size 16 --amp bf16"
  "gpt2 f16 B8|$GPT2 --batch-size 8 --amp f16"
  "gpt2 f16 B16|$GPT2 --batch-size 16 --amp f16"
  "gpt2 f32 recompute B4|$GPT2 --batch-size 4 --recompute every:1"
  "gpt2 bf16 recompute B8|$GPT2 --batch-size 8 --amp bf16 --recompute every:1"
  "gpt2 bf16 recompute B16|$GPT2 --batch-size 16 --amp bf16 --recompute every:1"
  "gpt2 f16 recompute2 B8|$GPT2 --batch-size 8 --amp f16 --recompute every:2"
  "gpt2 f32 accum4 B2|$GPT2 --batch-size 2 --accum 4"
  "gpt2 bf16 accum4 B4|$GPT2 --batch-size 4 --accum 4 --amp bf16"
  "gpt2 f32 freeze B4|$GPT2 --batch-size 4 --freeze transformer.h.0.* --freeze transformer.h.1.*"
  "gpt2 bf16 freeze B8|$GPT2 --batch-size 8 --amp bf16 --freeze transformer.h.0.*"
  "gpt2 bf16 clip B8|$GPT2 --batch-size 8 --amp bf16 --clip 1.0"
  "gpt2 bf16 step-in-bwd B8|$GPT2 --batch-size 8 --amp bf16 --step-in-backward"
)

summarize() {
  python3 - "$@" <<'EOF'
import json, sys
name, path = sys.argv[1], sys.argv[2]
try:
    s = json.loads(open(path).read().strip().splitlines()[-1])
except Exception as e:
    print(f"| {name} | failed: {e} | | | | | |"); sys.exit(0)
pa, ma = s["predicted_peak_bytes"], s["peak_bytes"]
pr, mr = s["predicted_peak_reserved_bytes"], s["peak_reserved_bytes"]
ea, er = 100 * (pa - ma) / ma, 100 * (pr - mr) / mr
ok = "ok" if abs(ea) <= 1 and abs(er) <= 5 else "MISS"
print(f"| {name} | {pa:,} | {ma:,} | {ea:+.3f}% | {pr:,} | {mr:,} | {er:+.2f}% | {ok} |")
EOF
}

echo "| config | planned alloc | measured alloc | error | planned reserved | measured reserved | error | |"
echo "|---|---:|---:|---:|---:|---:|---:|---|"
for row in "${rows[@]}"; do
  name=${row%%|*}; flags=${row#*|}
  file="$LOG/$(echo "$name" | tr ' ' '_').json"
  # shellcheck disable=SC2086
  "$BIN" train $SHORT $flags >"$file" 2>"$file.err" || true
  summarize "$name" "$file"
done

echo
echo "demo MLP (Linear-ReLU-Linear, f32): planned vs measured peak allocated"
for size in "10000 1000" "4096 512"; do
  set -- $size
  "$BIN" demo --device cuda --dim "$1" --batch "$2" --json >"$LOG/demo_$1.json" 2>&1 || true
  python3 - "$1" "$2" "$LOG/demo_$1.json" <<'EOF'
import json, sys
d, b, path = sys.argv[1:]
try:
    s = json.loads(open(path).read().strip().splitlines()[-1])
    p, m = s["planned_peak_bytes"], s["peak_bytes"]
    print(f"| demo d={d} B={b} | {p:,} | {m:,} | {100*(p-m)/m:+.3f}% |")
except Exception as e:
    print(f"| demo d={d} B={b} | failed: {e} |")
EOF
done

echo
echo "GPT-2 124M bf16, effective batch 32, fitted to a budget (--fit-budget): measured peaks"
for budget in 12GiB 24GiB; do
  file="$LOG/fit_$budget.json"
  # shellcheck disable=SC2086
  "$BIN" train $SHORT $GPT2 --amp bf16 --batch-size 32 --fit-budget "$budget" >"$file" 2>"$file.err" || true
  chosen=$(grep -o 'fit to .*' "$file.err" | head -1 || true)
  python3 - "$budget" "$file" "$chosen" <<'EOF'
import json, sys
budget, path, chosen = sys.argv[1:]
units = {"GiB": 2**30}
limit = int(budget[:-3]) * units[budget[-3:]]
try:
    s = json.loads(open(path).read().strip().splitlines()[-1])
    ok = "within" if s["peak_reserved_bytes"] <= limit else "OVER"
    print(f"| {budget} | {chosen} | measured {s['peak_bytes']:,} allocated, {s['peak_reserved_bytes']:,} reserved: {ok} the budget |")
except Exception as e:
    print(f"| {budget} | failed: {e} |")
EOF
done
