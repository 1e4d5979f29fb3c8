#!/usr/bin/env bash
# The GPU acceptance run of the real job, in parts that each fit one 10-minute device call:
#   bash tools/gpu_acceptance.sh smoke bench    # then: bash tools/gpu_acceptance.sh tests
# Results and logs under $OUT (device tool) or runs/gpu_acceptance.
# 1. tools/gpu_smoke.py: every config trains 20 steps at its own batch (finite, falling loss);
# 2. the GPU tests, one file at a time with its own time limit, so that a slow or failing file
#    still leaves the others' summaries (failure details are printed at the end of each file);
# 3. tools/bench_train.py: ours against fla-core (when importable) at batch 2 and the configs' batch.
# Needs the project importable (pip install --no-deps --no-build-isolation -e .).
set -u
out=${OUT:-runs/gpu_acceptance}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
step() {  # name, seconds, command...
    local name=$1 limit=$2; shift 2
    local start=$SECONDS
    timeout "$limit" "$@" > "$out/$name.log" 2>&1
    echo "== $name: exit $? in $((SECONDS - start)) s"
}
parts=${*:-smoke tests bench}
if [[ " $parts " == *" smoke "* ]]; then
    step smoke 300 python3 tools/gpu_smoke.py --timeout 120 --out "$out"
    grep -A8 "steps per config" "$out/smoke.log"
fi
if [[ " $parts " == *" tests "* ]]; then
    for test in tests/kernels/test_*.py; do
        name=$(basename "$test" .py)
        step "$name" 80 python3 -m pytest -q -p no:cacheprovider --tb=short -rf "$test"
        grep -E "passed|failed|^FAILED|^E  " "$out/$name.log" | head -12
    done
fi
if [[ " $parts " == *" bench "* ]]; then
    step bench_train 200 python3 tools/bench_train.py --configs configs/gdn-1.3b.yaml --batches 2,8 --micro 2 \
        --ac none,selective --account --warmup 1 --iters 3 --out "$out/bench_train.json"
    grep -v '^{' "$out/bench_train.log" | tail -40
fi
