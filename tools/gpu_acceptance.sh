#!/usr/bin/env bash
# The GPU acceptance run of the real job, in parts that each fit one 10-minute device call:
#   bash tools/gpu_acceptance.sh smoke    bash tools/gpu_acceptance.sh tests    bash tools/gpu_acceptance.sh bench
#   bash tools/gpu_acceptance.sh bench04   (the 0.4b configs; bench takes the 1.3b ones)
#   bash tools/gpu_acceptance.sh fp32_256  (the one fp32 K = V = 256 case: minutes of compilation)
#   bash tools/gpu_acceptance.sh ab        (tools/bench_ab.py: this tree's trainer against .bench_baseline's)
#   bash tools/gpu_acceptance.sh ab_stream (the same, model.residual_in_fp32=false against this tree's default)
#   bash tools/gpu_acceptance.sh scaling   (tools/bench_scaling.py: dp, cp, cp-allgather, tp, tp-whole-batch
#                                           at 1, 2, 4 GPUs;
#                                           scaling_profile: 1 and 2 GPUs with a profiled step, every rank's trace)
#   bash tools/gpu_acceptance.sh gathered  (FSDP2 gathered once a step: gdn-verify bf16 of its layouts, then
#                                           bench_scaling's dp against dp-gathered)
#   bash tools/gpu_acceptance.sh hybrids   (2 GPUs: gdn-verify bf16 of configs/qwen3next-1.3b and kimi-1.3b)
#   bash tools/gpu_acceptance.sh hybrids_long (both at 256K tokens with cp 2: two GPUs each; on 2 GPUs
#                                           one after the other, or those named in HYBRID_CONFIGS)
#   bash tools/gpu_acceptance.sh nodes     (tools/bench_nodes.py: 2 simulated nodes, NCCL over sockets or not)
#   bash tools/gpu_acceptance.sh zigzag    (full attention's time per rank under cp, contiguous against zigzag;
#                                           also cp 4's ranks in turn on one GPU)
#   bash tools/gpu_acceptance.sh kda       (KDA's GPU tests, its fla export's, tools/bench_kda.py against fla-core:
#                                           carry fla-core's wheels in .whl/, see the part below)
#   bash tools/gpu_acceptance.sh kda_ab    (tools/bench_kda.py of this tree against .bench_baseline's, one GPU)
#   bash tools/gpu_acceptance.sh block_kernels (tools/bench_block_kernels.py: conv, norms, rotary; the conv
#                                           beside .bench_baseline's, with bf16 and fp32 weights)
#   bash tools/gpu_acceptance.sh host      (tools/bench_host.py, then the trainer at one row a micro-batch under
#                                           py-spy when its wheel is in .whl/: where the host's time goes)
#   bash tools/gpu_acceptance.sh multi     (every GPU of the machine, 2 or 4: tools/multi_gpu_acceptance.py's
#                                           legs; in 10-minute calls: multi2, then multi4v1, multi4v2, multi4v3
#                                           and multi4l on 4 GPUs: the 4-GPU verify takes over 10 minutes:
#                                           3 parts; on 2 GPUs multi2's legs run one after the other, over 10
#                                           minutes: a call each: multi2v (verify), multi2l (256K), multi2d)
# Results and logs under $OUT (device tool) or runs/gpu_acceptance.
# 1. tools/gpu_smoke.py: every config trains 20 steps at its own batch (finite, falling loss);
# 2. the GPU tests in groups run at once, each with its own time limit, so that a slow or failing
#    group still leaves the others' summaries (failures are listed after each group);
# 3. tools/bench_train.py: the trainer as users run it (--trainer, with its profile), the bare step and
#    fla-core (when importable) at the configs' batch of 8.
# Needs the project importable (pip install --no-deps --no-build-isolation -e .).
set -u
# stopped (a device call's own timeout, or a `timeout` around this script): stop every job it started,
# whose drivers then kill their torchrun jobs. Left running, they held the GPUs: the next call's jobs
# shared them and died out of memory (2026-11-27 and 2026-11-28).
trap 'trap - TERM INT; kill -TERM 0' TERM INT
out=${OUT:-runs/gpu_acceptance}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
if ! python3 -c "import gdn_kernels" 2>/dev/null; then
    # `pip install -e .` on the GPU image (2026-11-27, torch 2.11) reported success yet left gdn_kernels
    # unimportable: the kernels package is then reached through a link named as it installs
    mkdir -p runs/pythonpath && ln -sfn "$PWD/kernels" runs/pythonpath/gdn_kernels
    export PYTHONPATH="$PWD/runs/pythonpath:$PWD${PYTHONPATH:+:$PYTHONPATH}"
    echo "note: gdn_kernels not installed; using PYTHONPATH=$PYTHONPATH"
