#!/usr/bin/env bash
# The GPU runs behind docs/benchmarks.md: bench for GPT-2 124M, GPT-2 350M, the 1.3B GPT and the
# llama3-8b shape cut to 4 layers at seq 8192, and doctor's probe for GPT-2 124M and the 1.3B GPT
# (same micro-batch as their bench, so the prediction can be compared).
#
# Usage: scripts/device_bench.sh [JOB ...]    (default: all jobs, in this order)
#   JOBS: gpt2 gpt2-medium gpt-1.3b llama3-8b doctor-gpt2 doctor-gpt-1.3b
# Env: OUT (output dir, default bench_out), STEPS (15), WARMUP (5), JOB_TIMEOUT (s, default 240),
#      GPUS (e.g. "0 1 2": job i runs on GPU i mod 3, each GPU's jobs in order, GPUs in parallel;
#      every job still has its GPU to itself; default: all jobs in turn on the visible GPUs),
#      PYTHON (default python), VARIANTS (bench variants), ARGS (appended to every command; the last option wins, e.g.
#      ARGS="--n_layer 1 --batch_size 1 --seq_len 64" for a CPU smoke test).
# Outputs: $OUT/bench-<model>/{bench.json,bench.png}, $OUT/doctor-<model>.json, $OUT/*.log;
# a summary table (scripts/bench_summary.py) at the end.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-bench_out}
STEPS=${STEPS:-15}
WARMUP=${WARMUP:-5}
JOB_TIMEOUT=${JOB_TIMEOUT:-240}
CFG=configs/gpt2_fp8.yaml
VARIANTS=${VARIANTS:-torch-compile,te-bf16,fp8-delayed,fp8-current,fp8-block,fp8-mxfp8,fp8-delayed-te-attn,fp8-delayed-nograph,fp8-delayed-bf16ends}
ARGS=${ARGS:-}
PYTHON=${PYTHON:-python}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p "$OUT"

job() {  # job NAME COMMAND...: run with a time limit, log to $OUT/NAME.log
    local name=$1 start=$SECONDS
    shift
    echo "=== $name: $*"
    # shellcheck disable=SC2086  # ARGS is split on purpose
    timeout "$JOB_TIMEOUT" "$@" $ARGS 2>&1 | tee "$OUT/$name.log"
    echo "=== $name: exit ${PIPESTATUS[0]} after $((SECONDS - start)) s"
}

bench() {  # bench NAME ARGS...
    local name=$1
    shift
    job "bench-$name" "$PYTHON" -m fp8_lightning bench --config "$CFG" --variants "$VARIANTS" \
        --steps "$STEPS" --warmup "$WARMUP" --output_dir "$OUT/bench-$name" "$@"
}

doctor() {  # doctor NAME ARGS...
    local name=$1
    shift
    job "doctor-$name" "$PYTHON" -m fp8_lightning doctor --config "$CFG" --output "$OUT/doctor-$name.json" "$@"
}

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/gpu.txt"
git rev-parse HEAD 2>/dev/null | tee "$OUT/commit.txt"
run_job() {
    case $1 in
        gpt2)            bench gpt2 --model gpt2 --batch_size 16 --seq_len 1024 ;;
        gpt2-medium)     bench gpt2-medium --model gpt2-medium --batch_size 8 --seq_len 1024 ;;
        gpt-1.3b)        bench gpt-1.3b --model gpt-1.3b --batch_size 8 --seq_len 1024 ;;
        llama3-8b)       bench llama3-8b --model llama3-8b --n_layer 4 --batch_size 1 --seq_len 8192 ;;
        doctor-gpt2)     doctor gpt2 --model gpt2 --batch_size 16 --seq_len 1024 ;;
        doctor-gpt-1.3b) doctor gpt-1.3b --model gpt-1.3b --batch_size 8 --seq_len 1024 ;;
        *) echo "unknown job $1; valid: gpt2 gpt2-medium gpt-1.3b llama3-8b doctor-gpt2 doctor-gpt-1.3b"; exit 2 ;;
    esac
}
jobs_list=(${@:-gpt2 gpt2-medium gpt-1.3b llama3-8b doctor-gpt2 doctor-gpt-1.3b})
read -ra gpus <<< "${GPUS:-}"
if [ ${#gpus[@]} -le 1 ]; then
    [ ${#gpus[@]} -eq 1 ] && export CUDA_VISIBLE_DEVICES=${gpus[0]}
    for j in "${jobs_list[@]}"; do run_job "$j"; done
else
    for i in "${!gpus[@]}"; do
        (
            export CUDA_VISIBLE_DEVICES=${gpus[$i]}
            for k in "${!jobs_list[@]}"; do
                if (( k % ${#gpus[@]} == i )); then run_job "${jobs_list[$k]}"; fi
            done
        ) > "$OUT/gpu${gpus[$i]}.log" 2>&1 &
    done
    wait
    grep -h "^=== .*exit" "$OUT"/gpu*.log
fi
"$PYTHON" scripts/bench_summary.py "$OUT"
