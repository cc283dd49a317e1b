#!/usr/bin/env bash
# The GPU check on a machine without network (docs/gpu-check.md), one device call per part:
#   bash ds_trainer/gpucheck/run_on_gpu.sh RESULTS_DIR --part 1   (then --part 2 on the warm machine)
# Installs the carried wheel sets (.wheelhouse/*/, from `make wheelhouse`) into a folder of their
# own (again only when the set changed), then runs the check in a fresh work folder with the
# checkout and that folder on PYTHONPATH. The check copies results.json, results.md,
# plan_calibration.jsonl and logs.tgz into RESULTS_DIR after every step, and ends by the
# call's limit (GPUCHECK_WALL_S, 600 s, counted from this script's start) less STOP_MARGIN_S.
# GPUCHECK_CPU=1 runs the CPU form (the rehearsal: python -m ds_trainer.gpucheck.rehearse).
set -u
start=$(date +%s)
cd "$(dirname "$0")/../.." || exit 2
results=${1:?usage: run_on_gpu.sh RESULTS_DIR [--part N] [gpucheck options]}
shift
python=${PYTHON:-python3}
base=${GPUCHECK_BASE:-/tmp/gpucheck}  # kept between the calls of one warm machine
site=$base/site
work=$base/call-$(date -u +%Y%m%d-%H%M%S)-$$  # fresh per call: no run continues an earlier one
wall=${GPUCHECK_WALL_S:-600}
margin=${STOP_MARGIN_S:-45}  # the last step's stop (13 s), the last copy into RESULTS_DIR, exit
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 PYTHONUNBUFFERED=1
if ! ls .wheelhouse/*/*.whl >/dev/null 2>&1; then
    echo "no wheels under .wheelhouse/: run make wheelhouse where there is network, and carry" \
        ".wheelhouse/core and .wheelhouse/bnb" >&2
    exit 2
fi
stamp=$(ls -l .wheelhouse/*/*.whl | awk '{print $5, $NF}' | sort | cksum | cut -d' ' -f1)
if [ "$(cat "$site/.stamp" 2>/dev/null)" != "$stamp" ]; then
    rm -rf "$site"
    "$python" -m pip install -q --disable-pip-version-check --no-index --no-deps --no-compile \
        --upgrade --target "$site" .wheelhouse/*/*.whl || exit 2
    echo "$stamp" >"$site/.stamp"
    echo "wheel sets installed into $site in $(( $(date +%s) - start )) s:" \
        "$(ls -d .wheelhouse/*/ | tr '\n' ' ')" >&2
else
    echo "wheel sets already installed in $site (this machine's earlier call)" >&2
fi
export PYTHONPATH="$PWD:$site${PYTHONPATH:+:$PYTHONPATH}"
cpu=()
[ "${GPUCHECK_CPU:-0}" = 1 ] && cpu=(--cpu)
"$python" -m ds_trainer.gpucheck --out "$work" --state "$base/state.json" --mirror "$results" \
    --deadline $(( start + wall - margin )) ${cpu[@]+"${cpu[@]}"} "$@"
