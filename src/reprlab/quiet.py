"""Keep third-party noise out of what a run prints, unless asked for (``reprlab -v``, ``REPRLAB_VERBOSE=1``).

Libraries under reprlab talk to each other in ways a user cannot act on: peft reads transformers'
deprecated ``is_gradient_checkpointing`` alias (a FutureWarning on every LoRA model), gensim logs every
training epoch at INFO, transformers draws a "Loading weights" bar for every model it loads. Those are filtered here, by name, so that what remains on the screen (and in
``run.log``) is about the user's run; our own warnings are never filtered. The same filters apply in the
test suite (``tests/conftest.py`` adds :data:`WARNING_FILTERS` to pytest's ``filterwarnings``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import warnings
from collections.abc import Iterator

# pytest's filterwarnings syntax, action:message regex:category:module regex; third-party code only
WARNING_FILTERS = (
    "ignore::FutureWarning:transformers",  # deprecations inside transformers (e.g. aliases peft still reads)
    "ignore::FutureWarning:peft",
    "ignore:`is_gradient_checkpointing` is deprecated:FutureWarning",  # peft -> transformers, attributed to either
)
QUIET_LOGGERS = ("gensim", "smart_open", "sentence_transformers", "datasets", "httpx", "urllib3", "filelock",
                 "matplotlib", "PIL", "numexpr", "fsspec")  # fmt: skip


def verbose() -> bool:
    return os.environ.get("REPRLAB_VERBOSE", "0") not in ("", "0")


def _category(name: str) -> type[Warning]:
    import builtins

    cat = getattr(builtins, name, None)
    if not (isinstance(cat, type) and issubclass(cat, Warning)):
        raise ValueError(f"unknown warning category {name!r}")
    return cat


def apply_filters() -> None:
    """Install :data:`WARNING_FILTERS` in the current warnings state (call inside ``catch_warnings``)."""
    for spec in WARNING_FILTERS:
        action, message, category, module = (spec.split(":") + ["", "", ""])[:4]
        warnings.filterwarnings(action, message=message, category=_category(category or "Warning"),
                                module=module and re.escape(module) + r"(\.|$)")  # fmt: skip


@contextlib.contextmanager
def third_party_quiet(enabled: bool | None = None) -> Iterator[None]:
    """Within the block, third-party FutureWarnings listed above are ignored and chatty third-party loggers
    show WARNING and above only; both are restored afterwards. ``enabled`` defaults to not :func:`verbose`."""
    if enabled is None:
        enabled = not verbose()
    if not enabled:
        yield
        return
    loggers = {name: logging.getLogger(name) for name in QUIET_LOGGERS}
    levels = {name: lg.level for name, lg in loggers.items()}
    restore_bars = _hf_progress_bars_off()
    with warnings.catch_warnings():
        apply_filters()
        for lg in loggers.values():
            if lg.getEffectiveLevel() < logging.WARNING:
                lg.setLevel(logging.WARNING)
        try:
            yield
        finally:
            for name, lg in loggers.items():
                lg.setLevel(levels[name])
            restore_bars()


def _hf_progress_bars_off():
    """Switch off transformers' and huggingface_hub's tqdm bars ("Loading weights ..."); returns the undo.

    Once transformers is imported, through its switch; before, through the environment variable both read at
    import (it then stays for the process: the hub refuses to re-enable bars over it, with a warning).
    """
    import sys

    if "transformers" in sys.modules:
        from transformers.utils import logging as hf_logging

        if not hf_logging.is_progress_bar_enabled():
            return lambda: None
        hf_logging.disable_progress_bar()
        return hf_logging.enable_progress_bar
    if "HF_HUB_DISABLE_PROGRESS_BARS" in os.environ:
        return lambda: None
    os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
    return lambda: os.environ.pop("HF_HUB_DISABLE_PROGRESS_BARS", None)
