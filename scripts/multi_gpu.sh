#!/usr/bin/env bash
# docs/benchmarks.md "Several GPUs": FP8 and BF16 training through Lightning's strategies with the
# shipped overlays configs/ddp.yaml and configs/fsdp.yaml, on the real-text corpus of
# scripts/py_data.sh, one process per GPU.
#
# Usage: scripts/multi_gpu.sh JOB...
#   throughput-gpt2 | throughput-gpt-1.3b   tok/s on 1 GPU, then each of STRATEGIES (ddp: configs/
#                  ddp.yaml, fsdp: configs/fsdp.yaml) on each of GPUS, for each of PRECISIONS
#                  (precision_args below: fp8 = configs/gpt2_fp8.yaml, TE delayed; bf16 =
#                  configs/gpt2_bf16.yaml, the PyTorch backend compiled); STEPS steps, the
#                  monitor's lines after the first two and before the profile kept; StepProfile
#                  splits steps PROFILE_AT to PROFILE_AT+4 into GPU compute, exposed communication
#                  and GPU idle per rank
#   plain-gpt2 | plain-gpt-1.3b   benchmarks/plain_pytorch.py (no Lightning, BF16 compiled) on 1
#                  GPU, then each of STRATEGIES on each of GPUS through torchrun
#   table-gpt2 | table-gpt-1.3b   the two-GPU table of docs/benchmarks.md in one go: plain script,
#                  package BF16, FP8 (TE delayed; torchao tensorwise under FSDP2) and, for GPT-2,
#                  examples/fabric_train.py, on 1 GPU (a run per GPU of ONE_SETS at a time) and
#                  2 GPUs (a run per pair of SETS at a time); on four GPUs
#                  ONE_SETS="0 1 2 3" SETS="0,1 2,3" runs two pairs at once
#   table-gpt-1.3b-ddp | table-gpt-1.3b-fsdp   the 1.3B table's one-GPU rows and one strategy's
#                  (the 1.3B table in two parts)
#   loss-gpt2      200 steps with one global batch of 32 x 1024: 1 GPU reading the LOSS_GPUS ranks'
#                  samples (data.emulate_ranks, the batch accumulated: at every step exactly the
#                  samples of the several-GPU runs), DDP and FSDP2 on LOSS_GPUS (default 4); val loss
#                  at step 200. Then the FSDP2 run's sharded step-100 checkpoint is resumed to
#                  step 200 (FP8 scaling state from meta.pt), consolidated, and sampled on one GPU.
#   resume-gpt2    only the FSDP2 part of loss-gpt2
#   table-8b       the 8B seed table: configs/llama3_8b_{bf16,fp8}.yaml (FSDP2) on DEVICES8B GPUs at
#                  the same global batch (DEVICES8B x 1 x 8192), STEPS8B steps from one seed on
#                  the real-text corpus cut in blocks of 8192, val loss (4 batches) at the last
#                  step; VARIANTS8B (default: all of bf16 plain-bf16 fp8-delayed fp8-current
#                  fp8-block fp8-current-bf16ends fp8-tensorwise; also fp8-tensorwise-ag, float8
#                  all-gather, and fp8-delayed-bf16ends). plain-bf16: benchmarks/plain_pytorch.py,
#                  FSDP2, PLAIN8B_AC (default mlp), PLAIN8B_STEPS (default 60, at least 40) on
#                  random tokens: speed only, the BF16 baseline where it is faster than the
#                  package's bf16
#   eval-8b        FP8 delayed with validation every 10 steps, BF16 (default) then fp8_eval: true
#                  (EVAL8B: the fp8_eval values, default "false true"): peak memory at evaluation
#                  against training's (the reference run crashed there)
#   resume-8b      FP8 delayed: R8_TO (19) steps uninterrupted, twice (the run-to-run spread);
#                  R8_AT (10) steps with a sharded checkpoint at the end, resumed from it; the
#                  resumed losses after R8_AT against the whole run's, and the spread (the ~90 GB
#                  checkpoint goes under R8_ROOT, default /tmp/multi_gpu_8b, and is deleted after)
#   scaling-8b     tok/s per GPU of FSDP2 on DEVICES8B GPUs against one GPU, the 8B shape cut to
#                  4 and 8 layers (one GPU cannot hold 32); the full depth's one-GPU figure is
#                  extrapolated from those two (time per step linear in the layers)
#   probe-8b       where the memory goes: FP8 delayed under FSDP2 on DEVICES8B GPUs, 2 steps, per
#                  AC8B (default "mlp"), under scripts/memprobe.py: rank 0's live allocations at
#                  its first out-of-memory error, grouped by where they were made (OUT/p8-AC.txt;
#                  MEMPROBE_FRACTION stops a run that fits at that share of the GPU)
#   memory-8b      the memory check against the measured peak: the 8B shape cut to 4 and 8 layers
#                  (their difference over 4 is what a block costs), FP8 delayed under FSDP2 on
#                  DEVICES8B GPUs, 1 x 8192 per GPU, 4 steps, for each of AC8B (activation
#                  checkpointing; default "mlp full none")
#   throughput-8b  FSDP2 tok/s per GPU of the 8B model (BF16 compiled and FP8 delayed,
#                  VARIANTS8B_TP) on each of GPUS8B (default 2 4), 1 x 8192 per GPU, STEPS8B steps;
#                  scaling against the fewest GPUs run
# Env: OUT (default multi_gpu_out), PYTHON, DATA, STEPS (throughput steps, default 120), PRECISIONS
# (default "fp8 bf16"), GPUS (default "2 4"; empty: the one-GPU runs only), STRATEGIES (default "ddp fsdp"; also ddp-bf16grad:
# gradients all-reduced in BF16; ddp-bN: DDP's gradient buckets of N MB (default 25); fsdp-keep / fsdp-reshard: reshard_after_forward false / true,
# fsdp-g4: 4 blocks per FSDP2 unit, fsdp-eager / fsdp-compiled: model.compile false / true;
# combined as fsdp-reshard-g1-compiled), COMPILE (unset:
# model.compile's default), PROFILE_AT (default STEPS - 10: the steps after a profile run slower), SINGLE (default 1; 0 skips the one-GPU runs),
# LOSS_GPUS (default 4: loss-gpt2's and resume-gpt2's several-GPU count); ONE_SETS (default "0 1")
# and SETS (default none: one run after the other) the GPUs and GPU pairs the table jobs run on
# at once, each pair with its own rendezvous port;
# for the
# 8B jobs LLAMA (8b, default, or 3b: the same jobs on configs/llama3_3b_*.yaml, but scaling-8b
# and memory-8b), DEVICES8B (default 2), SETS8B (table-8b's GPU sets run at once), STEPS8B (default 30), LAYERS (cut the model: a dry run on one
# GPU is DEVICES8B=1 LAYERS=2), GPUS8B (default "2 4"), VARIANTS8B, T8_ARGS, PLAIN8B_AC, PLAIN8B_STEPS, EVAL8B, AC8B, VARIANTS8B_TP, R8_ROOT, R8_AT, R8_TO, DATA8K (default
# /tmp/pycode-ds-8k), FIT_TIMEOUT (default 420 s), ARCHIVE (a tar file each run's log is
# appended to as the run ends: a job killed midway keeps the finished runs' logs).
# A summary table (scripts/multi_gpu_summary.py) at the end.
set -u
cd "$(dirname "$0")/.."
# NVLink multicast stays off: it can take shared GPUs out of service.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-multi_gpu_out}
PYTHON=${PYTHON:-python}
STEPS=${STEPS:-120}
PRECISIONS=${PRECISIONS:-fp8 bf16}  # entries of precision_args
GPUS=${GPUS-2 4}  # the several-GPU counts (those this machine has); GPUS= (empty): none
STRATEGIES=${STRATEGIES:-ddp fsdp}
case ${SINGLE:-1} in 0|1) ;; *) echo "error: SINGLE=$SINGLE; valid: 1 (the one-GPU runs too) or 0" >&2; exit 2 ;; esac
LLAMA=${LLAMA:-8b}  # 3b: table-8b, eval-8b, resume-8b, probe-8b, throughput-8b on configs/llama3_3b_*.yaml
case $LLAMA in 8b) LLAMA_PRESET=llama3-8b ;; 3b) LLAMA_PRESET=llama3.2-3b ;;
    *) echo "error: LLAMA=$LLAMA; valid: 8b or 3b" >&2; exit 2 ;; esac
