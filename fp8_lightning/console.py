"""What the console shows: this package's lines and the warnings that apply, not the noise.

Lightning, litdata and jsonargparse each print for every run: tips advertising other products, an
INFO line per dataset about litdata's cache, warnings that do not apply to this package's runs
(``num_workers`` advice for a loader that has its workers, a checkpoint directory that is reused on
purpose). Each filter below names what it drops; everything else still shows.
"""

from __future__ import annotations

import logging
import warnings

# Lightning's rank-zero INFO lines that advertise rather than inform.
_ADVERTS = ("💡 Tip:", "Create an account on https://lightning.ai")
# Lightning warnings that do not apply to this package's runs (regexes on the message start).
_NOT_APPLICABLE = (
    r"The '\w+_dataloader' does not have many workers",  # litdata's loader; workers are set
    r"Consider setting `persistent_workers=True`",
    r"Checkpoint directory .* exists and is not empty",  # one stable directory per run root
    r"The number of training batches \(\d+\) is smaller than the logging interval",
    r"LightningCLI's args parameter is intended",  # main(argv) from Python (tests, notebooks)
    r"Precision .* is not supported by the model summary",
    r".*is deprecated",
)


class _DropAdverts(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.getMessage()).lstrip().startswith(_ADVERTS)


def quiet_console() -> None:
    """Log this package at INFO, other libraries at WARNING; drop adverts and inapplicable warnings."""
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
