#!/usr/bin/env bash
# docs/convergence.md: GPT-2 124M, STEPS steps (same seed, data and batch) in BF16 and in each
# Hopper FP8 recipe (delayed, current, block) on ~100 MB of real Python source (the GPU image's
# site-packages). The four runs share one GPU concurrently (convergence is compared, not speed).
# Usage: OUT=conv_out STEPS=2000 scripts/convergence.sh      Outputs: $OUT/<run>/ (TB logs).
set -eu
cd "$(dirname "$0")/.."
OUT=${OUT:-conv_out}
STEPS=${STEPS:-2000}
PYTHON=${PYTHON:-python}
DATA=${DATA:-/tmp/pycode-ds}
mkdir -p "$OUT"
if [ ! -f "$DATA/meta.json" ]; then
    SRC=$($PYTHON -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
    $PYTHON scripts/py_corpus.py "$SRC" /tmp/pycode-txt --max_mb "${MAX_MB:-100}" --files 16
    $PYTHON -m fp8_lightning prepare --inputs '/tmp/pycode-txt/*.txt' --output_dir "$DATA" \
        --seq_len 1024 --val_fraction 0.005 --num_workers 16 2>&1 | grep -v "^INFO litdata" | tail -3
fi
common=(--data.data_dir "$DATA" --data.batch_size 8 --data.num_workers 2
        --trainer.max_steps "$STEPS" --trainer.val_check_interval 250 --trainer.limit_val_batches 40
        --trainer.log_every_n_steps 25 --trainer.enable_progress_bar false --model.warmup_steps 100)
fp8() {  # fp8 RECIPE: the gpt2_fp8 config with only the recipe changed (its defaults otherwise)
    echo --trainer.plugins.init_args.recipe "$1" --trainer.plugins.init_args.fp8_format null \
         --trainer.plugins.init_args.amax_history_len null --trainer.plugins.init_args.amax_compute_algo null
}
run() {  # run NAME CONFIG ARGS...
    local name=$1 cfg=$2
    shift 2
    $PYTHON -m fp8_lightning fit --config "$cfg" "${common[@]}" --trainer.default_root_dir "$OUT/$name" \
        "$@" > "$OUT/$name.log" 2>&1
    echo "$name: exit $?"
}
run bf16 configs/gpt2_bf16.yaml &
run fp8-delayed configs/gpt2_fp8.yaml &
run fp8-current configs/gpt2_fp8.yaml $(fp8 current) &
run fp8-block configs/gpt2_fp8.yaml $(fp8 block) &
wait
for name in bf16 fp8-delayed fp8-current fp8-block; do
    grep -E "precision:|FP8 verified|NaN guard|Error|error" "$OUT/$name.log" | head -5 | sed "s/^/$name: /"
done
# Checkpoints are large; the logs are what the docs need. Event files are copied flat beside the
# console logs (the device returns only shallow paths) for `python -m fp8_lightning compare`.
find "$OUT" -name "*.ckpt" -delete
for name in bf16 fp8-delayed fp8-current fp8-block; do
    mkdir -p "$OUT/tb-$name"
    cp "$(find "$OUT/$name" -name 'events.out.tfevents.*' | head -1)" "$OUT/tb-$name/" || true
done
$PYTHON scripts/convergence_plot.py "$OUT/convergence.png" "$OUT"/bf16.log "$OUT"/fp8-delayed.log \
    "$OUT"/fp8-current.log "$OUT"/fp8-block.log