R8_AT=${R8_AT:-10} R8_TO=${R8_TO:-19}
if ! [[ $R8_AT =~ ^[0-9]+$ && $R8_TO =~ ^[0-9]+$ ]] || (( R8_AT < 1 || R8_AT >= R8_TO )); then
    echo "error: R8_AT=$R8_AT R8_TO=$R8_TO; valid: whole numbers, 1 <= R8_AT < R8_TO" >&2
    exit 2
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p "$OUT"
PY_DATA_DEFER=1 . scripts/py_data.sh
data1k() {  # the 1024-token corpus, once, at the first job that trains on it (not the plain ones)
    pycode_prepare "$DATA" 1024 16 || { echo "no data in $DATA"; return 1; }
}
NGPU=$($PYTHON -c "import torch; print(torch.cuda.device_count())")
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1 | tee "$OUT/gpu.txt"
git rev-parse HEAD 2>/dev/null | tee "$OUT/commit.txt"

# Throughput runs: no validation, no checkpoints, no text samples (the guard and monitor stay).
cat > "$OUT/throughput.yaml" <<'YAML'
trainer:
  limit_val_batches: 0
  enable_checkpointing: false
  enable_progress_bar: false
  callbacks:
    - class_path: fp8_lightning.NaNGuard
    - class_path: fp8_lightning.TrainingMonitor
      init_args:
        sample_prompt: null
