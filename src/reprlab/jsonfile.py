"""Standard JSON out of every file reprlab writes: non-finite floats become ``null``, never ``NaN``.

Python's :mod:`json` writes ``NaN`` and ``Infinity`` by default, which is not JSON (RFC 8259): ``jq``,
JavaScript's ``JSON.parse`` and most other readers reject such a file. :func:`dumps_json` is the one writer
the run folder uses (through :func:`reprlab.runs.atomic.atomic_write_json` and ``Run.log``): it turns numpy
and torch values into plain Python, writes each non-finite float as ``null`` and then serialises with
``allow_nan=False``, so a value it missed raises instead of being written.

Where the reason for a ``null`` is useful to a reader, the writer of that file adds it next to the value:
:func:`with_null_reasons` gives a flat mapping (``summary.json``) a sibling ``"<key>.null_reason"`` for each
non-finite value. Files that are read back to continue a run (stage results) keep the JSON pointers of their
non-finite values (:func:`nonfinite_pointers`) so :func:`restore_nonfinite` gives the resumed run the same
``nan``/``inf`` the uninterrupted one computed with.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

NULL_REASON = ".null_reason"
_WORDS = {"nan": "NaN", "inf": "+Infinity", "-inf": "-Infinity"}


def _word(x: float) -> str:
    return "nan" if x != x else ("inf" if x > 0 else "-inf")


def _plain(obj: Any, path: str, found: dict[str, str] | None) -> Any:
    """``obj`` as plain JSON types, non-finite floats as ``None`` (their pointers collected in ``found``)."""
    if isinstance(obj, bool) or obj is None or isinstance(obj, str | int):
        return obj
    if isinstance(obj, float):
        if math.isfinite(obj):
            return obj
        if found is not None:
            found[path] = _word(obj)
        return None
    if isinstance(obj, Mapping):
        return {k: _plain(v, f"{path}/{_escape(k)}", found) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_plain(v, f"{path}/{i}", found) for i, v in enumerate(obj)]
    if hasattr(obj, "tolist"):  # numpy arrays and scalars, torch tensors
        return _plain(obj.tolist(), path, found)
    if hasattr(obj, "item"):
        return _plain(obj.item(), path, found)
    if isinstance(obj, Path):
        return str(obj)
    if isinstance(obj, set | frozenset):
        return _plain(sorted(obj), path, found)
    raise TypeError(f"object of type {type(obj).__name__} is not JSON serialisable")


def _escape(key: Any) -> str:
    return str(key).replace("~", "~0").replace("/", "~1")  # RFC 6901 JSON pointer escaping


def dumps_json(obj: Any, indent: int | None = 2, sort_keys: bool = False) -> str:
    """Standard JSON text of ``obj``: ``NaN``/``±Infinity`` written as ``null``."""
    return json.dumps(_plain(obj, "", None), indent=indent, allow_nan=False, sort_keys=sort_keys)


def nonfinite_pointers(obj: Any) -> dict[str, str]:
    """``{JSON pointer: "nan" | "inf" | "-inf"}`` of every non-finite float in ``obj``."""
    found: dict[str, str] = {}
    _plain(obj, "", found)
    return found


def restore_nonfinite(obj: Any, pointers: Mapping[str, str]) -> Any:
    """Put the non-finite values recorded by :func:`nonfinite_pointers` back into ``obj`` (in place)."""
    for pointer, word in pointers.items():
        parts = [p.replace("~1", "/").replace("~0", "~") for p in pointer.split("/")[1:]]
        if not parts:
            return float(word)
        node = obj
        for p in parts[:-1]:
            node = node[int(p)] if isinstance(node, list) else node[p]
        last = parts[-1]
        node[int(last) if isinstance(node, list) else last] = float(word)
    return obj


def with_null_reasons(flat: Mapping[str, Any], reasons: Mapping[str, str] | None = None) -> dict[str, Any]:
    """A flat mapping with each non-finite value made ``None`` and a sibling ``"<key>.null_reason"``.

    Args:
        flat: e.g. a run's summary.
        reasons: ``{key: why}`` where the caller knows why a value is undefined (a constant input, a null
            that does not apply); other keys get which non-finite value it was.
    """
    out: dict[str, Any] = {}
    for key, value in flat.items():
        if hasattr(value, "item") and not isinstance(value, str | bytes):
            value = value.item()
        if isinstance(value, float) and not math.isfinite(value):
            out[key] = None
            if f"{key}{NULL_REASON}" not in flat:
                why = (reasons or {}).get(key)
                out[f"{key}{NULL_REASON}"] = why or f"not a finite number ({_WORDS[_word(value)]})"
        else:
            out[key] = value
    return out


def loads_strict(text: str) -> Any:
    """Parse JSON the way a strict reader (jq, JavaScript) does: ``NaN`` and ``Infinity`` are errors."""

    def refuse(name: str) -> Any:
        raise ValueError(f"{name} is not JSON")

    return json.loads(text, parse_constant=refuse)


def read_stage(path: Path | str) -> Any:
    """The result kept in a ``stages/<name>.json`` file, with its non-finite values restored."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise ValueError(f"{path} is not valid JSON: {err}") from err
    return restore_nonfinite(data["result"], data.get("nonfinite") or {})


def null_as_nan(obj: Any) -> Any:
    """``obj`` with every ``null`` read as NaN: for report code that formats or plots numeric artefacts,
    where a statistic written as null (it was NaN) should show as "n/a" rather than fail."""
    if obj is None:
        return float("nan")
    if isinstance(obj, dict):
        return {k: null_as_nan(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [null_as_nan(v) for v in obj]
    return obj
