#!/usr/bin/env bash
# The GPU suite (`python -m pytest -m gpu`) spread over this machine's GPUs, for a machine whose
# commands are time-limited: the two-GPU file (tests/test_gpu_ddp.py) on GPUs 0,1 and the
# one-GPU files on the others at the same time (four GPUs or more), or the one-GPU files on each
# GPU and then the two-GPU file (two GPUs), or all in turn (one GPU).
#
# Usage: scripts/gpu_tests.sh [PYTEST ARGS...]   e.g. scripts/gpu_tests.sh -k "not within_3_percent"
# Env: OUT (logs, default gpu_tests_out), PART_TIMEOUT (s per pytest, default 540),
# FILES (the one-GPU test files; default every tests/test_gpu_*.py but the two-GPU one, and the
# notebook's), FP8L_RUN_TIMEOUT (s, default 300: a CLI fit inside a test that runs longer prints
# every process's Python stacks and fails, tests/_runs.py). Each pytest runs verbosely with its
# durations; the failures and the counts last.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_tests_out}
PYTHON=${PYTHON:-$(command -v python || command -v python3)}
export FP8L_RUN_TIMEOUT=${FP8L_RUN_TIMEOUT:-300}
mkdir -p "$OUT"
rm -f "$OUT/status.txt"
TWO=tests/test_gpu_ddp.py
FILES=${FILES:-$(ls tests/test_gpu.py tests/test_gpu_*.py tests/test_notebook.py | grep -v "^$TWO$")}
NGPU=$($PYTHON -c "import torch; print(torch.cuda.device_count())")

part() {  # part NAME GPUS FILE...: one pytest on GPUS, its log under OUT
    local name=$1 gpus=$2
    shift 2
    # -k 10: a fit inside a test installs Lightning's SIGTERM handler, which would outlive the
    # plain SIGTERM of the timeout
    CUDA_VISIBLE_DEVICES=$gpus timeout -k 10 "${PART_TIMEOUT:-540}" $PYTHON -m pytest -m gpu -v -rs \
        --durations=15 -p no:cacheprovider "$@" "${ARGS[@]}" > "$OUT/$name.log" 2>&1
    local rc=$?
    echo "=== $name (GPUs $gpus): exit $rc" | tee -a "$OUT/status.txt"
}

ARGS=("$@")
one=($FILES)
if [ "$NGPU" -ge 4 ]; then  # the two-GPU file beside the one-GPU parts
    part two-gpu 0,1 $TWO &
    spare=($(seq 2 $((NGPU - 1))))
elif [ "$NGPU" -ge 1 ]; then
    spare=($(seq 0 $((NGPU - 1))))
else
    echo "no CUDA GPU"; exit 2
fi
# the one-GPU files dealt largest first to the spare GPU with the least so far (a file's size
# stands for its run time), one pytest per spare GPU
declare -a load mine
for i in "${!spare[@]}"; do load[$i]=0; mine[$i]=""; done
for f in $(ls -S "${one[@]}"); do
    least=0
    for i in "${!spare[@]}"; do [ "${load[$i]}" -lt "${load[$least]}" ] && least=$i; done
    load[$least]=$(( load[least] + $(wc -c < "$f") ))
    mine[$least]+=" $f"
done
for i in "${!spare[@]}"; do
    [ -n "${mine[$i]}" ] && part "one-gpu-$i" "${spare[$i]}" ${mine[$i]} &
done
wait
[ "$NGPU" -ge 2 ] && [ "$NGPU" -lt 4 ] && part two-gpu 0,1 $TWO
grep -hE "^(FAILED|ERROR)|^=+ .*(passed|failed|error|skipped)" "$OUT"/*.log
! grep -v "exit 0$" "$OUT/status.txt" > /dev/null  # the exit status: 0 when every part passed