YAML

# Loss runs: last.ckpt every 100 steps and the last 2 kept (step-0000100.ckpt is resumed below).
cat > "$OUT/loss.yaml" <<'YAML'
trainer:
  enable_progress_bar: false
  callbacks:
    - class_path: fp8_lightning.Checkpoint
      init_args:
        every_n_train_steps: 100
        save_top_k: 0
        keep_last: 2
    - class_path: fp8_lightning.NaNGuard
    - class_path: fp8_lightning.TrainingMonitor
      init_args:
        sample_prompt: null
YAML

keep() {  # keep FILE...: append files of OUT to ARCHIVE, when set (locked: a pair's two runs
    # may end together)
    [ -n "${ARCHIVE:-}" ] && (flock 9 && tar -rf "$ARCHIVE" -C "$OUT" "$@") 9> "$ARCHIVE.lock"
    return 0
}

logged() {  # logged NAME DEVICES CMD...: CMD's output into OUT/NAME.log after the "=== devices"
    # line the summary reads, under FIT_TIMEOUT; its exit status and seconds, the log archived
    local name=$1 devices=$2 start=$SECONDS
    shift 2
    echo "=== devices: $devices" > "$OUT/$name.log"
    # timeout leads its own process group (the run's ranks in it): a TERM to this script (an
    # outer time limit) must end that group too, or the ranks held the GPUs into the next run
    # ("CUDA-capable device(s) is/are busy"). Run in the background, as bash runs a trap only
    # between commands and wait is one; the trap runs once (timeout's group kill sends a second
    # TERM) and waits for the run (KILL 15 s after the TERM), so the GPUs are free on return.
    timeout -k 15 "${FIT_TIMEOUT:-420}" "$@" >> "$OUT/$name.log" 2>&1 &
    local pid=$! rc
    trap 'trap "" TERM INT; kill -TERM -- '$pid' -'$pid' 2>/dev/null; wait '$pid'
          keep "'"$name"'.log"; exit 143' TERM INT
    wait $pid
    rc=$?
    trap - TERM INT
    echo "=== $name: exit $rc after $((SECONDS - start)) s"
    keep "$name.log"
}

fit() {  # fit NAME DEVICES STRATEGY_CONFIG|none ARGS...
    local name=$1 devices=$2 strategy=$3
    shift 3
    local extra=()
    [ "$strategy" != none ] && extra=(--config "$strategy")
    echo "=== $name: $devices GPU(s) ${strategy}"
    logged "$name" "$devices" $PYTHON -m fp8_lightning fit --config "${CONFIG:-configs/gpt2_fp8.yaml}" \
        "${extra[@]}" --trainer.devices "$devices" --data.data_dir "$DATA" --data.num_workers 2 \
        --trainer.default_root_dir "$OUT/$name" --trainer.enable_progress_bar false "$@"
    grep -E "Error|error:" "$OUT/$name.log" | head -3
}

precision_args() {  # precision_args NAME: the config and overrides of a PRECISIONS entry
    case $1 in
        bf16)           echo "configs/gpt2_bf16.yaml" ;;
        fp8)            echo "configs/gpt2_fp8.yaml" ;;  # TE delayed
        fp8-nograph)    echo "configs/gpt2_fp8.yaml --model.cuda_graphs false" ;;
        fp8-current)    echo "configs/gpt2_fp8.yaml --trainer.plugins.init_args.recipe current" ;;
        fp8-head)       echo "configs/gpt2_fp8.yaml --trainer.plugins.init_args.fp8_lm_head true" ;;  # LM head FP8 too
        fp8-tensorwise) echo "configs/gpt2_fp8.yaml --trainer.plugins.init_args.recipe tensorwise --model.attention sdpa" ;;
        *) echo "unknown precision $1" >&2; return 1 ;;
    esac
}

