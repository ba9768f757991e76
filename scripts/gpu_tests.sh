#!/usr/bin/env bash
# The GPU suite (`python -m pytest -m gpu`) spread over this machine's GPUs, for a machine whose
# commands are time-limited: one pytest per test file, the one-GPU files taken from a queue
# (largest first) by a worker per GPU, so no GPU idles while files wait. With four GPUs or more
# the two-GPU file (tests/test_gpu_ddp.py) runs first on GPUs 0,1 and their workers join after
# it; with two or three, the workers empty the queue and then the two-GPU file runs.
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
[ "$NGPU" -ge 1 ] 2>/dev/null || { echo "no CUDA GPU"; exit 2; }
ARGS=("$@")

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

QUEUE=$OUT/queue.txt
ls -S $FILES > "$QUEUE"  # a file's size stands for its run time
take() {  # the next file of the queue, removed from it ("" when empty)
    (flock 9; head -1 "$QUEUE"; sed -i 1d "$QUEUE") 9> "$OUT/queue.lock"
}
worker() {  # worker GPU: one-GPU files from the queue on GPU until it is empty
    local f
    while f=$(take) && [ -n "$f" ]; do part "$(basename "$f" .py)" "$1" "$f"; done
}

if [ "$NGPU" -ge 4 ]; then
    (part two-gpu 0,1 $TWO; worker 0 & worker 1 & wait) &
    for g in $(seq 2 $((NGPU - 1))); do worker "$g" & done
    wait
else
    for g in $(seq 0 $((NGPU - 1))); do worker "$g" & done
    wait
    [ "$NGPU" -ge 2 ] && part two-gpu 0,1 $TWO
fi
grep -hE "^(FAILED|ERROR)|^=+ .*(passed|failed|error|skipped)" "$OUT"/*.log
! grep -v "exit 0$" "$OUT/status.txt" > /dev/null  # the exit status: 0 when every part passed
