#!/usr/bin/env bash
# The runs of issue 25 on a 4-GPU machine, each part one 10-minute device call (docs/benchmarks.md):
#   bash tools/parity_study.sh spikes   # what changes the early spikes
#   bash tools/parity_study.sh pair     # gdn-0.4b, 500 steps, both models; lr and window runs beside it
# spikes: short-warmup runs (gdn-1.3b, 30 steps, warmup 8) of our model from our init, from fla-core's
# own init, from ours with one part of fla's (conv kernels; residual output projections), with a
# 256-row vocabulary; gdn-0.4b from fla's init (500-step schedule, warmup 20) in both models; fla-core
# from its own init at 1.3b; a noise floor (ours with another micro-batch split).
# pair: the 500-step gdn-0.4b pair from our init; ours at 1.3b, warmup 8, at lr 2e-4 and 1e-4; h1-1.3b
# (the trainer) with warmup 8, sliding window and full attention.
# Results (JSON, logs) and fla-core's Triton autotune cache under $OUT; a cache from an earlier call,
# put at .whl/fla_autotune.tgz, spares fla-core's ~5 minutes of autotuning. Needs fla-core's wheels in
# .whl/ (see docs/benchmarks.md) and 4 GPUs.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 1
mkdir -p /tmp/pp && ln -sfn "$PWD/kernels" /tmp/pp/gdn_kernels
export PYTHONPATH=/tmp/site:/tmp/pp:$PWD PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tcache
mkdir -p /tmp/tcache
[[ -f .whl/fla_autotune.tgz ]] && tar xzf .whl/fla_autotune.tgz -C /tmp/tcache
PART=${1:-spikes}
W=/tmp/parity_work
R=${OUT:-runs/parity_study}/r
DEADLINE=${DEADLINE:-545}  # seconds after start by which every run stops (its JSON keeps what it did)
mkdir -p "$R"
nvidia-smi --query-gpu=name --format=csv,noheader | head -1 > "$R/device.txt"
prep() {  # config, dir name, prepare's options; $W/<dir>.ready (holding the exit status) when done
    python3 tools/parity_fla.py prepare --config "configs/$1.yaml" --dir "$W/$2" "${@:3}" > "$R/prep_$2.log" 2>&1
    local rc=$?
    echo "prepared $2: exit $rc at $SECONDS s"
    echo $rc > "$W/$2.ready"
}
ready() {  # dir name: waits for its prepare; true when it succeeded
    while [[ ! -f $W/$1.ready ]]; do sleep 2; done
    [[ $(cat "$W/$1.ready") == 0 ]]
}
time_left() {  # run name: prints the seconds left before DEADLINE; false (and says so) under 30
    local left=$((DEADLINE - SECONDS))
    if ((left < 30)); then echo "$1: skipped (no time left)" >&2; return 1; fi
    echo "$left"
}
train() {  # gpu, dir name, side, run name, train's options
    local gpu=$1 dir=$2 side=$3 name=$4 left
    shift 4
    left=$(time_left "$name") || return
    CUDA_VISIBLE_DEVICES=$gpu timeout "$left" python3 tools/parity_fla.py train --dir "$W/$dir" --side "$side" \
        --out "$R/$name.json" "$@" > "$R/$name.log" 2>&1
    echo "$name: exit $? at $SECONDS s"
}
trainer() {  # gpu, run name, overrides: h1-1.3b through the trainer, 30 steps, warmup 8
    local gpu=$1 name=$2 left
    shift 2
    left=$(time_left "$name") || return
    CUDA_VISIBLE_DEVICES=$gpu timeout "$left" python3 -m gdn_parallel.train \
        --config configs/h1-1.3b.yaml --set train.steps=30 --set train.warmup_steps=8 --set train.log_every=1 \
        --set train.eval_every=0 --set checkpoint.enabled=false --set "train.out_dir=/tmp/$name" "$@" \
        > "$R/$name.log" 2>&1
    echo "$name: exit $? at $SECONDS s"
    cp "/tmp/$name/metrics.jsonl" "$R/$name.metrics.jsonl"
}
mkdir -p "$W"
W8=(--steps 30 --warmup 8)
if [[ $PART == pair ]]; then
    prep gdn-0.4b b04 &
    prep gdn-1.3b b13 &
    (ready b04 && train 0 b04 ours ours_04b --steps 500 --warmup 20
     trainer 0 h1_13b_w8_swa; trainer 0 h1_13b_w8_fullattn --set model.window_size=4096) &
    (ready b04 && train 1 b04 fla fla_04b --steps 500 --warmup 20) &
    (ready b13 && train 2 b13 ours ours_13b_w8_lr2e-4 "${W8[@]}" --lr 2e-4) &
    (ready b13 && train 3 b13 ours ours_13b_w8_lr1e-4 "${W8[@]}" --lr 1e-4) &
    wait
    python3 tools/parity_fla.py compare "$R/ours_04b.json" "$R/fla_04b.json" --out "$R/compare_04b.json" \
        --png "$R/parity_04b.png" | grep -v '^ *"\(weight_decay\|tensors\|elements\)'
    tar czf "${OUT:-runs/parity_study}/results.tgz" -C "$(dirname "$R")" r
    exit 0
fi
prep gdn-0.4b f04 --init fla &
prep gdn-1.3b b13 &
prep gdn-1.3b f13 --init fla &
prep gdn-1.3b c13 --take-from-fla 'conv1d\.weight$' &
prep gdn-1.3b r13 --take-from-fla '(o_proj|down_proj)\.weight$' &
prep gdn-1.3b v13 --set model.vocab_size=256 &
(ready f04 && train 0 f04 fla fla_f04_w20 --steps 500 --warmup 20) &
(ready f13 && train 1 f13 fla fla_f13_w8 "${W8[@]}" --also "50:20:$R/fla_f13_w20.json") &
(ready b13 && train 2 b13 ours ours_b13_w8 "${W8[@]}"
 ready f13 && train 2 f13 ours ours_f13_w8 "${W8[@]}" --also "50:20:$R/ours_f13_w20.json"
 ready c13 && train 2 c13 ours ours_c13_w8 "${W8[@]}"
 ready r13 && train 2 r13 ours ours_r13_w8 "${W8[@]}"
 ready v13 && train 2 v13 ours ours_v13_w8 "${W8[@]}") &
(ready f04 && train 3 f04 ours ours_f04_w20 --steps 500 --warmup 20
 ready b13 && train 3 b13 ours ours_b13_w20_micro1 --steps 50 --warmup 20 --set train.microbatch_size=1) &
wait
shopt -s nullglob
python3 tools/parity_fla.py spikes "$R"/*_w8.json "$R"/*_w20*.json --out "$R/spikes.json" | tee "$R/spikes.txt"
(cd /tmp/tcache && find . -name '*.autotune.json' | tar czf "${OUT:-runs/parity_study}/fla_autotune.tgz" -T -)
tar czf "${OUT:-runs/parity_study}/results.tgz" -C "$(dirname "$R")" r
echo "done at $SECONDS s"
