#!/usr/bin/env bash
# PromptRL against flow-only RL on ShapeWorld at equal rollouts (docs/BENCHMARKS.md,
# "PromptRL on ShapeWorld"): the main command (toy_flowgrpo, 16 prompts x 16 images per
# iteration) and toy_promptrl (the same, with the shipped refiner LM rewriting each image's
# prompt), both evaluated on the held-out prompts and their paraphrases at the start and
# every EVERY iterations; then tools/promptrl_table.py prints the table.
#   tools/compare_promptrl.sh OUT_DIR [ITERATIONS=100] [EVERY=50] [SEEDS="0 1 2"]
set -euo pipefail
out=${1:?usage: tools/compare_promptrl.sh OUT_DIR [ITERATIONS] [EVERY] [SEEDS]}
n=${2:-100}
every=${3:-50}
seeds=${4:-0 1 2}
para="--set eval.paraphrases=assets/shapeworld/heldout_paraphrases.jsonl"
EXTRA="--set eval.at_start=true --set eval.train_num_prompts=0" "$(dirname "$0")/compare_runs.sh" "$out" "$n" "$every" "$seeds" \
  "flow_only=toy_flowgrpo $para" \
  "promptrl=toy_promptrl"
python "$(dirname "$0")/promptrl_table.py" "$out" --seeds $seeds
