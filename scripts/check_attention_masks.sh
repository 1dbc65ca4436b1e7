#!/usr/bin/env bash
# Checks, without a GPU, that the attention kernels' shared dropout draws give every element
# the mask the dropout op draws for it. The mask functions are taken verbatim from the kernel
# sources (Philox from prelude.cuh, Problem, draw16 and kept() from attention_common.cuh, kept2 to
# kept_cols2 from attention.cu), compiled for the host with a 32-thread warp whose shuffles
# go through shared slots (scripts/emu/attention_masks.cpp), and compared lane by lane with
# kept() per element, at lengths that are and are not multiples of 8.
# Needs a C++20 compiler (g++ 11 or later, or clang++ 14): CXX=... to pick one.
#   scripts/check_attention_masks.sh
set -euo pipefail
cd "$(dirname "$0")/.."
K=crates/ferrograd/src/backend/cuda/kernels
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
{
  sed -n '/^\/\/ Philox 4x32-10/,/^}/p' "$K/prelude.cuh"
  sed -n '/^struct Problem {/,/^__device__ __forceinline__ i64 row_at/p' "$K/attention_common.cuh" | sed '$d'
  sed -n '/^\/\/ kept() of (i, j) and (i, j + 1)/,/^\/\/ ---- tensor-core primitives/p' "$K/attention.cu"
} >"$work/kernels.inc"
"${CXX:-g++}" -std=c++20 -O2 -pthread -I "$work" scripts/emu/attention_masks.cpp -o "$work/check"
"$work/check"
