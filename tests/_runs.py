"""Short quickstart fits through the CLI, run once per test session and shared by the monitor,
generate and compare tests (each CLI fit costs tens of seconds on a small CPU)."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STEPS = 10
_RUNS: dict = {}


def run_cli(*args, timeout=600):
    return subprocess.run([sys.executable, "-m", "fp8_lightning", *args], cwd=ROOT, text=True,
                          capture_output=True, timeout=timeout)


def short_fit(tmp_path_factory, name, *overrides):
    """(run dir, CompletedProcess) of a 10-step quickstart fit: lines at steps 5 and 10, one
    validation (2 batches) with a text sample at step 10, last.ckpt."""
    if name not in _RUNS:
        out = tmp_path_factory.mktemp(name)
        result = run_cli("fit", "--config", "configs/quickstart.yaml",
                         "--trainer.max_steps", str(STEPS), "--trainer.val_check_interval", str(STEPS),
                         "--trainer.log_every_n_steps", "5", "--trainer.limit_val_batches", "2",
                         "--trainer.default_root_dir", str(out), *overrides)
        assert result.returncode == 0, result.stderr[-3000:]
        _RUNS[name] = (out, result)
    return _RUNS[name]
