#!/usr/bin/env bash
# Sol-RL's algorithmic effect on ShapeWorld, apart from any speed-up (docs/BENCHMARKS.md,
# "Sol-RL: pool size and selection"): the same 8 trained samples per prompt per update,
# picked from an independent NVFP4 pool of 8 (no choice), 16 or 64 candidates by
# best_worst, max_variance or random selection, then regenerated in BF16 from the same
# noise. Each run logs solrl/kendall_tau (exploration vs regeneration rank agreement).
#   scripts/compare_solrl_pools.sh OUT_DIR [ITERATIONS=24] [EVERY=12] [SEEDS="0 1 2"]
set -euo pipefail
out=${1:?usage: scripts/compare_solrl_pools.sh OUT_DIR [ITERATIONS] [EVERY] [SEEDS]}
pool="toy_solrl --set rollout.strategy=independent --set objective.anchor_coef=0.01"
exec "$(dirname "$0")/compare_runs.sh" "$out" "${2:-24}" "${3:-12}" "${4:-0 1 2}" \
  "pool8=$pool --set solrl.pool_size=8" \
  "pool16_best_worst=$pool --set solrl.pool_size=16 --set solrl.select=best_worst" \
  "pool16_random=$pool --set solrl.pool_size=16 --set solrl.select=random" \
  "pool64_best_worst=$pool --set solrl.pool_size=64 --set solrl.select=best_worst" \
  "pool64_max_variance=$pool --set solrl.pool_size=64 --set solrl.select=max_variance" \
  "pool64_random=$pool --set solrl.pool_size=64 --set solrl.select=random"
