#!/usr/bin/env bash
# Sol-RL's algorithmic effect on ShapeWorld, apart from any speed-up (docs/BENCHMARKS.md,
# "Sol-RL: pool size and selection"): the same 8 trained samples per prompt per update,
# picked from an independent NVFP4 pool of 8 (no choice), 16, 32 or 64 candidates by
# best_worst, max_variance or random selection, then regenerated in BF16 from the same
# noise. Each run logs solrl/kendall_tau (exploration vs regeneration rank agreement).
#   tools/compare_solrl_pools.sh OUT_DIR [ITERATIONS=16] [EVERY=8] [SEEDS="0 1 2"]
set -euo pipefail
out=${1:?usage: tools/compare_solrl_pools.sh OUT_DIR [ITERATIONS] [EVERY] [SEEDS]}
pool="toy_solrl --set rollout.strategy=independent --set objective.anchor_coef=0.01"
methods=("pool8=$pool --set solrl.pool_size=8")
for size in 16 32 64; do
  for select in best_worst max_variance random; do
    methods+=("pool${size}_$select=$pool --set solrl.pool_size=$size --set solrl.select=$select")
  done
done
exec "$(dirname "$0")/compare_runs.sh" "$out" "${2:-16}" "${3:-8}" "${4:-0 1 2}" "${methods[@]}"