strategy_args() {  # strategy_args NAME: the overlay and overrides of a STRATEGIES entry
    # ddp | ddp-bf16grad | fsdp[-keep|-reshard][-gN][-eager|-compiled]: FSDP2Strategy's layout
    # chosen unless -keep (no reshard after forward), -reshard (reshard), -gN (N blocks per
    # unit); -eager without torch.compile, -compiled with it everywhere (model.compile: true)
    local name=$1 args
    case $name in
        ddp)          echo "configs/ddp.yaml"; return ;;
        ddp-bf16grad) echo "configs/ddp.yaml --trainer.strategy.init_args.ddp_comm_hook $BF16_HOOK"; return ;;
        ddp-b*)       [[ $name =~ ^ddp-b([1-9][0-9]*)$ ]] || { echo "unknown strategy $name (ddp-bN: N MB, a whole number)" >&2; return 1; }
                      echo "configs/ddp.yaml --trainer.strategy.init_args.bucket_cap_mb ${BASH_REMATCH[1]}"; return ;;
        fsdp*)        args="configs/fsdp.yaml" ;;
        *) echo "unknown strategy $name" >&2; return 1 ;;
    esac
    [[ $name == *-keep* ]] && args+=" --trainer.strategy.init_args.reshard_after_forward false"
    [[ $name =~ -g([0-9]+) ]] && args+=" --trainer.strategy.init_args.blocks_per_unit ${BASH_REMATCH[1]}"
    [[ $name == *-reshard* ]] && args+=" --trainer.strategy.init_args.reshard_after_forward true"
    [[ $name == *-eager* ]] && args+=" --model.compile false"
    [[ $name == *-compiled* ]] && args+=" --model.compile true"
    echo "$args"
}
BF16_HOOK=torch.distributed.algorithms.ddp_comm_hooks.default_hooks.bf16_compress_hook

plain_run() {  # plain_run MODEL BATCH single|ddp|fsdp GPUS [NAME [ARGS...]]: one run of
    # benchmarks/plain_pytorch.py, STEPS steps; NAME its log's (default plain-MODEL-...), ARGS more
    # of its flags
    local model=$1 batch=$2 s=$3 n=$4 name=${5:-}
    shift $(( $# < 5 ? $# : 5 ))
    local args=(--model "$model" --batch_size "$batch")
    if [ "$s" = single ]; then
        name=${name:-plain-$model-1gpu}
        echo "=== $name"
        CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0} logged "$name" 1 \
            $PYTHON benchmarks/plain_pytorch.py "${args[@]}" "$@" --steps "$STEPS"
    else
        name=${name:-plain-$model-$s-${n}gpu}
        echo "=== $name"
        logged "$name" "$n" $PYTHON -m torch.distributed.run --nproc_per_node "$n" \
            benchmarks/plain_pytorch.py "${args[@]}" --strategy "$s" "$@" --steps "$STEPS"
    fi
    tail -n1 "$OUT/$name.log"
}

plain() {  # plain MODEL BATCH: benchmarks/plain_pytorch.py on 1 GPU, then each of STRATEGIES on GPUS
    local n s
    [ "${SINGLE:-1}" = 1 ] && plain_run "$1" "$2" single 1
    for n in $GPUS; do
        [ "$n" -le "$NGPU" ] || continue
        for s in $STRATEGIES; do plain_run "$1" "$2" "$s" "$n"; done
    done
}

tp_run() {  # tp_run MODEL BATCH PRECISION single|STRATEGY GPUS: one fit of the throughput runs
    local model=$1 batch=$2 prec=$3 s=$4 n=$5 cfg strat
    cfg=($(precision_args "$prec")) || return
    # StepProfile splits steps PROFILE_AT.. into GPU compute, exposed communication and GPU idle
    local args=(--config "$OUT/throughput.yaml" --model.config.name "$model" --data.batch_size "$batch"
                --trainer.max_steps "$STEPS" --trainer.log_every_n_steps 10
                --trainer.callbacks+=fp8_lightning.StepProfile
                --trainer.callbacks.start_step "${PROFILE_AT:-$((STEPS - 10))}")
    [ -n "${COMPILE:-}" ] && args+=(--model.compile "$COMPILE")
    if [ "$s" = single ]; then
        CONFIG=${cfg[0]} fit "tp-$model-$prec-1gpu" 1 none "${args[@]}" "${cfg[@]:1}"
        return
    fi
    strat=($(strategy_args "$s")) || return
    CONFIG=${cfg[0]} fit "tp-$model-$prec-$s-${n}gpu" "$n" "${strat[0]}" "${args[@]}" \
        "${cfg[@]:1}" "${strat[@]:1}"
}

throughput() {  # throughput MODEL BATCH: each of PRECISIONS on 1 GPU, then DDP and FSDP2 on GPUS
    data1k || return
    local prec n s
    for prec in $PRECISIONS; do
        [ "${SINGLE:-1}" = 1 ] && tp_run "$1" "$2" "$prec" single 1
        for n in $GPUS; do
            [ "$n" -le "$NGPU" ] || continue
            for s in $STRATEGIES; do tp_run "$1" "$2" "$prec" "$s" "$n"; done
        done
    done
}

fabric_run() {  # fabric_run single|ddp|fsdp GPUS: examples/fabric_train.py, GPT-2 124M, 16 x 1024
    local s=$1 n=$2 name
    local args=(--model gpt2 --batch_size 16 --seq_len 1024 --corpus_chars 1100000 --steps "$STEPS"
                --log_every 10 --save_every 100000 --compile --fresh)
    if [ "$s" = single ]; then name=fabric-gpt2-1gpu; else
        name="fabric-gpt2-$s-${n}gpu"; args+=(--devices "$n" --strategy "$s"); fi
    echo "=== $name"
    CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-$(seq -s, 0 $((n - 1)))} logged "$name" "$n" \
        $PYTHON examples/fabric_train.py "${args[@]}" --ckpt "$OUT/$name.ckpt"
    rm -rf "$OUT/$name.ckpt"
}

