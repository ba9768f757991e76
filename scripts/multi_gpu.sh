#!/usr/bin/env bash
# docs/benchmarks.md "Several GPUs": FP8 (delayed) training through Lightning's strategies with the
# shipped overlays configs/ddp.yaml and configs/fsdp.yaml, on the real-text corpus of
# scripts/py_data.sh, one process per GPU.
#
# Usage: scripts/multi_gpu.sh JOB...
#   throughput-gpt2 | throughput-gpt-1.3b   tok/s on 1 GPU, then DDP and FSDP2 on 2 and 4 GPUs
#                                           (STEPS steps; log lines after the first two are kept)
#   loss-gpt2      200 steps with one global batch of 32 x 1024: 1 GPU reading the 4 ranks' samples
#                  (data.emulate_ranks 4, batch 8 x 4 accumulated: at every step exactly the
#                  samples of the 4-GPU runs), DDP and FSDP2 on 4 GPUs (batch 8 each); val loss
#                  at step 200. Then the FSDP2 run's sharded step-100 checkpoint is resumed to
#                  step 200 (FP8 scaling state from meta.pt), consolidated, and sampled on one GPU.
#   resume-gpt2    only the FSDP2 part of loss-gpt2
# Env: OUT (default multi_gpu_out), PYTHON, DATA, STEPS (throughput steps, default 60).
# A summary table (scripts/multi_gpu_summary.py) at the end.
set -u
cd "$(dirname "$0")/.."
# NVLink multicast stays off (the GPU machines' rule: it can take shared GPUs out of service).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-multi_gpu_out}
PYTHON=${PYTHON:-python}
STEPS=${STEPS:-60}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p "$OUT"
. scripts/py_data.sh
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

fit() {  # fit NAME DEVICES STRATEGY_CONFIG|none ARGS...
    local name=$1 devices=$2 strategy=$3 start=$SECONDS
    shift 3
    local extra=()
    [ "$strategy" != none ] && extra=(--config "$strategy")
    echo "=== $name: $devices GPU(s) ${strategy}"
    timeout 420 $PYTHON -m fp8_lightning fit --config configs/gpt2_fp8.yaml "${extra[@]}" \
        --trainer.devices "$devices" --data.data_dir "$DATA" --data.num_workers 2 \
        --trainer.default_root_dir "$OUT/$name" --trainer.enable_progress_bar false "$@" \
        > "$OUT/$name.log" 2>&1
    echo "=== $name: exit $? after $((SECONDS - start)) s"
    grep -E "Error|error:" "$OUT/$name.log" | head -3
}

throughput() {  # throughput MODEL BATCH
    local model=$1 batch=$2
    local args=(--config "$OUT/throughput.yaml" --model.config.name "$model" --data.batch_size "$batch"
                --trainer.max_steps "$STEPS" --trainer.log_every_n_steps 10)
    fit "tp-$model-1gpu" 1 none "${args[@]}"
    for n in 2 4; do
        [ "$n" -le "$NGPU" ] || continue
        fit "tp-$model-ddp-${n}gpu" "$n" configs/ddp.yaml "${args[@]}"
        fit "tp-$model-fsdp-${n}gpu" "$n" configs/fsdp.yaml "${args[@]}"
    done

}

loss() {  # 200 steps, global batch 32 x 1024, val loss at 200; then resume FSDP2 from step 100
    local args=(--config "$OUT/loss.yaml" --trainer.max_steps 200 --trainer.val_check_interval 200
                --trainer.limit_val_batches 40 --trainer.log_every_n_steps 50 --model.warmup_steps 50)
    fit loss-1gpu 1 none "${args[@]}" --data.batch_size 8 --trainer.accumulate_grad_batches 4 \
        --data.emulate_ranks 4
    fit loss-ddp-4gpu 4 configs/ddp.yaml "${args[@]}" --data.batch_size 8
    resume
}

resume() {  # FSDP2 (4 GPUs), sharded checkpoints at 100 and 200; resume step 100 -> 200; consolidate
    local args=(--config "$OUT/loss.yaml" --trainer.max_steps 200 --trainer.val_check_interval 200
                --trainer.limit_val_batches 40 --trainer.log_every_n_steps 50 --model.warmup_steps 50)
    # This one samples text at its validation: under FSDP every rank runs the sampler.
    fit loss-fsdp-4gpu 4 configs/fsdp.yaml "${args[@]}" --data.batch_size 8 \
        --trainer.callbacks.init_args.sample_prompt "import torch"
    ls -la "$OUT/loss-fsdp-4gpu/checkpoints" "$OUT/loss-fsdp-4gpu/checkpoints/last.ckpt" | tee "$OUT/fsdp-ckpt-ls.txt"
    $PYTHON -m fp8_lightning checkpoints "$OUT/loss-fsdp-4gpu" | tee "$OUT/fsdp-checkpoints.txt"
    fit loss-fsdp-4gpu-resumed 4 configs/fsdp.yaml "${args[@]}" --data.batch_size 8 \
        --ckpt_path "$OUT/loss-fsdp-4gpu/checkpoints/step-0000100.ckpt"
    $PYTHON -m fp8_lightning consolidate "$OUT/loss-fsdp-4gpu/checkpoints/last.ckpt" "$OUT/consolidated.ckpt" \
        && CUDA_VISIBLE_DEVICES=0 $PYTHON -m fp8_lightning generate --ckpt "$OUT/consolidated.ckpt" \
            --prompt "import torch" --max_new_tokens 24 --backend torch 2>&1 | tail -2 | tee "$OUT/generate.txt"
    rm -f "$OUT/consolidated.ckpt"
}

for j in "$@"; do
    case $j in
        throughput-gpt2)     throughput gpt2 16 ;;
        throughput-gpt-1.3b) throughput gpt-1.3b 8 ;;
        loss-gpt2)           loss ;;
        resume-gpt2)         resume ;;
        *) echo "unknown job $j; valid: throughput-gpt2 throughput-gpt-1.3b loss-gpt2 resume-gpt2"; exit 2 ;;
    esac
done
find "$OUT" -name "*.ckpt" -prune -exec rm -rf {} + 2>/dev/null
$PYTHON scripts/multi_gpu_summary.py "$OUT" | tee "$OUT/summary.txt"
# The device returns few, shallow files: the logs travel as one archive.
tar czf "$OUT/multi_gpu_logs.tgz" -C "$OUT" $(cd "$OUT" && ls *.log *.txt *.yaml 2>/dev/null) && \
    (cd "$OUT" && rm -rf -- *.log *.yaml tp-* loss-*)
