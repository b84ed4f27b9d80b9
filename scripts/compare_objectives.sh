#!/usr/bin/env bash
# The objectives side by side on ShapeWorld (docs/BENCHMARKS.md, "The objectives on
# ShapeWorld"): every method for SEEDS seeds, two 1-thread runs at a time (the 2-core
# machine), each to ITERATIONS iterations with an evaluation every EVERY, then one
# report over seeds. Same base, sampler, prompts, LoRA, learning rate and evaluation for
# all; only the objective (and its own settings, in configs/toy_<objective>.yaml) differs.
#   scripts/compare_objectives.sh OUT_DIR [ITERATIONS=16] [EVERY=8] [SEEDS="0 1 2"]
# Extra arguments to every run go in EXTRA (e.g. EXTRA="--set eval.at_start=true").
set -euo pipefail
out=${1:?usage: scripts/compare_objectives.sh OUT_DIR [ITERATIONS] [EVERY] [SEEDS]}
iterations=${2:-16}
every=${3:-8}
seeds=${4:-"0 1 2"}
cd "$(dirname "$0")/.."
# method=config [overrides]; the clean-sample objectives all train the 4 high-noise steps
methods=(
  "flow_grpo=toy_flowgrpo"
  "nft=toy_flowgrpo --set objective.name=nft --set objective.forward_window=[0,4]"
  "grpo_guard=toy_grpo_guard"
  "flow_dppo=toy_flow_dppo"
  "awm=toy_awm"
  "dgpo=toy_dgpo"
)
jobs=()
for seed in $seeds; do
  for m in "${methods[@]}"; do
    name=${m%%=*}
    rest=${m#*=}
    jobs+=("$name|$seed|$rest")
  done
done
run() {
  IFS='|' read -r name seed rest <<<"$1"
  dir="$out/$name-s$seed"
  [ -f "$dir/metrics.jsonl" ] && [ "$(wc -l <"$dir/metrics.jsonl")" -ge "$iterations" ] && return 0
  # shellcheck disable=SC2086
  OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 python scripts/train.py --config $rest \
    --set seed="$seed" --set train.max_steps="$iterations" --set eval.every="$every" \
    --set eval.at_start=false --set checkpoint.every=0 --set logging.progress_bar=false \
    --set output_dir="$dir" ${EXTRA:-} >"$out/$name-s$seed.log" 2>&1
  echo "done $name seed $seed"
}
export -f run
export out iterations every EXTRA
mkdir -p "$out"
printf '%s\n' "${jobs[@]}" | xargs -P 2 -I{} bash -c 'run "$@"' _ {}
groups=()
for m in "${methods[@]}"; do
  name=${m%%=*}
  dirs=$(for seed in $seeds; do printf '%s,' "$out/$name-s$seed"; done)
  groups+=("$name=${dirs%,}")
done
python scripts/report.py "${groups[@]}" --out "$out/report"
