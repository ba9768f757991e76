"""What the console shows: this package's lines and the warnings that apply, not the noise.

Lightning, litdata and jsonargparse each print for every run: tips advertising other products, an
INFO line per dataset about litdata's cache, warnings that do not apply to this package's runs
(``num_workers`` advice for a loader that has its workers, a checkpoint directory that is reused on
purpose). Each filter below names what it drops; everything else still shows.
"""

from __future__ import annotations

import logging
import re
import warnings

# Lightning's rank-zero INFO lines that advertise rather than inform.
_ADVERTS = ("💡 Tip:", "Create an account on https://lightning.ai")
# Lightning's INFO lines about accelerators this package never uses (regexes on the message).
_NOT_APPLICABLE_INFO = (r"(TPU|HPU) available: False",)
# Lightning warnings that do not apply to this package's runs (regexes on the message start).
_NOT_APPLICABLE = (
    r"The '\w+_dataloader' does not have many workers",  # litdata's loader; workers are set
    r"Consider setting `persistent_workers=True`",
    r"Checkpoint directory .* exists and is not empty",  # one stable directory per run root
    r"The number of training batches \(\d+\) is smaller than the logging interval",
    r"LightningCLI's args parameter is intended",  # main(argv) from Python (tests, notebooks)
    r"Precision .* is not supported by the model summary",
    # Lightning's own use of a torch API (lightning/pytorch/utilities/_pytree.py): nothing to act on.
    r"`isinstance\(treespec, LeafSpec\)` is deprecated",
    # Lightning warns for any IterableDataset with __len__ and num_workers > 1; litdata's
    # StreamingDataset gives each worker its own share, so its length is exact.
    r"Your `IterableDataset` has `__len__` defined",
)


def _without_unknown_flops(summary: str) -> str:
    """Lightning's model summary without its FLOPs column and ``0 Total Flops`` line.

    It counts FLOPs only by running ``example_input_array``, which this package's module does not
    set (a forward pass just for the table): the zeros are not a measurement. The monitor's tok/s
    and MFU use the analytic FLOPs (fp8_lightning.flops).
    """
    lines = summary.split("\n")
    if not any(re.fullmatch(r"0\s+Total Flops", line.strip()) for line in lines):
        return summary
    header = next(line for line in lines if " | " in line)
    column = [cell.strip() for cell in header.split(" | ")].index("FLOPs")
    out = []
    for line in lines:
        if re.fullmatch(r"0\s+Total Flops", line.strip()):
            continue
        if " | " in line:
            cells = line.split(" | ")
            del cells[column]
            line = " | ".join(cells)
        out.append(line)
    width = max(len(line) for line in out if " | " in line)
    return "\n".join("-" * width if line and set(line) == {"-"} else line for line in out)


class _DropAdverts(logging.Filter):
    """Drops adverts and lines about unused accelerators; rewrites the model summary's FLOPs."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = str(record.getMessage())
        if message.lstrip().startswith(_ADVERTS) or any(
                re.match(pattern, message.lstrip()) for pattern in _NOT_APPLICABLE_INFO):
            return False
        if "Total Flops" in message:
            try:
                record.msg, record.args = _without_unknown_flops(message), None
            except (StopIteration, ValueError):  # another table layout: show it as it is
                pass
        return True


def _format_warning(message: Warning | str, category: type[Warning], filename: str, lineno: int,
                    line: str | None = None) -> str:
    """A warning as a sentence: ``WARNING: <message>``, without the source path and line that
    Python's default format puts first (they point into this package or Lightning, not at
    anything the user wrote); a category other than a user warning is named."""
    kind = "" if issubclass(category, UserWarning) else f" ({category.__name__})"
    return f"WARNING{kind}: {message}\n"


def quiet_console() -> None:
    """Log this package at INFO, other libraries at WARNING; drop adverts and inapplicable warnings;
    warnings print as sentences."""
    warnings.formatwarning = _format_warning
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("fp8_lightning").setLevel(logging.INFO)
    for name in ("lightning.pytorch", "lightning.fabric", "lightning.pytorch.utilities.rank_zero",
                 "lightning.fabric.utilities.rank_zero"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropAdverts) for f in logger.filters):
            logger.addFilter(_DropAdverts())
        for handler in logger.handlers:
            if not any(isinstance(f, _DropAdverts) for f in handler.filters):
                handler.addFilter(_DropAdverts())
    for message in _NOT_APPLICABLE:
        warnings.filterwarnings("ignore", message=message)
