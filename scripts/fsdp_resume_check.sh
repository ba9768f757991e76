#!/usr/bin/env bash
# Two GPUs, FSDP2, FP8 delayed: sharded checkpoints, an exact resume from one, consolidate and
# generate on one GPU, and a crafted sharded checkpoint refused without running its payload.
# Usage (GPU machine with >= 2 GPUs): OUT=/tmp/out scripts/fsdp_resume_check.sh
set -uo pipefail
OUT=${OUT:-/tmp/fsdp-check}; R=$OUT/run; mkdir -p "$OUT"
export FP8L_CACHE=${FP8L_CACHE:-$OUT/cache}
args=(--config configs/gpt2_fp8.yaml --config configs/fsdp.yaml --trainer.devices 2
      --model.config.n_layer 4 --data.batch_size 4 --trainer.max_steps 20
      --trainer.val_check_interval 20 --trainer.limit_val_batches 2 --trainer.log_every_n_steps 10
      --trainer.callbacks.every_n_train_steps 10 --trainer.callbacks.keep_last 2
      --trainer.default_root_dir "$R")
show() { grep -E "^step|error:|resumed|restored|precision:|Traceback" "$1" | cut -c1-200; }
python3 -m fp8_lightning fit "${args[@]}" > "$OUT/full.log" 2>&1; echo "full run rc=$?"; show "$OUT/full.log"
python3 -m fp8_lightning fit "${args[@]}" --ckpt_path "$R/checkpoints/step-0000010.ckpt" \
    --trainer.default_root_dir "$OUT/resumed" > "$OUT/resume.log" 2>&1; echo "resume rc=$?"; show "$OUT/resume.log"
python3 -m fp8_lightning consolidate "$R/checkpoints/last.ckpt" "$OUT/one.ckpt" 2>&1 | tail -1
python3 -m fp8_lightning generate --ckpt "$OUT/one.ckpt" --prompt "ROMEO:" --max_new_tokens 8 2>&1 | tail -1
cp -r "$R/checkpoints/step-0000010.ckpt" "$OUT/crafted.ckpt"
python3 - "$OUT" <<'PY'
import os, pickle, sys
class P:
    def __reduce__(self): return os.system, (f"touch {sys.argv[1]}/PWNED",)
open(f"{sys.argv[1]}/crafted.ckpt/.metadata", "wb").write(pickle.dumps(P()))
PY
python3 -m fp8_lightning fit "${args[@]}" --ckpt_path "$OUT/crafted.ckpt" > "$OUT/crafted.log" 2>&1
echo "crafted rc=$? (2 expected); payload ran: $([ -e "$OUT/PWNED" ] && echo YES || echo no)"; grep "error:" "$OUT/crafted.log"
