#!/usr/bin/env bash
# docs/convergence.md: GPT-2 124M, STEPS steps (same seed, data and batch) in BF16 and in each
# Hopper FP8 recipe (delayed, current, block) on ~100 MB of real Python source (the GPU image's
# site-packages). With 4 GPUs each run has its own; with fewer the runs share them (convergence is
# compared, not speed). SEEDS runs each recipe once per seed (all runs at once).
# Usage: OUT=conv_out STEPS=2000 SEEDS="1337 1 2" scripts/convergence.sh
# RUN_TIMEOUT=SECONDS stops each run after that long (its logged validations are kept);
# VAL_EVERY=STEPS validates every STEPS steps (default 250).
# Outputs: $OUT/<run>-s<seed>.log (console), $OUT/tb-<run>-s<seed>/ (TensorBoard events), per seed
# $OUT/convergence-s<seed>.png and the table of `python -m fp8_lightning compare`, then
# scripts/convergence_summary.py's mean and spread of each recipe's final val loss over the seeds.
set -eu
cd "$(dirname "$0")/.."
OUT=${OUT:-conv_out}
STEPS=${STEPS:-2000}
SEEDS=${SEEDS:-1337}
PYTHON=${PYTHON:-python}
. scripts/py_data.sh
mkdir -p "$OUT"
NGPU=$($PYTHON -c "import torch; print(max(1, torch.cuda.device_count()))")
common=(--data.data_dir "$DATA" --data.batch_size 8 --data.num_workers 2
        --trainer.max_steps "$STEPS" --trainer.val_check_interval "${VAL_EVERY:-250}" --trainer.limit_val_batches 40
        --trainer.log_every_n_steps 25 --trainer.enable_progress_bar false --model.warmup_steps 100
        --trainer.callbacks.init_args.every_n_train_steps 1000000)  # the configs' last callback,
        # Checkpoint: no periodic saves (1.5 GB each at 124M; a dozen runs would fill the disk)
fp8() {  # fp8 RECIPE: the gpt2_fp8 config with only the recipe changed (its defaults otherwise)
    echo --trainer.plugins.init_args.recipe "$1"
}
run() {  # run GPU NAME CONFIG ARGS...
    local gpu=$(($1 % NGPU)) name=$2 cfg=$3
    shift 3
    CUDA_VISIBLE_DEVICES=$gpu timeout -k 60 "${RUN_TIMEOUT:-0}" $PYTHON -m fp8_lightning fit --config "$cfg" "${common[@]}" --trainer.default_root_dir "$OUT/$name" \
        "$@" > "$OUT/$name.log" 2>&1
    echo "$name: exit $?"
}
RECIPES=${RECIPES:-"bf16 fp8-delayed fp8-current fp8-block"}  # also: fp8-tensorwise fp8-rowwise
# (torchao), fp8-delayed-fp32res (the residual stream in float32, as the torch baseline),
# fp8-delayed-recent (delayed scaling from the last step's amax alone, bench's -recent: the
# config as shipped); fp8-delayed is TE's default history (the maximum over 1,024 steps)
recipe_args() {  # recipe_args NAME: config and overrides of one recipe
    case $1 in
        bf16)           echo configs/gpt2_bf16.yaml ;;
        fp8-delayed)    echo configs/gpt2_fp8.yaml $(fp8 delayed) ;;  # TE's 1,024-step amax history
        fp8-delayed-fp32res) echo configs/gpt2_fp8.yaml $(fp8 delayed) --model.config.fp32_residual true ;;
        # JSON without spaces: recipe_args' output is split on whitespace
        fp8-delayed-recent) echo configs/gpt2_fp8.yaml \
            $(fp8 '{"name":"delayed","amax_history_len":1,"amax_compute_algo":"most_recent"}') ;;
        fp8-tensorwise|fp8-rowwise) echo configs/gpt2_fp8.yaml $(fp8 "${1#fp8-}") --model.attention sdpa ;;
        fp8-*)          echo configs/gpt2_fp8.yaml $(fp8 "${1#fp8-}") ;;
    esac
}
i=0
runs=()
for seed in $SEEDS; do
    for recipe in $RECIPES; do
        # shellcheck disable=SC2046  # recipe_args is split on purpose
        run $i "$recipe-s$seed" $(recipe_args "$recipe") --seed_everything "$seed" &
        runs+=("$recipe-s$seed")
        i=$((i + 1))
    done
done
wait
for name in "${runs[@]}"; do
    grep -E "precision:|FP8 verified|NaN guard|Error|error" "$OUT/$name.log" | head -5 | sed "s/^/$name: /"
done
# Checkpoints are large; the logs are what the docs need. Event files are copied flat beside the
# console logs for `python -m fp8_lightning compare`.
find "$OUT" -name "*.ckpt" -delete
for name in "${runs[@]}"; do
    mkdir -p "$OUT/tb-$name"
    cp "$(find "$OUT/$name" -name 'events.out.tfevents.*' | head -1)" "$OUT/tb-$name/" || true
done
for seed in $SEEDS; do
    these=()
    for recipe in $RECIPES; do these+=("$recipe-s$seed"); done
    $PYTHON -m fp8_lightning compare "${these[@]/#/$OUT/tb-}" --labels "${these[@]}" \
        --output "$OUT/convergence-s$seed.png"
done
$PYTHON scripts/convergence_summary.py "$OUT"
# One archive of the logs and event files, to carry off the machine in one piece;
# the globs expand inside $OUT's parent, not here.
(cd "$(dirname "$OUT")" && tar czf "$(basename "$OUT").tgz" "$(basename "$OUT")"/tb-* "$(basename "$OUT")"/*.log)
