#!/usr/bin/env bash
# The objectives side by side on ShapeWorld (docs/BENCHMARKS.md, "The objectives on
# ShapeWorld"). Same base, sampler, prompts, LoRA, learning rate and evaluation for all;
# only the objective (and its own settings, in configs/toy_<objective>.yaml) differs.
#   tools/compare_objectives.sh OUT_DIR [ITERATIONS=16] [EVERY=8] [SEEDS="0 1 2"]
# The clean-sample objectives all train the 4 high-noise steps.
set -euo pipefail
out=${1:?usage: tools/compare_objectives.sh OUT_DIR [ITERATIONS] [EVERY] [SEEDS]}
exec "$(dirname "$0")/compare_runs.sh" "$out" "${2:-16}" "${3:-8}" "${4:-0 1 2}" \
  "flow_grpo=toy_flowgrpo" \
  "nft=toy_flowgrpo --set objective.name=nft --set objective.forward_window=[0,4]" \
  "grpo_guard=toy_grpo_guard" \
  "flow_dppo=toy_flow_dppo" \
  "awm=toy_awm" \
  "dgpo=toy_dgpo"
