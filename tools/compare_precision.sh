#!/usr/bin/env bash
# The two answers to low-precision RL on ShapeWorld (docs/BENCHMARKS.md, "FP8 rollouts:
# Sol-RL's split against Jet-RL's unified flow"), at equal rollout NFE (16 prompts x 16
# samples x 10 steps = 2560 per iteration):
#   bf16     toy_flowgrpo as shipped;
#   naive    FP8 rollouts of the policy, the BF16 update on them (precision.rollout fp8);
#   unified  FP8 rollouts and FP8 training forward, one quantizer (+ precision.train fp8);
#   solrl    Sol-RL: an FP8 pool of 12 per prompt, the best 2 and worst 2 regenerated in
#            BF16 (16 x (12 + 4) x 10 = 2560 NFE) and trained in micro-batches of 16, so
#            that it takes the same 8 optimizer steps per iteration as the others.
# All four quantize with the reference FP8 casts (the CPU has no FP8 GEMMs).
# WINDOW=all trains every denoising step (sampling.sde_window [0, 10]) instead of the
# shipped high-noise window [0, 4], where the naive split's log-prob gap is largest
# (the low-noise steps), for bf16 and naive only (the unified flow's gap is 0 by
# construction, and its reference casts cost the most CPU time).
#   tools/compare_precision.sh OUT_DIR [ITERATIONS=50] [EVERY=25] [SEEDS="0 1 2"]
#   WINDOW=all tools/compare_precision.sh OUT_DIR 20 20
set -euo pipefail
out=${1:?usage: tools/compare_precision.sh OUT_DIR [ITERATIONS] [EVERY] [SEEDS]}
base=toy_flowgrpo
methods=(
  "bf16=$base"
  "naive=$base --set precision.rollout=fp8 --set precision.backend=reference"
  "unified=$base --set precision.rollout=fp8 --set precision.train=fp8 --set precision.backend=reference"
  "solrl=$base --set solrl.enabled=true --set solrl.pool_size=12 --set rollout.group_size=4 --set solrl.precision=fp8 --set solrl.backend=reference --set train.micro_batch_size=16"
)
if [ "${WINDOW:-}" = all ]; then
  all='--set sampling.sde_window=[0,10]'
  methods=("${methods[@]:0:2}")
  methods=("${methods[@]/%/ $all}")
fi
exec "$(dirname "$0")/compare_runs.sh" "$out" "${2:-50}" "${3:-25}" "${4:-0 1 2}" "${methods[@]}"
