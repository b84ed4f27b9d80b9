#!/usr/bin/env bash
# flow-GRPO on the toy video base against a random-reward control (docs/BENCHMARKS.md, "The
# video toy"): the same config, seeds and evaluation; the control optimises random_control
# (uniform, blind to prompt and frames) and logs shapeworld_video at weight 0, so it shows
# what the update does with no signal. Every run is evaluated at the start too.
#   tools/compare_video_control.sh OUT_DIR [ITERATIONS=60] [EVERY=20] [SEEDS="0 1 2"]
set -euo pipefail
out=${1:?usage: tools/compare_video_control.sh OUT_DIR [ITERATIONS] [EVERY] [SEEDS]}
control='rewards=[{"name":"random_control","weight":1.0},{"name":"shapeworld_video","weight":0.0}]'
EXTRA="${EXTRA:-} --set eval.at_start=true" exec "$(dirname "$0")/compare_runs.sh" "$out" "${2:-60}" \
  "${3:-20}" "${4:-0 1 2}" "rl=toy_video_flowgrpo" "control=toy_video_flowgrpo --set $control"
