"""Progress lines of long steps (``fp8_lightning/progress.py``): done of total, the share, the time
so far and an estimate of the time left, printed every few seconds as plain lines."""

import threading
import time

from fp8_lightning.progress import Progress, duration, eta_s, progress_line, tallied, tally_of


def test_the_estimate_is_the_time_left_at_the_average_rate_so_far():
    assert eta_s(done=25, total=100, elapsed=10) == 30  # 25 in 10 s: 75 more take 30 s
    assert eta_s(done=90, total=120, elapsed=45) == 15
    assert eta_s(done=0, total=100, elapsed=10) is None  # no rate yet
    assert eta_s(done=100, total=100, elapsed=10) is None  # nothing left to estimate
    assert eta_s(done=5, total=0, elapsed=10) is None  # no total


def test_durations_read_as_seconds_minutes_or_hours():
    assert [duration(s) for s in (0, 45, 59.6, 185, 3599, 7620)] == \
        ["0s", "45s", "1m00s", "3m05s", "59m59s", "2h07m"]


def test_a_progress_line_says_done_of_total_the_share_the_time_so_far_and_the_time_left():
    assert progress_line("prepare: tokenizing train", 25, 100, 10) == \
        "prepare: tokenizing train: 25 of 100 (25%), 10s so far, about 30s left"
    assert progress_line("w", 0, 100, 5) == "w: 0 of 100 (0%), 5s so far"  # no rate: no estimate
    assert progress_line("w", 100, 100, 5) == "w: 100 of 100 (100%), 5s so far, finishing"
    assert progress_line("w", 130, 100, 5) == "w: 100 of 100 (100%), 5s so far, finishing"
    assert progress_line("w", None, 100, 5) == "w: 100, 5s so far"  # the amount is unknown
    # work with no amount to count (a compilation): the time alone
    assert progress_line("first training step: compiling", None, None, 12) == \
        "first training step: compiling, 12s so far"
    assert progress_line("w", 2 ** 20, 2 ** 22, 90, fmt=lambda n: f"{n / 2 ** 20:.1f} MB") == \
        "w: 1.0 MB of 4.0 MB (25%), 1m30s so far, about 4m30s left"


def test_progress_prints_a_line_every_interval_while_its_block_runs_and_none_after():
    lines, done = [], [0]
    with Progress("step", 100, lambda: done[0], say=lines.append, every=0.05):
        for _ in range(5):
            time.sleep(0.1)
            done[0] += 10
    printed = len(lines)
    time.sleep(0.2)
    assert len(lines) == printed  # the thread stopped with the block
    assert printed >= 3, lines
    assert all(line.startswith("step: ") and " of 100 (" in line for line in lines), lines
    shares = [int(line.split("(")[1].split("%")[0]) for line in lines]
    assert shares == sorted(shares) and 0 < shares[-1] <= 50, lines
    assert not any(t.name == "progress" for t in threading.enumerate())


def test_a_line_never_shows_less_done_than_an_earlier_one():
    polls = iter([10, 30, 0, 20, 40] + [40] * 100)  # 0: a polled file renamed when complete
    lines = []
    with Progress("step", 100, lambda: next(polls), say=lines.append, every=0.02):
        while len(lines) < 5:
            time.sleep(0.01)
    assert [line.split(":")[1].split(" of")[0].strip() for line in lines[:5]] == \
        ["10", "30", "30", "30", "40"]


def test_a_step_shorter_than_the_interval_prints_nothing_and_does_not_wait_for_it():
    lines = []
    start = time.monotonic()
    with Progress("step", 100, lambda: 50, say=lines.append, every=30):
        pass
    assert lines == [] and time.monotonic() - start < 5


def test_a_failing_poll_gives_a_line_without_the_amount():
    def missing():
        raise FileNotFoundError("not written yet")
    lines = []
    with Progress("writing x", 100, missing, say=lines.append, every=0.02):
        time.sleep(0.15)
    assert lines and set(lines) <= {f"writing x: 100, {s}s so far" for s in (0, 1)}, lines


def test_tallied_records_each_item_once_its_results_are_all_taken(tmp_path):
    tally = str(tmp_path / "done")
    assert tally_of(tally) == []  # no file yet: nothing done
    results = tallied("a.txt", fn=lambda item: iter([item, item]), tally=tally)
    assert next(results) == "a.txt" and tally_of(tally) == []  # not done mid-way
    assert list(results) == ["a.txt"] and tally_of(tally) == ["a.txt"]
    list(tallied("b.txt", fn=lambda item: iter([]), tally=tally))
    with open(tally, "a") as f:
        f.write("c.t")  # another process's line, half written: not counted yet
    assert tally_of(tally) == ["a.txt", "b.txt"]
