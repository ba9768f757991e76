import re
import sys
from pathlib import Path

import pytest

from fp8_lightning import logs
from fp8_lightning.cli import main
from fp8_lightning.commands.compare import Run, compare, format_table, read_run, summary
from tests._runs import run_main
from tests.helpers import LINE, logged_fit

PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    """A TensorBoardLogger run and a CSVLogger run (in process, GPT-2's vocabulary), and the loss
    of each one's last console line."""
    tb, csv_root = tmp_path_factory.mktemp("tb_run"), tmp_path_factory.mktemp("csv_run")
    tb_monitor, _ = logged_fit(tb, logger="tensorboard")
    csv_monitor, _ = logged_fit(csv_root)
    return tb, csv_root, LINE.match(tb_monitor.lines[-1])["loss"], \
        LINE.match(csv_monitor.lines[-1])["loss"]


def test_compare_reads_tensorboard_and_csv_runs(two_runs, tmp_path, capsys):
    tb, csv_run, tb_loss, csv_loss = two_runs
    rows, png = compare([str(tb), str(csv_run)], str(tmp_path / "cmp.png"), labels=["tb", "csv"])
    assert png.read_bytes()[:8] == PNG and png.stat().st_size > 10_000
    assert [r["run"] for r in rows] == ["tb", "csv"]
    assert rows[0]["speedup"] == pytest.approx(1.0) and rows[0]["val gap"] == 0
    assert rows[1]["val gap"] == pytest.approx(rows[1]["final val loss"] / rows[0]["final val loss"] - 1)
    for row in rows:
        assert row["precision"] in ("BF16 (fallback)", "FP32 (fallback)")  # this machine's
        assert 5 < row["final loss"] < 11.5 and row["min loss"] <= row["final loss"]
        assert row["final val loss"] > 0 and row["tok/s"] > 0 and row["speedup"] > 0
    # the final loss is the console's last line (its window mean), from either kind of log
    assert [f"{r['final loss']:.4f}" for r in rows] == [tb_loss, csv_loss]
    out = capsys.readouterr().out
    table = format_table(rows)
    assert out.startswith(table) and "speedup" in table.splitlines()[0]
    assert table.splitlines()[2].endswith("1.00x")
    assert "final/min loss: the console line's loss" in out and f"plot: {png}" in out


def test_compare_command(two_runs, tmp_path, capsys):
    """(In this process: the command's parsing and output are under test, not Python's start-up.)"""
    tb, csv_run, _, _ = two_runs
    out = tmp_path / "plots" / "fp8_vs_bf16.png"
    # a run's default_root_dir or its version folder both work; --labels takes several values
    version = next(Path(csv_run).rglob("version_*"))
    code, stdout, err = run_main(capsys, ["compare", tb, version, "--output", out, "--labels", "a",
                                          "b"])
    assert code == 0, err[-2000:]
    assert out.read_bytes()[:8] == PNG
    header, rule, first, second = stdout.splitlines()[:4]
    for column in ("run", "precision", "final loss", "min loss", "final val loss", "val gap",
                   "tok/s", "speedup"):
        assert column in header
    assert first.startswith("a ") and first.rstrip().endswith("1.00x")
    # the CSV run has one window after warm-up: no spread to judge noise by
    assert second.startswith("b ") and second.endswith("(too few windows to judge noise)")
    assert f"plot: {out}" in stdout


def test_compare_missing_run_is_one_error(tmp_path, capsys):
    for argv, expected in (([str(tmp_path / "nope")], "error: run directory"),
                           ([str(tmp_path)], "no TensorBoard event files under")):
        with pytest.raises(SystemExit) as exit_info:
            main(["compare", *argv])
        err = capsys.readouterr().err
        assert exit_info.value.code == 2 and expected in err
    assert "metrics.csv" in err  # CSV runs are looked for too