fi
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
step() {  # name, seconds, command...
    local name=$1 limit=$2; shift 2
    local start=$SECONDS
    timeout "$limit" "$@" > "$out/$name.log" 2>&1
    echo "== $name: exit $? in $((SECONDS - start)) s"
}
install_carried_fla() {  # fla-core's wheels carried in .whl/ (the image has no fla-core and reaches no registry)
    if compgen -G ".whl/fla*.whl" > /dev/null; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/fla_site \
            .whl/fla*.whl && export PYTHONPATH="/tmp/fla_site:$PYTHONPATH"
    fi
}
parts=${*:-smoke tests bench}
# the GPUs this run may use: CUDA_VISIBLE_DEVICES's list when set (parts side by side on one machine)
if [[ -n "${CUDA_VISIBLE_DEVICES:-}" ]]; then IFS=, read -ra gpus <<< "$CUDA_VISIBLE_DEVICES"
else mapfile -t gpus < <(nvidia-smi --query-gpu=index --format=csv,noheader); fi
if [[ " $parts " == *" smoke "* ]]; then
    # six configs of 45-60 s each on an H200: 300 s stopped the last one (qwen3next-1.3b) at its final
    # save, unrecorded (2026-11-29)
    step smoke 420 python3 tools/gpu_smoke.py --timeout 120 --out "$out"
    grep -A12 "steps per config" "$out/smoke.log"
fi
if [[ " $parts " == *" tests "* ]]; then
    # Groups of GPU test files at once on the one GPU (compilation runs on the CPU's cores: all of
    # them within 4 minutes on an H200); the fp32 K = V = 256 case, whose compilation alone takes
    # minutes (docs/kernels.md), is a part of its own.
    G=tests/kernels/test_gated_delta_rule_triton.py
    T=(-m gpu -p no:cacheprovider --tb=short -rf)
    step gdn_heads_fp32 420 python3 -m pytest -q "${T[@]}" $G -k "every_head_size and float32 and not 256-256" &
    step gdn_heads_half 420 python3 -m pytest -q "${T[@]}" $G -k "every_head_size and not float32" &
    step gdn_rest 420 python3 -m pytest -q "${T[@]}" $G -k "not every_head_size" &
    step lce_norms 420 python3 -m pytest -q "${T[@]}" tests/kernels/test_linear_cross_entropy.py \
        tests/kernels/test_residual_norm_triton.py \
        tests/kernels/test_norms_triton.py &
    step conv_gates 420 python3 -m pytest -q "${T[@]}" tests/kernels/test_short_conv_triton.py \
        tests/kernels/test_gates_triton.py tests/kernels/test_rope_triton.py tests/kernels/test_swiglu_triton.py &
    step model_jobs 420 python3 -m pytest -q "${T[@]}" tests/kernels/test_model_gpu.py \
        tests/kernels/test_real_job_gpu.py tests/kernels/test_no_sync_gpu.py tests/kernels/test_offload_gpu.py &
    # The resume test trains gdn-0.4b at its own batch (52 GB): beside the others it fits an H200's
    # 140 GB but not an H100's 80 (out of memory in two other groups, 2026-11-26), so there it runs
    # after them.
    gib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
    resume_test() { step resume 420 python3 -m pytest -q "${T[@]}" tests/checkpoint/test_resume_gpu.py; }
    if (( gib > 100000 )); then resume_test & fi
    step convert 420 python3 -m pytest -q -s "${T[@]}" tests/convert &  # -s: the generation test prints its continuations
    wait
    if (( gib <= 100000 )); then resume_test; fi
    for log in "$out"/{gdn_heads_fp32,gdn_heads_half,gdn_rest,lce_norms,conv_gates,model_jobs,resume,convert}.log; do
        echo "-- $(basename "$log" .log): $(grep -E "passed|failed|skipped|error" "$log" | tail -1)"
        grep -E "^FAILED|^ERROR|^SKIPPED" "$log" | head -8
    done
