"""``run.log``: what a run printed, kept in its folder.

Every log record of the run at INFO and above (reprlab's own and the progress summaries of
:func:`reprlab.train.progress.progress`) and every Python warning shown while the run lasts is appended to
``<run_dir>/run.log``, whatever the console shows (``--quiet`` keeps the console to
warnings; the file still gets everything). A resumed run appends below a line saying so.
"""

from __future__ import annotations

import contextlib
import logging
import time
import warnings
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
    # the file gets reprlab's INFO records in any case; the console's handlers keep their own levels (--quiet)
    if reprlab_logger.getEffectiveLevel() > logging.INFO:
        reprlab_logger.setLevel(logging.INFO)
    # warnings go to the file too, and are still shown (or recorded, under pytest) exactly as before
    wlog = logging.getLogger("reprlab.warnings")
    wlog.propagate = False
    wlog.addHandler(handler)
    shown = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):
        wlog.warning("%s", warnings.formatwarning(message, category, filename, lineno, line).rstrip())
        shown(message, category, filename, lineno, file, line)

    warnings.showwarning = show
    if resumed:
        logging.getLogger("reprlab").info("--- resumed %s ---", time.strftime("%Y-%m-%d %H:%M:%S"))
    try:
        yield path
    finally:
        if warnings.showwarning is show:
            warnings.showwarning = shown
        wlog.removeHandler(handler)
        root.removeHandler(handler)
        handler.close()
        reprlab_logger.setLevel(old_level)
