"""``notebooks/fp8_exploration.ipynb`` runs top to bottom, headless, and is committed without outputs."""

import math
import os
import re
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat", reason="the notebook tests need the dev extras (nbformat, nbclient, ipykernel)")

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "notebooks" / "fp8_exploration.ipynb"
# Small sizes for a 2-core CPU (the notebook's own defaults take minutes).
FAST = dict(STEPS=6, BATCH_SIZE=2, LOG_EVERY=3, VAL_EVERY=6)


def run_notebook(run_dir: Path, **parameters) -> dict[str, str]:
    """Execute the notebook as Jupyter would (kernel cwd: notebooks/) with the parameters cell's
    values replaced; returns each code cell's text output (stdout, stderr, text/plain) by index.

    The runs and a fresh data cache go under ``run_dir``: the first training run prepares the
    corpus, the second finds it (and must still start from the same weights)."""
    from nbclient import NotebookClient

    nb = nbformat.read(NOTEBOOK, as_version=4)
    (cell,) = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
    values = dict(parameters, RUN_DIR=str(run_dir))
    lines = cell.source.splitlines()
    for key, value in values.items():
        (i,) = [i for i, line in enumerate(lines) if line.startswith(f"{key} =")]
        lines[i] = f"{key} = {value!r}"
    cell.source = "\n".join(lines)
    # The kernel is the venv's python3 (ipykernel); it imports this checkout's package.
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    env = dict(os.environ, PYTHONPATH=path, FP8L_CACHE=str(run_dir / "cache"),
               MPLBACKEND="module://matplotlib_inline.backend_inline")
    client = NotebookClient(nb, kernel_name="python3", timeout=600,
                            resources={"metadata": {"path": str(NOTEBOOK.parent)}})
    client.execute(env=env)
    texts = {}
    for index, c in enumerate(nb.cells):
        if c.cell_type != "code":
            continue
        parts = []
        for out in c.outputs:
            if out.output_type == "stream":
                parts.append(out.text)
            elif "data" in out:
                parts.append(out.data.get("text/plain", ""))
                if "image/png" in out.data:
                    parts.append("<image/png>")
        texts[index] = "".join(parts)
    return texts


def test_committed_notebook_has_no_outputs():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(nb)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code and all(c.outputs == [] and c.execution_count is None for c in code)
    assert nb.metadata["kernelspec"]["name"] == "python3"


@pytest.fixture(scope="module")
def cpu_outputs(tmp_path_factory):
    return "\n".join(run_notebook(tmp_path_factory.mktemp("notebook"), **FAST).values())


def test_fp8_formats_are_computed_live(cpu_outputs):
    out = cpu_outputs
    assert re.search(r"FP8 E4M3\s+0\.4062500000", out), out[:3000]  # 0.3952 rounds to 0.40625
    assert re.search(r"FP8 E5M2\s+0\.3750000000", out)
    assert re.search(r"BF16\s+0\.3945312500", out)
    assert "FP8 E4M3: 254 finite values, 0 infinities, 2 NaN codes" in out
    # a 1e-4 gradient vanishes in E4M3 unscaled and survives with a per-tensor scale
    assert re.search(r"FP8 E4M3\s+none\s+1\s+100\.0%", out)
    assert re.search(r"FP8 E4M3\s+per-tensor \(amax\)\s+\S+\s+0\.0%\s+0\.0%", out)
    assert "<image/png>" in out  # the amax-history plot


def test_training_states_what_ran_and_the_loss_is_finite(cpu_outputs):
    out = cpu_outputs
    from fp8_lightning.te_availability import fallback_precision, te_status

    ok, reason = te_status()
    precision, why = fallback_precision()
    tag = "BF16" if precision == "bf16-mixed" else "FP32"
    if ok:
        assert "requested FP8 delayed; ran FP8 delayed" in out
    else:  # the plugin's own fallback reason, verbatim
        assert f"requested FP8 delayed; ran {tag} (fallback: {reason}; {why})" in out
        assert f"The FP8 run fell back to {tag} ({reason}; {why})" in out
        assert "scaling: none: this model has no TransformerEngine modules" in out
        # the fallback is the very baseline computation: same seed, same data, the same losses
        assert "largest train-loss gap at a log point: 0.0000" in out
    assert f"Baseline run: ran {precision} ({why})" in out
    lines = re.findall(r"^step (\d+) \| loss (\S+) \|", out, flags=re.M)
    assert [int(s) for s, _ in lines] == [3, 6, 3, 6]  # two runs, a line every 3 steps
    assert all(math.isfinite(float(loss)) and 0 < float(loss) < 12 for _, loss in lines)
    assert re.search(rf"^FP8 run\s+\| {tag} \(fallback\)", out, flags=re.M) or ok
    assert "history: [{'event':" in out  # the plugin's state as it goes into checkpoints


def test_doctor_explains_fp8_needs_a_gpu(cpu_outputs):
    from fp8_lightning.te_availability import te_status

    if te_status()[0]:
        pytest.skip("FP8 machine: the GPU test covers the probe")
    assert "FP8 needs an NVIDIA GPU with compute capability >= 8.9" in cpu_outputs
    assert "doctor exit status: 1" in cpu_outputs


@pytest.mark.gpu
def test_notebook_on_an_fp8_gpu_trains_fp8_and_shows_scaling(tmp_path):
    pytest.importorskip("nbclient", reason="the GPU machine needs the dev extras: pip install -e '.[dev]'")
    pytest.importorskip("ipykernel", reason="the GPU machine needs the dev extras: pip install -e '.[dev]'")
    outputs = run_notebook(tmp_path, STEPS=20, BATCH_SIZE=8, LOG_EVERY=5, VAL_EVERY=20)
    out = "\n".join(outputs.values())
    print(out[-6000:])
    assert "requested FP8 delayed; ran FP8 delayed" in out
    assert "FP8 verified:" in out
    assert "TE modules hold delayed-scaling state" in out
    assert "The FP8 run ran FP8 delayed" in out
    assert "predicted step speedup of FP8 over te-bf16" in out
    assert "doctor exit status: 0" in out
