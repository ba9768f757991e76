from pathlib import Path

import pytest
from _runs import run_cli, short_fit

from fp8_lightning import monitor as M
from fp8_lightning.compare import Run, compare, format_table, summary

PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    a, _ = short_fit(tmp_path_factory, "run_a")
    b, _ = short_fit(tmp_path_factory, "run_b", "--model.learning_rate", "1.0e-3")
    return a, b


def test_compare_writes_png_and_table(two_runs, tmp_path):
    a, b = two_runs
    rows, png = compare([str(a), str(b)], str(tmp_path / "cmp.png"), labels=["fast", "slow"])
    assert png.read_bytes()[:8] == PNG and png.stat().st_size > 10_000
    assert [r["run"] for r in rows] == ["fast", "slow"]
    assert rows[0]["speedup"] == pytest.approx(1.0) and rows[0]["val gap"] == 0
    assert rows[1]["val gap"] == pytest.approx(rows[1]["final val loss"] / rows[0]["final val loss"] - 1)
    for row in rows:
        assert row["precision"] in ("BF16 (fallback)", "FP32 (fallback)")  # this machine's
        assert 5 < row["final loss"] < 11.5 and row["min loss"] <= row["final loss"]
        assert row["final val loss"] > 0 and row["mean tok/s"] > 0 and row["speedup"] > 0
    table = format_table(rows)
    assert "speedup" in table.splitlines()[0] and "1.00x" in table.splitlines()[2]


def test_compare_command(two_runs, tmp_path):
    a, b = two_runs
    out = tmp_path / "plots" / "fp8_vs_bf16.png"
    # a run's default_root_dir or its version folder both work
    version = next(Path(b).rglob("version_*"))
    result = run_cli("compare", str(a), str(version), "--output", str(out))
    assert result.returncode == 0, result.stderr[-2000:]
    assert out.read_bytes()[:8] == PNG
    header, rule, first, second = result.stdout.splitlines()[:4]
    for column in ("run", "precision", "final loss", "min loss", "final val loss", "val gap",
                   "mean tok/s", "speedup"):
        assert column in header
    assert first.startswith(str(a)) and first.rstrip().endswith("1.00x")
    assert second.startswith(str(version))
    assert f"plot: {out}" in result.stdout


def test_compare_missing_run_is_one_error(tmp_path):
    result = run_cli("compare", str(tmp_path / "nope"))
    assert result.returncode == 2 and "error: run directory" in result.stderr
    (tmp_path / "empty").mkdir()
    result = run_cli("compare", str(tmp_path / "empty"))
    assert result.returncode == 2 and "no TensorBoard event files" in result.stderr


def test_summary_arithmetic_without_tensorboard():
    def run(label, tps, loss):
        r = Run(label, Path("."))
        r.scalars = {M.TOKENS_PER_SEC: list(enumerate(tps)), M.TRAIN_LOSS: list(enumerate(loss)),
                     M.TOKENS_SEEN: [(0, 100.0), (1, 200.0)]}
        return r

    bf16 = run("bf16", [50.0, 100.0, 100.0], [5.0, 4.0, 4.5])  # first point: warm-up, left out
    fp8 = run("fp8", [10.0, 150.0, 170.0], [5.0, 4.2, 4.1])
    rows = summary([bf16, fp8])
    assert rows[0]["mean tok/s"] == 100.0 and rows[1]["mean tok/s"] == 160.0
    assert rows[1]["speedup"] == pytest.approx(1.6)
    assert rows[0]["final loss"] == 4.5 and rows[0]["min loss"] == 4.0
    assert rows[0]["final val loss"] is None and rows[0]["val gap"] is None
    bf16.scalars[M.VAL_LOSS] = [(1, 4.0)]
    fp8.scalars[M.VAL_LOSS] = [(1, 4.1)]
    rows = summary([bf16, fp8])
    assert rows[1]["val gap"] == pytest.approx(0.025)
    assert "+2.50%" in format_table(rows).splitlines()[3]
    assert bf16.tokens_at([0, 1, 3]) == [100.0, 200.0, 400.0]  # extrapolated past the last point