def test_without_matplotlib_the_table_prints_with_a_note_and_succeeds(two_runs, tmp_path, capsys,
                                                                     monkeypatch):
    tb, _, _, _ = two_runs
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    main(["compare", str(tb), "--output", str(tmp_path / "x.png")])  # no SystemExit: status 0
    out, err = capsys.readouterr()
    assert out.splitlines()[0].startswith("run ") and "error" not in err
    assert out.strip().splitlines()[-1] == (
        'note: no plot: compare\'s plot needs matplotlib: pip install "fp8-lightning[plots]"')
    assert not (tmp_path / "x.png").exists()


def _run(label, tps, loss, paused=None, val=None):
    r = Run(label, Path("."))
    r.scalars = {logs.TOKENS_PER_SEC: list(enumerate(tps)), logs.TRAIN_LOSS_MEAN: list(enumerate(loss)),
                 logs.TOKENS_SEEN: [(0, 100.0), (1, 200.0)]}
    if paused is not None:
        r.scalars[logs.PAUSED] = list(enumerate(paused))
    if val is not None:
        r.scalars[logs.VAL_LOSS] = val
    return r


def test_summary_median_tok_s_noise_and_final_loss():
    # first window (warm-up) and paused ones (validation, checkpoint) left out of tok/s
    bf16 = _run("bf16", [5.0, 100, 102, 98, 101, 99, 20], [5.0, 4.0, 4.5, 4.4, 4.3, 4.2, 4.25],
                paused=[0, 0, 0, 0, 0, 0, 1])
    same = _run("same", [5.0, 103, 101, 104, 100, 102, 21], [5.0, 4.0, 4.5, 4.4, 4.3, 4.2, 4.25],
                paused=[0, 0, 0, 0, 0, 0, 1])
    fast = _run("fast", [5.0, 150, 151, 149, 152, 150, 30], [5.0, 4.2, 4.1, 4.0, 3.9, 3.8, 3.85],
                paused=[0, 0, 0, 0, 0, 0, 1])
    rows = summary([bf16, same, fast])
    assert [r["tok/s"] for r in rows] == [100.0, 102.0, 150.0]
    assert rows[1]["speedup"] == pytest.approx(1.02) and rows[2]["speedup"] == pytest.approx(1.5)
    # final loss: the last console line's (window mean); min: the lowest line
    assert rows[0]["final loss"] == 4.25 and rows[0]["min loss"] == 4.0
    assert rows[0]["final val loss"] is None and rows[0]["val gap"] is None
    lines = format_table(rows).splitlines()
    assert lines[2].endswith("| 1.00x")
    # the per-window spread of both runs (MAD-based, ~1.5% each) covers a 2% difference ...
    assert re.search(r"1\.02x: indistinguishable \(within noise ±\d\.\d%\)$", lines[3]), lines[3]
    # ... not a 50% one
    assert re.search(r"1\.50x \(noise ±\d\.\d%\)$", lines[4]), lines[4]
    bf16.scalars[logs.VAL_LOSS] = [(1, 4.0)]
    fast.scalars[logs.VAL_LOSS] = [(1, 4.1)]
    rows = summary([bf16, fast])
    assert rows[1]["val gap"] == pytest.approx(0.025)
    assert "+2.50%" in format_table(rows).splitlines()[3]
    assert bf16.tokens_at([0, 1, 3]) == [100.0, 200.0, 400.0]  # extrapolated past the last point


def test_logs_from_before_loss_mean_and_paused():
    """Older logs: the last logged micro-batch as the loss (said below the table), and the windows
    around each validation left out of tok/s."""
    old = _run("old", [5.0, 100, 100, 40, 100], [9.0] * 5, val=[(2, 4.0)])
    old.scalars[logs.TRAIN_LOSS] = old.scalars.pop(logs.TRAIN_LOSS_MEAN)
    old.scalars[logs.TRAIN_LOSS][-1] = (4, 8.5)
    (row,) = summary([old])
    assert row["final loss"] == 8.5 and row["tok/s"] == 100.0  # windows 2 and 3 left out
    from fp8_lightning.commands.compare import legend

    assert "all runs: the logged micro-batch" in legend([old])