at_once() {  # at_once "SET..." JOB...: each JOB (a command line of this script's functions) on a
    # GPU set (CUDA_VISIBLE_DEVICES), as many at a time as there are sets, each set with its own
    # rendezvous port; with no set, one after the other on the default GPUs
    local sets=($1) i=0 job
    shift
    # A TERM to this script ends the runs of the background jobs too (each job's logged ends its
    # own run), and waits for them.
    [ ${#sets[@]} -gt 0 ] && trap 'trap "" TERM INT; kill -TERM $(jobs -p) 2>/dev/null; wait; exit 143' TERM INT
    for job in "$@"; do
        if [ ${#sets[@]} = 0 ]; then eval "$job"; continue; fi
        local port=$((29600 + 10 * i))
        (export CUDA_VISIBLE_DEVICES=${sets[$i]} MASTER_PORT=$port PET_MASTER_PORT=$port
         eval "$job") &
        i=$(( (i + 1) % ${#sets[@]} ))
        [ "$i" = 0 ] && wait
    done
    wait
    trap - TERM INT
}

table() {  # table MODEL BATCH [ddp|fsdp]: docs/benchmarks.md's two-GPU table of MODEL in one go
    # (one strategy's rows where named). The one-GPU runs go as many at a time as ONE_SETS has
    # GPUs (default "0 1": FP8 beside the plain BF16 script, the package's BF16 beside the Fabric
    # example); the two-GPU runs (the plain script, the package's BF16 (DDP), FP8 TE delayed,
    # torchao tensorwise (FSDP2) and, for GPT-2, the Fabric example) one after the other, or as
    # many at a time as SETS has GPU pairs (e.g. "0,1 2,3" on four GPUs).
    local model=$1 batch=$2 only=${3:-} s
    local strategies=${only:-ddp fsdp}
    data1k || return
    local one=("plain_run $model $batch single 1" "tp_run $model $batch fp8 single 1") two=()
    if [ "$only" != fsdp ]; then
        one+=("tp_run $model $batch bf16 single 1")
        [ "$model" = gpt2 ] && one+=("fabric_run single 1")
    fi
    for s in $strategies; do two+=("plain_run $model $batch $s 2"); done
    [ "$only" != fsdp ] && two+=("tp_run $model $batch bf16 ddp 2")
    for s in $strategies; do two+=("tp_run $model $batch fp8 $s 2"); done
    [ "$only" != ddp ] && two+=("tp_run $model $batch fp8-tensorwise fsdp 2")
    if [ "$model" = gpt2 ]; then for s in $strategies; do two+=("fabric_run $s 2"); done; fi
    # SINGLE=0: the two-GPU rows only (a strategy's rows in a later run on the same machine)
    [ "${SINGLE:-1}" = 1 ] && at_once "${ONE_SETS:-0 1}" "${one[@]}"
    at_once "${SETS:-}" "${two[@]}"
}

LOSS_GPUS=${LOSS_GPUS:-4}  # the several-GPU count of loss-gpt2 / resume-gpt2 (2, 4 or 8)
LOSS_BATCH=$((32 / LOSS_GPUS))  # per GPU: the global batch stays 32 x 1024
LOSS_ARGS=(--config "$OUT/loss.yaml" --trainer.max_steps 200 --trainer.val_check_interval 200
           --trainer.limit_val_batches 40 --trainer.log_every_n_steps 50 --model.warmup_steps 50)

loss() {  # 200 steps, global batch 32 x 1024, val loss at 200; then resume FSDP2 from step 100
    data1k || return
    local n=$LOSS_GPUS
    fit loss-1gpu 1 none "${LOSS_ARGS[@]}" --data.batch_size "$LOSS_BATCH" \
        --trainer.accumulate_grad_batches "$n" --data.emulate_ranks "$n"
    fit "loss-ddp-${n}gpu" "$n" configs/ddp.yaml "${LOSS_ARGS[@]}" --data.batch_size "$LOSS_BATCH"
    resume
}

resume() {  # FSDP2 (LOSS_GPUS), sharded checkpoints at 100 and 200; resume 100 -> 200; consolidate
    data1k || return
    local n=$LOSS_GPUS
    local name="loss-fsdp-${n}gpu"
    # This one samples text at its validation: under FSDP every rank runs the sampler.
    fit "$name" "$n" configs/fsdp.yaml "${LOSS_ARGS[@]}" --data.batch_size "$LOSS_BATCH" \
        --trainer.callbacks.init_args.sample_prompt "import torch"
    ls -la "$OUT/$name/checkpoints" "$OUT/$name/checkpoints/last.ckpt" | tee "$OUT/fsdp-ckpt-ls.txt"
    $PYTHON -m fp8_lightning checkpoints "$OUT/$name" | tee "$OUT/fsdp-checkpoints.txt"
    fit "$name-resumed" "$n" configs/fsdp.yaml "${LOSS_ARGS[@]}" --data.batch_size "$LOSS_BATCH" \
        --ckpt_path "$OUT/$name/checkpoints/step-0000100.ckpt"
    $PYTHON -m fp8_lightning consolidate "$OUT/$name/checkpoints/last.ckpt" "$OUT/consolidated.ckpt" \
        && CUDA_VISIBLE_DEVICES=0 $PYTHON -m fp8_lightning generate --ckpt "$OUT/consolidated.ckpt" \
            --prompt "import torch" --max_new_tokens 24 --backend torch 2>&1 | tail -2 | tee "$OUT/generate.txt"
    rm -f "$OUT/consolidated.ckpt"
}

# ---------------------------------------------------------------------------------- Llama-3-8B
DEVICES8B=${DEVICES8B:-2}
STEPS8B=${STEPS8B:-30}
DATA8K=${DATA8K:-/tmp/pycode-ds-8k}

data8k() {  # the corpus of py_data.sh cut in blocks of 8192 (+1) tokens, once; fails if it cannot
    # 4 workers: each worker's share of the 0.5% val split must hold whole blocks of 8193 tokens
    # (more workers can leave none on a small corpus).
    pycode_prepare "$DATA8K" 8192 4
}

llama() {  # llama NAME VARIANT DEVICES ARGS...: one 8B run (LAYERS cuts it)
    local name=$1 variant=$2 devices=$3 cfg=configs/llama3_${LLAMA}_fp8.yaml
    shift 3
    local plugin=--trainer.plugins.init_args extra=()
    case $variant in
        bf16)                 cfg=configs/llama3_${LLAMA}_bf16.yaml ;;
        fp8-delayed)          ;;
        fp8-current|fp8-block) extra=("$plugin.recipe" "${variant#fp8-}") ;;
        fp8-current-bf16ends|fp8-delayed-bf16ends)
            local recipe=${variant#fp8-}
            extra=("$plugin.recipe" "${recipe%-bf16ends}" "$plugin.bf16_first_layers" 1
                   "$plugin.bf16_last_layers" 1) ;;
        fp8-tensorwise)       extra=("$plugin.recipe" tensorwise --model.attention sdpa) ;;
        fp8-tensorwise-ag)    extra=("$plugin.recipe" tensorwise --model.attention sdpa
                                     --trainer.strategy.init_args.float8_all_gather true) ;;
        *) echo "unknown 8B variant $variant"; return ;;
    esac
    [ -n "${LAYERS:-}" ] && extra+=(--model.config.n_layer "$LAYERS")
    CONFIG=$cfg DATA=$DATA8K FIT_TIMEOUT=${FIT_TIMEOUT:-420} fit "$name" "$devices" none \
        "${extra[@]}" --data.num_workers 2 "$@"
}

table8b() {  # one run per variant, same seed, data and global batch; val loss at the last step.
    # SETS8B: GPU sets that run variants at the same time, one each (e.g. "0,1 2,3" on four GPUs
    # with DEVICES8B=2: half the wall time; the runs share the host)
    data8k || return
    local v jobs=()
    for v in ${VARIANTS8B:-bf16 plain-bf16 fp8-delayed fp8-current fp8-block fp8-current-bf16ends fp8-tensorwise}; do
        jobs+=("t8 $v")
    done
    at_once "${SETS8B:-}" "${jobs[@]}"
}

t8() {  # t8 VARIANT: one run of the seed table (T8_ARGS: overrides for every run, e.g. fp8_eval)
    if [ "$1" = plain-bf16 ]; then  # the same model in benchmarks/plain_pytorch.py's loop, speed only
        STEPS=${PLAIN8B_STEPS:-60} plain_run "$LLAMA_PRESET" 1 fsdp "$DEVICES8B" t8-plain-bf16 \
            --activation_checkpointing "${PLAIN8B_AC:-mlp}" --warmup 20 ${LAYERS:+--n_layer $LAYERS}
        return
    fi
    llama "t8-$1" "$1" "$DEVICES8B" --config "$OUT/throughput.yaml" --trainer.max_steps "$STEPS8B" \
        --trainer.log_every_n_steps 5 --trainer.val_check_interval "$STEPS8B" \
        --trainer.limit_val_batches 4 --trainer.num_sanity_val_steps 0 ${T8_ARGS:-}
}

throughput8b() {  # FSDP2 tok/s per GPU of the 8B model on each of GPUS8B, BF16 compiled and FP8
    data8k || return
    local v n
    for v in ${VARIANTS8B_TP:-bf16 fp8-delayed}; do
        for n in ${GPUS8B:-2 4}; do
            [ "$n" -le "$NGPU" ] || continue
            llama "tp8-$v-${n}gpu" "$v" "$n" --config "$OUT/throughput.yaml" \
                --trainer.max_steps "$STEPS8B" --trainer.log_every_n_steps 5
        done
    done
}

eval8b() {  # validation inside an FP8 run: BF16 (default) and FP8 (fp8_eval)
    data8k || return
    for e in ${EVAL8B:-false true}; do
        llama "e8-fp8eval-$e" fp8-delayed "$DEVICES8B" --config "$OUT/throughput.yaml" \
            --trainer.max_steps 20 --trainer.log_every_n_steps 5 --trainer.val_check_interval 10 \
            --trainer.limit_val_batches 4 --trainer.num_sanity_val_steps 0 \
            --trainer.plugins.init_args.fp8_eval "$e"
    done
}

resume8b() {  # sharded checkpoint at step R8_AT, resumed to R8_TO: its losses against one run's
    data8k || return
    # On disk, not /dev/shm: the 8B checkpoint in RAM beside the ranks' own host memory can exhaust
    # the host. R8_ROOT moves it.
    local root=${R8_ROOT:-/tmp/multi_gpu_8b} free
    mkdir -p "$root"
    free=$(df -BG --output=avail "$root" 2>/dev/null | tail -1 | tr -dc 0-9)
    echo "=== resume-8b: checkpoints under $root (${free:-?} GB free; ~12 bytes per parameter)"
    # R8_AT / R8_TO: the checkpoint's step and the last one. One schedule for all four runs (the
    # LR decays over R8_TO steps, not over each run's max_steps); later steps (e.g. 30 / 40, past
    # the warm-up's loss swings) make a tighter check for the same cost.
    cat > "$OUT/resume8b.yaml" <<YAML
trainer:
  limit_val_batches: 0
  enable_progress_bar: false
  callbacks:  # throughput.yaml's, plus the checkpoint: the runs differ only by the resume
    - class_path: fp8_lightning.Checkpoint
      init_args:
        every_n_train_steps: $R8_AT
        save_top_k: 0
    - class_path: fp8_lightning.NaNGuard
    - class_path: fp8_lightning.TrainingMonitor
      init_args:
        sample_prompt: null
YAML
    local args=(--trainer.log_every_n_steps 1 --model.lr_decay_steps "$R8_TO")
    # Twice: no two runs are bitwise equal (atomics in the backward), and in these first steps
    # (the loss falls steeply) a small difference grows; the resumed run is judged against that
    # spread.
    local again
    for again in whole again; do
        llama "r8-$again" fp8-delayed "$DEVICES8B" --config "$OUT/throughput.yaml" "${args[@]}" \
            --trainer.max_steps "$R8_TO"
    done
    llama r8-first fp8-delayed "$DEVICES8B" --config "$OUT/resume8b.yaml" "${args[@]}" \
        --trainer.max_steps "$R8_AT" --trainer.default_root_dir "$root/r8-first"
    du -sh "$root/r8-first/checkpoints/last.ckpt" | tee "$OUT/r8-ckpt-size.txt"
    $PYTHON -m fp8_lightning checkpoints "$root/r8-first" | tee "$OUT/r8-checkpoints.txt"
    llama r8-resumed fp8-delayed "$DEVICES8B" --config "$OUT/throughput.yaml" "${args[@]}" \
        --trainer.max_steps "$R8_TO" --ckpt_path "$root/r8-first/checkpoints/last.ckpt"
    rm -rf "$root/r8-first"
}

memory8b() {  # the estimate against the peak, per activation checkpointing, at 4 and 8 layers
    data8k || return
    local ac n
    for ac in ${AC8B:-mlp full none}; do
        for n in 4 8; do
            LAYERS=$n llama "m8-$ac-l$n" fp8-delayed "$DEVICES8B" --config "$OUT/throughput.yaml" \
                --trainer.max_steps 4 --trainer.log_every_n_steps 2 \
                --model.activation_checkpointing "$ac"
        done
    done
}

probe8b() {  # rank 0's live allocations at its first out-of-memory error, per AC8B
    data8k || return
    local ac
    for ac in ${AC8B:-mlp}; do
        rm -f "$OUT/p8-$ac.txt"  # (an earlier invocation's)
        MEMPROBE_OUT=$OUT/p8-$ac.txt PYTHON="$PYTHON scripts/memprobe.py" llama "p8-$ac" \
            fp8-delayed "$DEVICES8B" --config "$OUT/throughput.yaml" --trainer.max_steps 2 \
            --trainer.log_every_n_steps 1 --model.activation_checkpointing "$ac"
        cat "$OUT/p8-$ac.txt" 2>/dev/null && keep "p8-$ac.txt" || echo "p8-$ac: no out-of-memory error"
    done
}

scaling8b() {  # FSDP2 on DEVICES8B GPUs against one GPU, at 4 and 8 layers of the 8B shape
    data8k || return
    local args=(--config "$OUT/throughput.yaml" --trainer.max_steps "$STEPS8B" --trainer.log_every_n_steps 5)
    for n in 4 8; do
        LAYERS=$n llama "s8-l$n-1gpu" fp8-delayed 1 "${args[@]}"
        [ "$DEVICES8B" -gt 1 ] && LAYERS=$n llama "s8-l$n-${DEVICES8B}gpu" fp8-delayed "$DEVICES8B" "${args[@]}"
    done
}

for j in "$@"; do
    case $j in
        throughput-gpt2)     throughput gpt2 16 ;;
        throughput-gpt-1.3b) throughput gpt-1.3b 8 ;;
        plain-gpt2)          plain gpt2 16 ;;
        plain-gpt-1.3b)      plain gpt-1.3b 8 ;;
        table-gpt2)          table gpt2 16 ;;
        table-gpt-1.3b)      table gpt-1.3b 8 ;;
        table-gpt-1.3b-ddp)  table gpt-1.3b 8 ddp ;;
        table-gpt-1.3b-fsdp) table gpt-1.3b 8 fsdp ;;
        loss-gpt2)           loss ;;
        resume-gpt2)         resume ;;
        table-8b)            table8b ;;
        eval-8b)             eval8b ;;
        resume-8b)           resume8b ;;
        scaling-8b|memory-8b)
            # (their summaries reckon with the 8B's 32 blocks)
            [ "$LLAMA" = 8b ] || { echo "error: $j runs the 8B only (LLAMA=$LLAMA)" >&2; exit 2; }
            if [ "$j" = scaling-8b ]; then scaling8b; else memory8b; fi ;;
        probe-8b)            probe8b ;;
        throughput-8b)       throughput8b ;;
        *) echo "unknown job $j; valid: table-gpt2 table-gpt-1.3b table-gpt-1.3b-ddp table-gpt-1.3b-fsdp throughput-gpt2 throughput-gpt-1.3b plain-gpt2 plain-gpt-1.3b loss-gpt2 resume-gpt2" \
                "table-8b eval-8b resume-8b scaling-8b memory-8b probe-8b throughput-8b"; exit 2 ;;
    esac
done
find "$OUT" -name "*.ckpt" -prune -exec rm -rf {} + 2>/dev/null
$PYTHON scripts/multi_gpu_summary.py "$OUT" | tee "$OUT/summary.txt"
keep summary.txt
# The logs travel as one archive.
tar czf "$OUT/multi_gpu_logs.tgz" -C "$OUT" $(cd "$OUT" && ls *.log *.txt *.yaml 2>/dev/null) && \
    (cd "$OUT" && rm -rf -- *.log *.yaml tp-* plain-* fabric-* loss-* t8-* e8-* r8-* s8-* m8-* p8-* tp8-*)
