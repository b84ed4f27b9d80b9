#!/usr/bin/env bash
# Several training recipes side by side on ShapeWorld, over seeds, then one report: every
# METHOD for SEEDS seeds, JOBS 1-thread runs at a time (default 2, the 2-core machine),
# each to ITERATIONS iterations with an evaluation every EVERY (none at the start: the
# base's score is the same for all). A run that already has its iterations' metrics is kept.
#   tools/compare_runs.sh OUT_DIR ITERATIONS EVERY "SEEDS" "name=config [--set k=v ...]" ...
# Extra arguments to every run go in EXTRA (e.g. EXTRA="--set eval.at_start=true"). A
# method's own --set comes last, so "tree=toy_branchgrpo --set train.max_steps=43 --set
# eval.every=14" runs that method longer than ITERATIONS (equal NFE for a cheaper rollout).
# tools/compare_objectives.sh and tools/compare_solrl_pools.sh name their methods.
set -euo pipefail
out=${1:?usage: tools/compare_runs.sh OUT_DIR ITERATIONS EVERY SEEDS METHOD...}
iterations=${2:?ITERATIONS}
every=${3:?EVERY}
seeds=${4:?SEEDS}
shift 4
methods=("$@")
cd "$(dirname "$0")/.."
jobs=()
for seed in $seeds; do
  for m in "${methods[@]}"; do
    jobs+=("${m%%=*}|$seed|${m#*=}")
  done
done
run() {
  IFS='|' read -r name seed rest <<<"$1"
  dir="$out/$name-s$seed"
  config=${rest%% *}
  own=${rest#"$config"}
  target=$(grep -o 'train.max_steps=[0-9]*' <<<"$own" | tail -1 | cut -d= -f2)
  target=${target:-$iterations}
  [ -f "$dir/metrics.jsonl" ] && [ "$(wc -l <"$dir/metrics.jsonl")" -ge "$target" ] && return 0
  # shellcheck disable=SC2086
  if OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 python scripts/train.py --config $config \
    --set seed="$seed" --set train.max_steps="$iterations" --set eval.every="$every" \
    --set eval.at_start=false --set checkpoint.every=0 --set logging.progress_bar=false \
    --set output_dir="$dir" ${EXTRA:-} $own >"$out/$name-s$seed.log" 2>&1; then
    echo "done $name seed $seed"
  else
    echo "FAILED $name seed $seed: see $out/$name-s$seed.log"
  fi
}
export -f run
export out iterations every EXTRA
mkdir -p "$out"
printf '%s\n' "${jobs[@]}" | xargs -d '\n' -P "${JOBS:-2}" -I{} bash -c 'run "$@"' _ {}
groups=()
for m in "${methods[@]}"; do
  name=${m%%=*}
  dirs=$(for seed in $seeds; do printf '%s,' "$out/$name-s$seed"; done)
  groups+=("$name=${dirs%,}")
done
python scripts/report.py "${groups[@]}" --out "$out/report"
