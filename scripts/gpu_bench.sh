#!/usr/bin/env bash
# On a GPU machine, after `scripts/gpu_tests.sh build` (here) has filled .bin/: runs ferrograd
# and PyTorch side by side — the demo's memory figures, the MLP training step, GEMM
# throughput — and prints the figures. Usage: scripts/gpu_bench.sh [PYTHON_WITH_TORCH]
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${1:-python3}"
B=.bin
echo "== demo d=10000 B=1000 (bytes) =="
"$B/ferrograd" demo --device cuda --json
"$PY" benches/pytorch/demo.py
echo "== MLP step d=10000 B=1000 f32, SGD momentum (alternating runs) =="
for _ in 1 2 3; do
  "$B/mlp_step" --device cuda --dim 10000 --batch 1000 --steps 20
  "$PY" benches/pytorch/mlp_step.py --device cuda --dim 10000 --batch 1000 --steps 20
done
echo "== GEMM 8192^3 =="
"$B/gemm" --device cuda --n 8192
"$PY" benches/pytorch/gemm.py --n 8192
