"""Diagnostic (GPU): run-to-run spread vs FP8 resume drift, printed per step."""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import test_gpu as t  # noqa: E402
from fp8_lightning.fp8 import FP8Precision  # noqa: E402

tmp = Path("/tmp/diag")
tok = t.tokens.__wrapped__() if hasattr(t.tokens, "__wrapped__") else None
ids = torch.tensor(t.get_tokenizer("gpt2").encode(t.EMBEDDED_CORPUS.read_text()[:400_000]))
n = ids.numel() // (t.T + 1)
tokens = ids[: n * (t.T + 1)].view(n, t.T + 1)
_, a = t.fit(tmp / "a", tokens, 40, FP8Precision())
_, a2 = t.fit(tmp / "a2", tokens, 40, FP8Precision())
_, b16 = t.fit(tmp / "b16", tokens, 40, "bf16-mixed")
_, b16b = t.fit(tmp / "b16b", tokens, 40, "bf16-mixed")
t.fit(tmp / "b", tokens, 20, FP8Precision())
_, r = t.fit(tmp / "c", tokens, 40, FP8Precision(), ckpt_path=tmp / "b" / "step20.ckpt")
for s in range(21, 41):
    print(f"step {s}: fp8 {a[s]:.4f} fp8-again {a2[s]:.4f} resumed {r[s]:.4f} | "
          f"bf16 {b16[s]:.4f} bf16-again {b16b[s]:.4f}")