def test_read_run_prefers_the_newest_version(two_runs):
    _, csv_run, _, _ = two_runs
    run = read_run(str(csv_run))
    assert run.log_dir.name == "version_0" and logs.TRAIN_LOSS_MEAN in run.scalars
    assert run.precision in ("BF16 (fallback)", "FP32 (fallback)")  # from text.jsonl


def test_a_resumed_run_reads_as_one_curve_and_a_fresh_start_as_itself(tmp_path):
    """``--ckpt_path last`` logs into a new version folder. A run's versions are one curve where
    each resumed the one before (from the step the newer one began); a version that started
    afresh is read alone. The logger's ``hp_metric`` at step 0 of every start does not count."""
    import os

    from torch.utils.tensorboard import SummaryWriter

    root = tmp_path / "run"

    def log(version, steps, loss):
        folder = root / "lightning_logs" / f"version_{version}"
        with SummaryWriter(str(folder)) as writer:
            writer.add_scalar("hp_metric", -1, 0)
            for step in steps:
                writer.add_scalar(logs.TRAIN_LOSS_MEAN, loss(step), step)
        for f in folder.iterdir():  # the order compare reads them in: by time written
            os.utime(f, (1_000_000 + version, 1_000_000 + version))

    log(0, range(10, 110, 10), lambda s: 10.0)  # stopped after step 100, its checkpoint at 80
    log(1, range(90, 210, 10), lambda s: 5.0)  # resumed from step 80: 90 and 100 run again
    run = read_run(str(root))
    assert run.series(logs.TRAIN_LOSS_MEAN) == [(s, 10.0) for s in range(10, 90, 10)] + \
        [(s, 5.0) for s in range(90, 210, 10)]
    assert run.note.endswith("2 logged runs, each resumed from the one before: read as one")

    log(2, range(10, 60, 10), lambda s: 7.0)  # a fresh start in the same root
    run = read_run(str(root))
    assert run.series(logs.TRAIN_LOSS_MEAN) == [(s, 7.0) for s in range(10, 60, 10)]
    assert "3 logged runs, using the newest (lightning_logs/version_2)" in run.note


def test_a_seed_band_of_bf16_runs_judges_each_other_run():
    """Runs logged as plain BF16 are the baseline's seeds; every other run gets one verdict line."""
    from fp8_lightning.commands.compare import seed_band

    def run(label, precision, val):
        r = _run(label, [5.0, 100, 100], [5.0, 4.0, 3.0], val=[(2, val)])
        r.precision = precision
        return r

    seeds = [run(f"bf16-s{i}", "BF16", v) for i, v in enumerate((2.3731, 2.3737, 2.3932))]
    inside, above, below = (run("delayed", "FP8 delayed", 2.3845), run("block", "FP8 block", 2.4170),
                            run("current", "FP8 current", 2.3600))
    band = seed_band([seeds[0], inside, *seeds[1:], above, below])
    assert band.runs == seeds and band.metric == "final val loss"
    assert band.verdict(inside) == ("verdict: delayed (FP8 delayed): final val loss 2.3845 is inside "
                                    "BF16's seed band 2.3731-2.3932 (3 runs), +0.19% from its mean")
    assert "is 0.99% above BF16's seed band 2.3731-2.3932" in band.verdict(above)
    assert "is 0.55% below (lower loss than) BF16's seed band" in band.verdict(below)
    # configs/gpt2_bf16.yaml's runs log the Trainer's own precision, bf16-mixed: seeds as well
    for seed in seeds:
        seed.precision = "bf16-mixed"
    assert seed_band([seeds[0], inside, *seeds[1:]]).runs == seeds
    # a run that fell back to BF16 is not a seed of the baseline; one BF16 run is no band
    assert seed_band([seeds[0], run("fell back", "BF16 (fallback)", 2.38), inside]) is None
    # without a validation everywhere, the console's final loss is what is judged
    del inside.scalars[logs.VAL_LOSS]
    assert seed_band([*seeds, inside]).metric == "final loss"