fi
if [[ " $parts " == *" fp32_256 "* ]]; then
    step fp32_256 580 python3 -m pytest -q -m gpu -p no:cacheprovider --tb=short -rf \
        tests/kernels/test_gated_delta_rule_triton.py -k "every_head_size and float32 and 256-256"
    tail -3 "$out/fp32_256.log"
fi
if [[ " $parts " == *" bench "* ]]; then  # the 1.3b pair: ~7 minutes (fla-core's autotune cache carried)
    step bench_train 560 python3 tools/bench_train.py --trainer 40 --batches 8 --micro 4 --peer-micro 2 \
        --warmup 1 --iters 3 --configs configs/gdn-1.3b.yaml,configs/h1-1.3b.yaml --out "$out/bench_train.json"
    grep -v '^{' "$out/bench_train.log" | tail -40
fi
if [[ " $parts " == *" bench04 "* ]]; then  # the 0.4b pair, and their micro-batches of 4 beside the whole batch
    step bench_train_04b 560 python3 tools/bench_train.py --trainer 40 --trainer-set train.microbatch_size=4 \
        --batches 8 --micro 4 --warmup 1 --iters 3 --configs configs/gdn-0.4b.yaml,configs/h1-0.4b.yaml \
        --out "$out/bench_train_04b.json"
    grep -v '^{' "$out/bench_train_04b.log" | tail -40
fi
if [[ " $parts " == *" ab "* ]]; then  # this tree against another (.bench_baseline: git archive of main),
    # logging every 10 steps as the configs do (a line reads the device; every step would hide host waits)
    step bench_ab 560 python3 tools/bench_ab.py --baseline .bench_baseline --steps 40 --profile 35,36 \
        --set train.log_every=10 --timeout 130 --configs configs/gdn-0.4b.yaml,configs/h1-0.4b.yaml \
        --out "$out/bench_ab"
    tail -30 "$out/bench_ab.log"
fi
if [[ " $parts " == *" ab_stream "* ]]; then  # this tree with a bf16 residual stream against itself
    step bench_ab_stream 560 python3 tools/bench_ab.py --baseline . --this-set model.residual_in_fp32=false \
        --steps 40 --profile 35,36 --set train.log_every=10 --timeout 130 \
        --configs configs/gdn-0.4b.yaml,configs/gdn-1.3b.yaml --out "$out/bench_ab_stream"
    tail -30 "$out/bench_ab_stream.log"
fi
# The scaling table (issue 42): the trainer at 1, 2, (4) GPUs per dimension, in one call (rows past the
# budget are listed as not run; scaling.json is written after each row). `scaling_profile`: the same at 1
# and 2 GPUs with one step profiled; every rank's trace comes back, one archive a run.
if [[ " $parts " == *" scaling "* ]]; then
    step scaling 590 python3 tools/bench_scaling.py --steps 12 --skip 4 --timeout-s 150 --budget-s 450 \
        --out "$out/scaling"
    grep -A14 "^| dimension" "$out/scaling.log"
fi
# FSDP2 with parameters gathered once a step (issue 42): gdn-verify bf16 of the layout on NCCL, then dp
# against dp-gathered at 1 and 2 GPUs (4 where there are) in one bench_scaling run.
if [[ " $parts " == *" gathered "* ]]; then
    n=$(nvidia-smi -L | wc -l)
    layouts=(dp2,gathered); (( n >= 4 )) && layouts=(dp4,gathered pp2,dp2,gathered)   # the job's world
    step verify_gathered 200 python3 -m torch.distributed.run --standalone --nproc-per-node "$n" -m gdn_parallel.verify \
        --config configs/h1-0.4b.yaml --dtype bf16 --seq-len 8192 --rows 1 --checkpoint --layouts "${layouts[@]}" \
        --json "$out/verify_gathered.json"
    tail -8 "$out/verify_gathered.log"
    sizes=1,2; (( n >= 4 )) && sizes=1,2,4
    step scaling_gathered 380 python3 tools/bench_scaling.py --dims dp,dp-gathered --sizes "$sizes" --steps 12 \
        --skip 4 --timeout-s 120 --budget-s 340 --out "$out/scaling_gathered"
    grep -A8 "^| dimension" "$out/scaling_gathered.log"
