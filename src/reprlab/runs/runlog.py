"""``run.log``: what a run printed, kept in its folder.

Every log record of the run at INFO and above (reprlab's own, the progress summaries of
:func:`reprlab.train.progress.progress`, and Python warnings, which are routed through logging while the run
lasts) is appended to ``<run_dir>/run.log``, whatever the console shows (``--quiet`` keeps the console to
warnings; the file still gets everything). A resumed run appends below a line saying so.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from pathlib import Path

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


@contextlib.contextmanager
def run_log(run_dir: Path, resumed: bool = False, enabled: bool = True) -> Iterator[Path | None]:
    """Append the run's log records to ``run_dir/run.log`` inside the block (main rank only: ``enabled``)."""
    if not enabled:
        yield None
        return
    path = Path(run_dir) / "run.log"
    handler = logging.FileHandler(path, mode="a", encoding="utf-8")
    handler.setLevel(logging.INFO)
    handler.setFormatter(logging.Formatter(FORMAT, datefmt="%Y-%m-%d %H:%M:%S"))
    root = logging.getLogger()
    reprlab_logger = logging.getLogger("reprlab")
    old_level = reprlab_logger.level
    root.addHandler(handler)
    if reprlab_logger.getEffectiveLevel() > logging.INFO:  # the file gets reprlab's INFO records in any case;
        reprlab_logger.setLevel(
            logging.INFO
        )  # the console's handlers keep their own levels (the CLI's --quiet)
    logging.captureWarnings(True)
    if resumed:
        logging.getLogger("reprlab").info("--- resumed %s ---", time.strftime("%Y-%m-%d %H:%M:%S"))
    try:
        yield path
    finally:
        logging.captureWarnings(False)
        root.removeHandler(handler)
        handler.close()
        reprlab_logger.setLevel(old_level)
