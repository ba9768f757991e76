"""A progress line every few seconds while a long step runs: how much is done of the total and
about how long is left, e.g. ``prepare: tokenizing train: 1.2 GB of 4.8 GB (25%), 1m10s so far,
about 3m30s left``.

One helper shared by ``prepare``, ``consolidate``, ``bench`` and the monitor's first compiled step:
each waits on work that reports nothing while it runs (litdata's worker processes, torch's
checkpoint reader and writer, a variant's steps, a compilation), so a background thread asks how
much is done and prints plain lines, as readable in a log file as on a terminal.

Imports nothing heavy: prepare's spawned litdata workers import :func:`tallied` from here.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Iterator, Optional

EVERY_S = 5.0  # seconds between lines; a step that ends sooner prints none


def eta_s(done: float, total: float, elapsed: float) -> Optional[float]:
    """Seconds left at the average rate so far; None before anything is done or once all is."""
    if done <= 0 or total <= 0 or elapsed <= 0 or done >= total:
        return None
    return elapsed * (total - done) / done


def duration(seconds: float) -> str:
    """``45s``, ``3m05s``, ``2h07m``."""
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def progress_line(what: str, done: Optional[float], total: Optional[float], elapsed: float,
                  fmt: Callable[[float], str] = lambda n: f"{n:,.0f}") -> str:
    """``WHAT: DONE of TOTAL (P%), ELAPSED so far, about ETA left``: no estimate before anything
    is done, ``finishing`` once all is; only the total and the time where ``done`` is None; only
    the time where there is no amount at all (``total`` None)."""
    if total is None:
        return f"{what}, {duration(elapsed)} so far"
    if done is None:
        return f"{what}: {fmt(total)}, {duration(elapsed)} so far"
    done = min(max(done, 0), total)  # measured from outside: may overshoot its estimated total
    share = f" ({100 * done / total:.0f}%)" if total > 0 else ""
    line = f"{what}: {fmt(done)} of {fmt(total)}{share}, {duration(elapsed)} so far"
    if done >= total:
        return f"{line}, finishing"
    left = eta_s(done, total, elapsed)
    return line if left is None else f"{line}, about {duration(left)} left"


class Progress:
    """``with Progress(what, total, done):`` prints :func:`progress_line` every ``every`` seconds
    (default :data:`EVERY_S`) until the block ends; ``done()`` says how much is done (a line never
    shows less than an earlier one), or None when it cannot tell; ``total`` None: work with no
    amount to count, the time alone. Nothing is printed for a block shorter than ``every``."""

    def __init__(self, what: str, total: Optional[float] = None,
                 done: Callable[[], Optional[float]] = lambda: None, *,
                 say: Callable[[str], Any] = print, every: Optional[float] = None,
                 fmt: Callable[[float], str] = lambda n: f"{n:,.0f}") -> None:
        self.what, self.total, self.done, self.say, self.fmt = what, total, done, say, fmt
        self.every = EVERY_S if every is None else every
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="progress", daemon=True)

    def _run(self) -> None:
        start, most = time.monotonic(), 0.0
        while not self._stop.wait(self.every):
            try:
                done = self.done()
            except OSError:  # a polled file that is not there yet, or no longer
                done = None
            if done is not None:  # measured from outside (a file renamed once complete)
                done = most = max(most, done)
            if not self._stop.is_set():
                self.say(progress_line(self.what, done, self.total, time.monotonic() - start,
                                       self.fmt))

    def __enter__(self) -> "Progress":
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()


def tallied(item: str, *, fn: Callable[[str], Iterator[Any]], tally: str) -> Iterator[Any]:
    """``fn(item)``'s results, then ``item`` appended as one line to the file ``tally``: how work
    done in other processes (litdata's workers) shows up for a :class:`Progress` in this one."""
    yield from fn(item)
    with open(tally, "a", encoding="utf-8") as f:  # one short append: whole lines, any process
        f.write(item + "\n")


def tally_of(tally: str) -> list[str]:
    """The items :func:`tallied` has recorded in ``tally`` so far (none before the file exists)."""
    try:
        with open(tally, encoding="utf-8") as f:
            return [line[:-1] for line in f if line.endswith("\n")]
    except FileNotFoundError:
        return []
