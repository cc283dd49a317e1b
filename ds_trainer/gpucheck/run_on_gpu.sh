#!/usr/bin/env bash
# The GPU check on a machine without network (docs/gpu-check.md), in one command from the checkout's root:
#   bash ds_trainer/gpucheck/run_on_gpu.sh RESULTS_DIR [python -m ds_trainer.gpucheck options]
# Installs the carried wheel sets (.wheelhouse/*/, from `make wheelhouse`) into a folder of their own, runs the check
# with the checkout and that folder on PYTHONPATH, and copies its results (results.json, results.md,
# plan_calibration.jsonl, logs.tgz: every step's output and each run's log, summary and metrics) to RESULTS_DIR.
set -u
cd "$(dirname "$0")/../.." || exit 2
results=${1:?usage: run_on_gpu.sh RESULTS_DIR [gpucheck options]}
shift
python=${PYTHON:-python3}
site=${GPUCHECK_SITE:-/tmp/gpucheck-site}
work=${GPUCHECK_WORK:-/tmp/gpucheck}
if ! ls .wheelhouse/*/*.whl >/dev/null 2>&1; then
    echo "no wheels under .wheelhouse/: run make wheelhouse where there is network, and carry .wheelhouse/core" >&2
    exit 2
fi
start=$(date +%s)
"$python" -m pip install -q --disable-pip-version-check --no-index --no-deps --no-compile --target "$site" \
    .wheelhouse/*/*.whl || exit 2
echo "wheel sets installed into $site in $(( $(date +%s) - start )) s: $(ls -d .wheelhouse/*/ | tr '\n' ' ')" >&2
export PYTHONPATH="$PWD:$site${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
"$python" -m ds_trainer.gpucheck --out "$work" "$@"
status=$?
mkdir -p "$results"
cp "$work"/results.json "$work"/results.md "$work"/plan_calibration.jsonl "$results"/ 2>/dev/null
(cd "$work" && tar czf "$results/logs.tgz" logs $(ls runs/*/ds_trainer.log runs/*/summary.json runs/*/metrics.jsonl \
    2>/dev/null))
exit $status