fi
if [[ " $parts " == *" scaling_profile "* ]]; then
    step scaling_profile 590 python3 tools/bench_scaling.py --sizes 1,2 --steps 9 --skip 4 \
        --set train.profile_steps=7 --timeout-s 120 --budget-s 450 --out "$out/scaling_profile"
    for profile in "$out"/scaling_profile/runs/*/profile; do   # one file a run: the device returns 8 at most
        run=$(basename "$(dirname "$profile")")
        tar czf "$out/profile_$run.tgz" -C "$profile" . && rm -r "$profile"
    done
    grep -A9 "^| dimension" "$out/scaling_profile.log"
fi
# Full attention's balance under cp (issue 43): each rank's forward + backward time, the contiguous split
# against zigzag, 64K tokens a rank, one document and then eight: over every GPU when there are several,
# and cp 4's ranks in turn on the first GPU (--ranks 4: each rank's own attention, no collective).
if [[ " $parts " == *" zigzag "* ]]; then
    n=$(nvidia-smi -L | wc -l)
    for docs in 1 8; do
        if (( n > 1 )); then
            step "zigzag_docs$docs" 280 python3 -m torch.distributed.run --standalone --nproc-per-node "$n" \
                tools/bench_cp_attention.py --docs "$docs" --out "$out/zigzag_docs$docs"
            tail -4 "$out/zigzag_docs$docs.log"
        fi
        CUDA_VISIBLE_DEVICES=${gpus[0]} step "zigzag_in_turn_docs$docs" 280 python3 tools/bench_cp_attention.py \
            --ranks 4 --docs "$docs" --out "$out/zigzag_in_turn_docs$docs"
        tail -4 "$out/zigzag_in_turn_docs$docs.log"
    done
fi
# Kimi Delta Attention (issue 43): the kernels' GPU tests and the fla export's beside the benchmark
# against fla-core's chunk_kda (on a second GPU when there is one: its timings alone on theirs). The
# image has no fla-core: carry its wheels (no registry there), fetched here with
#   python3 -m pip download --no-deps -d .whl fla-core==0.6.0 flash-linear-attention==0.6.0
# and carry=[".whl", ...]; einops and transformers are on the image.
if [[ " $parts " == *" kda "* ]]; then
    install_carried_fla
    # the tests on the first GPU given (CUDA_VISIBLE_DEVICES, else the machine's), the benchmark on the
    # second: one shape a process, so that fla-core's minutes of autotuning at K = 256 cost only that row
    bench_gpu=${gpus[1]:-${gpus[0]}}
    # fla's reference errors with one launch configuration a kernel (tools/one_config_autotune): its full
    # autotuning took the whole call at K = 64 alone (2026-11-29); the benchmark below keeps it
    CUDA_VISIBLE_DEVICES=${gpus[0]} PYTHONPATH="$PWD/tools/one_config_autotune:$PYTHONPATH" step kda_tests 560 \
        python3 -m pytest -q -m gpu -p no:cacheprovider --tb=short -rf -s tests/kernels/test_kda_triton.py \
        tests/convert/test_fla_kda_gpu.py &
    (for shape in 16:128:8:4096 16:64:8:4096 16:256:8:4096; do
        CUDA_VISIBLE_DEVICES=$bench_gpu step "bench_kda_${shape//:/_}" 300 python3 tools/bench_kda.py \
            --shapes "$shape" --out "$out/bench_kda_${shape//:/_}.json"
    done) &
    wait
    tail -12 "$out/kda_tests.log"
    for log in "$out"/bench_kda_*.log; do grep -v '^{' "$log" | tail -6; done
fi
# Host time (issue 42): launch baselines and each module's forward host time at one row
# (tools/bench_host.py), then the trainer at one row a micro-batch (the config's launches, a quarter of
# its GPU work: the host sets the pace) with py-spy attached when its wheel is carried in .whl/
# (python3 -m pip download --no-deps -d .whl py-spy), summarized by function.
if [[ " $parts " == *" host "* ]]; then
    CUDA_VISIBLE_DEVICES=${gpus[0]} step host 240 python3 tools/bench_host.py --tokens 4096 \
        --configs configs/h1-1.3b.yaml configs/gdn-1.3b.yaml --out "$out/host.json"
    head -40 "$out/host.log"
    CUDA_VISIBLE_DEVICES=${gpus[0]} timeout 200 python3 -m gdn_parallel.train --config configs/h1-1.3b.yaml \
        --set train.steps=120 --set train.batch_size=2 --set train.microbatch_size=1 --set train.warmup_steps=2 \
        --set checkpoint.enabled=false --set train.eval_every=0 --set train.out_dir="$out/host_one_row" \
        > "$out/host_one_row.log" 2>&1 &
    trainer=$!
    if compgen -G ".whl/py_spy-*.whl" > /dev/null && python3 -m pip install -q --no-index --no-deps \
            --no-compile --target /tmp/spy .whl/py_spy-*.whl; then
        until grep -q "^step 20/" "$out/host_one_row.log" 2>/dev/null || ! kill -0 $trainer 2>/dev/null; do sleep 1; done
        /tmp/spy/bin/py-spy record --pid $trainer --duration 20 --nonblocking -r 250 --threads -f raw \
            -o "$out/host_one_row.spy" > "$out/host_spy.log" 2>&1 &&
            python3 tools/bench_host.py --spy "$out/host_one_row.spy" --out "$out/host_spy.json" | head -30
    fi
    wait $trainer
    grep -E "^step " "$out/host_one_row.log" | tail -8
fi
# The block's memory-bound kernels (tools/bench_block_kernels.py): the short conv with a bf16 and with
# an fp32 weight (the model passes its fp32 master weights since 2026-11-29), beside .bench_baseline's
# short conv where there is one; the norms and rotary. One GPU.
if [[ " $parts " == *" block_kernels "* ]]; then
    base=()
    old_conv=.bench_baseline/kernels/short_conv.py
    if [[ -f $old_conv ]]; then base=(--baseline "$old_conv"); fi
    CUDA_VISIBLE_DEVICES=${gpus[0]} step block_kernels 300 python3 tools/bench_block_kernels.py "${base[@]}" \
        --out "$out/bench_block_kernels.json"
    tail -16 "$out/block_kernels.log"
fi
# KDA kernels of this tree against another's (.bench_baseline: git archive of a ref, as for `ab`), one
# GPU, the same shapes one after the other in one call; fla-core beside ours in this tree's run when
# its wheels were carried (.whl/, see `kda`).
if [[ " $parts " == *" kda_ab "* ]]; then
    install_carried_fla
    for shape in 16:128:8:4096 16:64:8:4096; do
        tag=${shape//:/_}
        (cd .bench_baseline && mkdir -p runs/pythonpath && ln -sfn "$PWD/kernels" runs/pythonpath/gdn_kernels &&
         PYTHONPATH="$PWD/runs/pythonpath:$PWD" CUDA_VISIBLE_DEVICES=${gpus[0]} timeout 240 python3 tools/bench_kda.py \
             --no-fla --shapes "$shape" --out "$out/bench_kda_baseline_$tag.json" > "$out/bench_kda_baseline_$tag.log" 2>&1)
        CUDA_VISIBLE_DEVICES=${gpus[0]} step "bench_kda_$tag" 300 python3 tools/bench_kda.py --shapes "$shape" \
            --out "$out/bench_kda_$tag.json"
        echo "-- $shape: baseline"; grep -v '^{' "$out/bench_kda_baseline_$tag.log" | tail -3
        echo "-- $shape: this tree"; grep -v '^{' "$out/bench_kda_$tag.log" | tail -3
    done
fi
# Several nodes simulated on one host (issue 42): one torchrun agent a node, NCCL over the machine's links
# and over TCP sockets; 2 x 1 on 2 GPUs, 2 x 2 on 4.
if [[ " $parts " == *" nodes "* ]]; then
    per_node=$(( $(nvidia-smi -L | wc -l) >= 4 ? 2 : 1 ))
    step nodes 590 python3 tools/bench_nodes.py --gpus-per-node "$per_node" --steps 30 --skip 10 \
        --timeout-s 150 --budget-s 420 --out "$out/nodes"
    find "$out/nodes/runs" -name 'trace_rank*.json' -delete   # the byte counts are in nodes.json
    grep -A12 "^| layout" "$out/nodes.log"
fi
# The seeds' other hybrids (issue 43) on 2 GPUs: gdn-verify in bf16 at their widths (4 layers, 8K tokens)
# over every default layout, and full attention's zigzag split under cp 2.
if [[ " $parts " == *" hybrids "* ]]; then
    V=(python3 -m torch.distributed.run --standalone --nproc-per-node 2 -m gdn_parallel.verify --dtype bf16
       --seq-len 8192 --rows 1 --set model.n_layers=4)
    for config in qwen3next-1.3b kimi-1.3b; do
        step "verify_$config" 280 "${V[@]}" --config "configs/$config.yaml" --layouts default cp2,zigzag \
            --json "$out/verify_$config.json"
        tail -16 "$out/verify_$config.log"
    done
fi
# The seeds' other hybrids at 256K tokens with cp 2 (issue 43): each config on two GPUs (side by side on 4),
# 8 steps on documents of many lengths, full checkpointing, every step logged; metrics.jsonl kept.
if [[ " $parts " == *" hybrids_long "* ]]; then
    step hybrids_data 300 python3 tools/multi_gpu_acceptance.py --out "$out/multi" --work runs/multi_gpu_work data
    long_run() {  # config, GPUs
        CUDA_VISIBLE_DEVICES=$2 step "long_$1" 420 python3 -m torch.distributed.run --standalone --nproc-per-node 2 \
            -m gdn_parallel.train --config "configs/$1.yaml" --set train.seq_len=262144 --set train.batch_size=1 \
            --set train.microbatch_size=1 --set train.activation_checkpointing=full --set parallel.cp=2 \
            --set train.steps=8 --set train.log_every=1 --set train.warmup_steps=2 --set train.eval_rows=2 \
            --set data.source=runs/multi_gpu_work/stdlib_docs --set "train.out_dir=runs/hybrids_long/$1"
        cp "runs/hybrids_long/$1/metrics.jsonl" "$out/long_$1.metrics.jsonl"
        grep -E "step +[0-9]+|tokens/s|set-up" "$out/long_$1.log" | tail -12
    }
    pair1=${gpus[0]},${gpus[1]}
    if (( ${#gpus[@]} >= 4 )); then
        long_run qwen3next-1.3b "$pair1" & long_run kimi-1.3b "${gpus[2]},${gpus[3]}" & wait
    else
        for config in ${HYBRID_CONFIGS:-qwen3next-1.3b kimi-1.3b}; do long_run "$config" "$pair1"; done
    fi
fi
# The multi-GPU acceptance (issue 41): gdn-verify --checkpoint bf16 over every default layout, the
# long-context config across an asynchronous save and resumed from it, the restart drill. On 4 GPUs the
# 2-GPU legs run side by side (verify and the drill on GPUs 0,1; the 256K config on 2,3).
if [[ " $parts " == *" multi"* ]]; then
    M=(python3 tools/multi_gpu_acceptance.py --out "$out/multi" --work runs/multi_gpu_work)
    wants() { [[ " $parts " == *" multi "* || " $parts " == *" multi2 "* || " $parts " == *" $1 "* ]]; }
    n=$(nvidia-smi -L | wc -l)
    step multi_data 300 "${M[@]}" data
    if (( n >= 4 )) && wants multi2; then   # GPUs 0,1: verify beside the drill's jobs; 2,3: the 256K config
        step multi_verify2 540 "${M[@]}" verify --gpus 0,1 --limit-s 530 &
        step multi_drill 300 "${M[@]}" drill --gpus 0,1 --limit-s 290 &
        step multi_long2 540 "${M[@]}" long --gpus 2,3 --steps 10 --save-after 5 --limit-s 260 &
        wait
    elif (( n < 4 )); then   # one after the other: 21 minutes, so a 10-minute call takes one of the three
        wants multi2v && step multi_verify2 590 "${M[@]}" verify --limit-s 580
        wants multi2l && step multi_long2 420 "${M[@]}" long --steps 10 --save-after 5 --limit-s 200
        wants multi2d && step multi_drill 250 "${M[@]}" drill --limit-s 240
    fi
    for third in 1 2 3; do
        if (( n >= 4 )) && [[ " $parts " == *" multi "* || " $parts " == *" multi4v$third "* ]]; then
            step multi_verify4_$third 560 "${M[@]}" verify --verify-part $third/3 --limit-s 550
        fi
    done
    if (( n >= 4 )) && [[ " $parts " == *" multi "* || " $parts " == *" multi4l "* ]]; then
        step multi_long4 590 "${M[@]}" long --steps 9 --save-after 4 --limit-s 280
    fi
    "${M[@]}" --table "$out"/multi/leg_*.json
fi
# The trainer rows' chrome traces (bench_trainer/*/profile/trace_rank0.json) are tens of MB each: leave
# them out of what comes back from the device (tar --exclude='trace_*').
