#!/usr/bin/env bash
# The GPU suite (`python -m pytest -m gpu`) spread over this machine's GPUs, for a machine whose
# commands are time-limited. Two queues: the two-GPU tests (each test function of
# tests/test_gpu_ddp.py, its parametrizations together) and the one-GPU test files (largest
# first). Each pair of GPUs (0,1; 2,3; ...) takes two-GPU tests until none is left, then each of
# its GPUs takes one-GPU files, as does a GPU without a pair, so no GPU idles while work waits.
# One pytest per item, its log under OUT.
#
# Usage: scripts/gpu_tests.sh [PYTEST ARGS...]   e.g. scripts/gpu_tests.sh -k "not within_3_percent"
# Env: OUT (logs, default gpu_tests_out), PART_TIMEOUT (s per pytest, default 540), DEADLINE (s:
# no item starts after it; those left are listed in OUT/left.txt, for a next run's FILES and
# TWO_TESTS), FILES (the one-GPU test files; default every tests/test_gpu_*.py but the two-GPU
# one, and the notebook's), TWO_TESTS (the two-GPU node ids; default each test function of
# tests/test_gpu_ddp.py), FP8L_RUN_TIMEOUT (s, default 300: a CLI fit inside a test that runs
# longer prints every process's Python stacks and fails, tests/_runs.py). Each pytest runs
# verbosely with its durations; the failures and the counts last.
# Where one command cannot run the whole suite, give the first a DEADLINE, the next FILES and
# TWO_TESTS from its left.txt.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_tests_out}
PYTHON=${PYTHON:-$(command -v python || command -v python3)}
export FP8L_RUN_TIMEOUT=${FP8L_RUN_TIMEOUT:-300}
mkdir -p "$OUT"
rm -f "$OUT/status.txt" "$OUT/left.txt"
TWO=tests/test_gpu_ddp.py
FILES=${FILES:-$(ls tests/test_gpu.py tests/test_gpu_*.py tests/test_notebook.py | grep -v "^$TWO$")}
TWO_TESTS=${TWO_TESTS:-$(grep -oE "^def test_[A-Za-z0-9_]+" $TWO | sed "s|^def |$TWO::|")}
NGPU=$($PYTHON -c "import torch; print(torch.cuda.device_count())")
[ "$NGPU" -ge 1 ] 2>/dev/null || { echo "no CUDA GPU"; exit 2; }
ARGS=("$@")

part() {  # part NAME GPUS PYTEST_ARGS...: one pytest on GPUS, its log under OUT
    local name=$1 gpus=$2
    shift 2
    # -k 10: a fit inside a test installs Lightning's SIGTERM handler, which would outlive the
    # plain SIGTERM of the timeout
    CUDA_VISIBLE_DEVICES=$gpus timeout -k 10 "${PART_TIMEOUT:-540}" $PYTHON -m pytest -m gpu -v -rs \
        --durations=15 -p no:cacheprovider "$@" "${ARGS[@]}" > "$OUT/$name.log" 2>&1
    local rc=$?
    [ $rc -eq 5 ] && rc=0  # pytest's "nothing collected": a file skipped whole (the notebook's without its extras)
    echo "=== $name (GPUs $gpus): exit $rc" | tee -a "$OUT/status.txt"
}

# (FILES or TWO_TESTS " ": none of them)
: > "$OUT/one.txt"
[ -n "${FILES// }" ] && ls -S $FILES > "$OUT/one.txt"  # a file's size stands for its run time
for t in $TWO_TESTS; do echo "$t"; done > "$OUT/two.txt"
[ "$NGPU" -ge 2 ] || : > "$OUT/two.txt"  # (they skip with one GPU)
take() {  # take QUEUE: its next item, removed from it ("" when empty or past DEADLINE)
    [ -n "${DEADLINE:-}" ] && [ "$SECONDS" -ge "$DEADLINE" ] && return
    (flock 9; head -1 "$OUT/$1.txt"; sed -i 1d "$OUT/$1.txt") 9> "$OUT/$1.lock"
}
worker() {  # worker GPU: one-GPU files on GPU until none is left
    local f
    while f=$(take one) && [ -n "$f" ]; do part "$(basename "$f" .py)" "$1" "$f"; done
}
pair() {  # pair A B: two-GPU tests on A,B until none is left, then a worker on each
    local t
    while t=$(take two) && [ -n "$t" ]; do part "two-gpu-${t##*::test_}" "$1,$2" "$t"; done
    worker "$1" & worker "$2" & wait
}

g=0
while [ $((g + 1)) -lt "$NGPU" ]; do pair $g $((g + 1)) & g=$((g + 2)); done
[ "$g" -lt "$NGPU" ] && worker $g &
wait
cat "$OUT/two.txt" "$OUT/one.txt" > "$OUT/left.txt"
[ -s "$OUT/left.txt" ] && { echo "not run (DEADLINE):"; cat "$OUT/left.txt"; }
grep -hE "^(FAILED|ERROR)|^=+ .*(passed|failed|error|skipped)" "$OUT"/*.log
! grep -v "exit 0$" "$OUT/status.txt" > /dev/null && [ ! -s "$OUT/left.txt" ]  # 0: all ran and passed
