#!/usr/bin/env bash
# BranchGRPO trees against independent rollouts at equal rollout NFE (docs/BENCHMARKS.md,
# "Trees against independent rollouts"), on the ShapeWorld world or the late-step world:
# independent flow-GRPO, the tree with the shipped split steps ([0,1,2,3] x 2), and the tree
# with the split steps scripts/probe_decision_depth.py recommends ([0,1,2] x [4,2,2] on both
# worlds); on the late world also the tree that splits where the texture is decided
# (toy_late_branchgrpo, [4,5,6,7] x 2) and its control, independent rollouts on its window. Each tree runs as many iterations as
# spend about the NFE of ITERATIONS independent ones (2560 per iteration), and is
# evaluated as often in NFE; scripts/report.py then plots held-out strict against NFE.
#   tools/compare_tree.sh shapeworld|late OUT_DIR [ITERATIONS=30] [SEEDS="0 1 2"]
set -euo pipefail
world=${1:?usage: tools/compare_tree.sh shapeworld|late OUT_DIR [ITERATIONS] [SEEDS]}
out=${2:?OUT_DIR}
n=${3:-30}
seeds=${4:-0 1 2}
every=$((n / 3))
# iterations (and evaluation interval) spending n x 2560 NFE at a tree's NFE per iteration
equal() { echo "--set train.max_steps=$((n * 2560 / $1)) --set eval.every=$((every * 2560 / $1))"; }
# the late trees were measured with two inner epochs, toy_late_branchgrpo's setting until
# one epoch was found to stop its stall (compare_late_methods.sh, tree_late_epoch1)
two="--set train.num_inner_epochs=2"
case $world in
  shapeworld)
    exec "$(dirname "$0")/compare_runs.sh" "$out" "$n" "$every" "$seeds" \
      "independent=toy_flowgrpo" \
      "tree_shipped=toy_branchgrpo $(equal 1776)" \
      "tree_probe=toy_branchgrpo --set tree.split_steps=[0,1,2] --set tree.branch_factors=[4,2,2] $(equal 2000)"
    ;;
  late)  # also the late tree's own control: independent rollouts with its window [4, 8)
    exec "$(dirname "$0")/compare_runs.sh" "$out" "$n" "$every" "$seeds" \
      "independent=toy_late_flowgrpo --set sampling.sde_window=[0,4]" \
      "independent_window48=toy_late_flowgrpo --set sampling.sde_window=[4,8]" \
      "tree_shipped=toy_late_branchgrpo --set tree.split_steps=[0,1,2,3] --set sampling.sde_window=[0,4] $two $(equal 1776)" \
      "tree_probe=toy_late_branchgrpo --set tree.split_steps=[0,1,2] --set tree.branch_factors=[4,2,2] --set sampling.sde_window=[0,4] $two $(equal 2000)" \
      "tree_late=toy_late_branchgrpo $two $(equal 816)"
    ;;
  *) echo "world must be shapeworld or late, got '$world'" >&2; exit 2 ;;
esac
