# Sourced by convergence.sh: prepare ~100 MB of real Python source from the GPU
# image's site-packages (16 files, sorted path order) as GPT-2 BPE litdata shards in $DATA, once.
# pycode_prepare DIR SEQ_LEN WORKERS cuts the same text in other block sizes (8192 for the Llama
# runs); it fails if DIR could not be prepared. With PY_DATA_DEFER set, sourcing only defines it.
# The benchmark harness (benchmarks/jobs.py, Builder.data) prepares its corpora the same way.
DATA=${DATA:-/tmp/pycode-ds}
pycode_prepare() {
    local dir=$1 seq_len=$2 workers=$3
    [ -f "$dir/meta.json" ] && return
    if ! ls /tmp/pycode-txt/*.txt > /dev/null 2>&1; then  # the text, once per machine
        $PYTHON scripts/py_corpus.py "$($PYTHON -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")" \
            /tmp/pycode-txt --max_mb "${MAX_MB:-100}" --files 16
    fi
    $PYTHON -m fp8_lightning prepare --inputs '/tmp/pycode-txt/*.txt' --output_dir "$dir" \
        --seq_len "$seq_len" --val_fraction 0.005 --num_workers "$workers" 2>&1 \
        | grep -v "^INFO litdata" | tail -3
    [ -f "$dir/meta.json" ]
}
[ -n "${PY_DATA_DEFER:-}" ] || pycode_prepare "$DATA" 1024 16  # deferred: the caller prepares
