#!/usr/bin/env bash
# Keeps the trained toy bases out of a device call, and puts them back.
#
#   tools/device_slim.sh hide      # before the device tool's run (the GPU window)
#   tools/device_slim.sh restore   # right after it, before any commit
#
# A device call carries the tracked tree, the untracked files git does not ignore and the
# carried paths, 64 MiB in all. The tracked tree is 68 MiB, 53 of them five toy bases that
# no GPU step reads (the GPU suite builds full-size models with random weights); with the
# first call's wheels (11.4 MiB) it no longer fits. `hide` untracks those five folders in
# the index only and ignores them in .git/info/exclude, so they stay on disk and do not
# travel; `restore` undoes both. Nothing is committed either way: `hide` refuses to run
# over staged changes, so that a commit in between cannot delete the bases by accident.
set -euo pipefail
cd "$(dirname "$0")/.."
BASES=(assets/toy_model_late assets/toy_model_capable assets/toy_model_fewstep assets/toy_video_model assets/toy_video_model_capable)
EXCLUDE=.git/info/exclude
case "${1:-}" in
hide)
    git diff --cached --quiet || { echo "error: the index has staged changes; commit or unstage them before hiding the toy bases" >&2; exit 1; }
    mkdir -p "$(dirname "$EXCLUDE")"
    for base in "${BASES[@]}"; do
        grep -qxF "/$base/" "$EXCLUDE" 2>/dev/null || echo "/$base/" >>"$EXCLUDE"
    done
    git rm -r -q --cached "${BASES[@]}"
    echo "hidden from device calls: ${BASES[*]} (run 'tools/device_slim.sh restore' after the call)"
    ;;
restore)
    git reset -q -- "${BASES[@]}"
    if [ -f "$EXCLUDE" ]; then
        for base in "${BASES[@]}"; do
            grep -vxF "/$base/" "$EXCLUDE" >"$EXCLUDE.tmp" || true
            mv "$EXCLUDE.tmp" "$EXCLUDE"
        done
    fi
    echo "restored: ${BASES[*]}"
    ;;
*)
    echo "usage: tools/device_slim.sh hide|restore" >&2
    exit 2
    ;;
esac
