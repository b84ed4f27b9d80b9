#!/usr/bin/env bash
# The method table on the late-step world (docs/BENCHMARKS.md, "The methods on the late-step
# world"): flow-GRPO; AWM (the fastest clean-sample objective on the ShapeWorld base) with the
# velocity anchor at 0.01 / 0.1 / 1.0, as toy_late_awm (whose own is 1.0; the first runs set
# the same settings on toy_late_flowgrpo, the same config but for its name); the late tree
# (toy_late_branchgrpo) with two inner epochs (as first measured) and one (its setting now);
# Sol-RL with an independent NVFP4 pool (16 candidates, best 4 + worst 4 regenerated in BF16)
# and Sol-RL with a tree pool (the late tree's 16 leaves explored in NVFP4, best 4 + worst 4
# regenerated as a BF16 sub-tree). Every method works on the steps where this world's texture
# is decided, [4, 8) (tools/compare_tree.sh late measured flow-GRPO there against the
# probe's top-three window [0, 4)), and spends about the rollout NFE of ITERATIONS flow-GRPO
# iterations. Run it in the same OUT_DIR as `tools/compare_tree.sh late` to reuse its
# independent_window48 and tree_late runs.
#   tools/compare_late_methods.sh OUT_DIR [ITERATIONS=24] [SEEDS="0 1 2"]
set -euo pipefail
out=${1:?usage: tools/compare_late_methods.sh OUT_DIR [ITERATIONS] [SEEDS]}
n=${2:-24}
seeds=${3:-0 1 2}
every=$((n / 3))
equal() { echo "--set train.max_steps=$((n * 2560 / $1)) --set eval.every=$((every * 2560 / $1))"; }
solrl="--set solrl.enabled=true --set solrl.precision=nvfp4 --set solrl.backend=reference \
--set solrl.select=best_worst --set solrl.pool_size=16 --set rollout.group_size=8 --set perf.compile_rollout=true"
exec "$(dirname "$0")/compare_runs.sh" "$out" "$n" "$every" "$seeds" \
  "independent_window48=toy_late_flowgrpo --set sampling.sde_window=[4,8]" \
  "awm_window48=toy_late_awm --set objective.anchor_coef=0.01" \
  "awm_anchor01=toy_late_awm --set objective.anchor_coef=0.1" \
  "awm_anchor1=toy_late_awm" \
  "tree_late=toy_late_branchgrpo --set train.num_inner_epochs=2 $(equal 816)" \
  "tree_late_epoch1=toy_late_branchgrpo --set train.num_inner_epochs=1 $(equal 816)" \
  "solrl_independent=toy_late_flowgrpo --set sampling.sde_window=[4,8] $solrl $(equal 3840)" \
  "solrl_tree=toy_late_branchgrpo --set train.num_inner_epochs=2 $solrl $(equal 1376)"
