# Sourced by convergence.sh and multi_gpu.sh: prepare ~100 MB of real Python source from the GPU
# image's site-packages (16 files, sorted path order) as GPT-2 BPE litdata shards in $DATA, once.
DATA=${DATA:-/tmp/pycode-ds}
if [ ! -f "$DATA/meta.json" ]; then
    SRC=$($PYTHON -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
    $PYTHON scripts/py_corpus.py "$SRC" /tmp/pycode-txt --max_mb "${MAX_MB:-100}" --files 16
    $PYTHON -m fp8_lightning prepare --inputs '/tmp/pycode-txt/*.txt' --output_dir "$DATA" \
        --seq_len 1024 --val_fraction 0.005 --num_workers 16 2>&1 | grep -v "^INFO litdata" | tail -3
fi