def test_runs_stopped_at_different_steps_are_judged_where_all_have_a_validation():
    """A run stopped early (its last validation at step 3) against seeds that went on to step 5:
    the band, the verdict and the val gap read step 3, not each run's own end, and a note says
    so; the table's final val loss stays each run's last."""
    from fp8_lightning.commands.compare import ends_apart, seed_band

    def run(label, precision, val):
        r = _run(label, [5.0, 100, 100], [5.0, 4.0, 3.0], val=val)
        r.precision = precision
        return r

    seeds = [run("bf16-s1", "BF16", [(1, 3.0), (3, 2.50), (5, 2.00)]),
             run("bf16-s2", "BF16", [(1, 3.1), (3, 2.60), (5, 2.10)])]
    stopped = run("fp8", "FP8 delayed", [(1, 3.0), (3, 2.55)])
    band = seed_band([*seeds, stopped])
    assert band.metric == "val loss at step 3" and band.values == [2.50, 2.60]
    assert band.verdict(stopped) == ("verdict: fp8 (FP8 delayed): val loss at step 3 2.5500 is "
                                     "inside BF16's seed band 2.5000-2.6000 (2 runs), +0.00% "
                                     "from its mean")
    rows = summary([seeds[0], stopped])
    assert rows[1]["final val loss"] == 2.55 and rows[1]["val gap"] == pytest.approx(0.02)
    assert ends_apart([seeds[0], stopped]) == (
        "note: the runs' last validations are at different steps (bf16-s1: 5, fp8: 3); the val "
        "gap and verdicts read step 3, the last validation every run has")
    # a run that never validated leaves the others' shared step as it is
    unvalidated = run("no-val", "FP8 delayed", [])
    del unvalidated.scalars[logs.VAL_LOSS]
    assert summary([seeds[0], stopped, unvalidated])[1]["val gap"] == pytest.approx(0.02)
    # runs that end together: their final validations, as before
    assert ends_apart(seeds) is None
    assert seed_band([*seeds, run("x", "FP8", [(5, 2.0)])]).metric == "final val loss"


@pytest.fixture(scope="module")
def seeds(tmp_path_factory):
    """Three tiny CPU runs of one config, seeds 1, 2 and 3 (logged by CSVLogger)."""
    import lightning as L

    roots = []
    for seed in (1, 2, 3):
        L.seed_everything(seed)
        roots.append(tmp_path_factory.mktemp(f"seed{seed}"))
        logged_fit(roots[-1])
    return roots


def test_compare_draws_the_baselines_seed_band_and_says_whether_a_run_is_inside(seeds, tmp_path,
                                                                                capsys):
    png = tmp_path / "band.png"
    main(["compare", *map(str, seeds), "--labels", "s1", "s2", "s3", "--baseline", "2",
          "--output", str(png)])
    out = capsys.readouterr().out
    runs = [read_run(str(root)) for root in seeds]
    finals = [r.series(logs.VAL_LOSS)[-1][1] for r in runs]
    assert len(set(finals)) == 3  # the seeds differ
    (verdict,) = [line for line in out.splitlines() if line.startswith("verdict:")]
    low, high = sorted(finals[:2])
    assert verdict.startswith(f"verdict: s3 ({runs[2].precision}): final val loss {finals[2]:.4f} is ")
    assert f"the baseline's seed band {low:.4f}-{high:.4f} (2 runs)" in verdict
    assert ("inside" in verdict) == (low <= finals[2] <= high)
    assert png.read_bytes()[:8] == PNG and png.stat().st_size > 10_000
    # the band needs two runs and no more than were given
    for bad in ("1", "4"):
        with pytest.raises(SystemExit) as exit_info:
            main(["compare", *map(str, seeds), "--baseline", bad])
        err = capsys.readouterr().err
        assert exit_info.value.code == 2 and f"--baseline {bad}: a seed band needs 2 to 3 runs" in err
