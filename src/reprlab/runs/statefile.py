"""State that loads without running code: tensors in safetensors, everything else in JSON.

An optimizer's ``state_dict()`` or the RNG states are nested dicts, lists and tuples of tensors, numbers,
strings, ``None`` and numpy arrays. :func:`encode` splits such a tree into a JSON-able skeleton and a flat
``{name: tensor}`` dict; :func:`decode` puts them back together. Nothing is ever unpickled: the skeleton is
plain JSON whose only special forms are the tagged objects below, and an unknown tag is an error.

* ``{"__tensor__": "t0"}``: the tensor stored under ``t0`` in the safetensors file
* ``{"__tuple__": [...]}``: a tuple (JSON has only lists; ``random.setstate`` needs tuples)
* ``{"__dict__": [[key, value], ...]}``: a dict whose keys are not all strings (optimizer state is keyed
  by parameter index), or that has a key starting with ``__``
* ``{"__ndarray__": {"dtype": "uint32", "shape": [624], "data": [...]}}``: a numeric numpy array

Round trips are exact: Python's JSON writes floats with ``repr`` (shortest round-tripping form), integers of
any size, NaN and infinities; tensors keep dtype, shape and bits.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

_TAGS = ("__tensor__", "__tuple__", "__dict__", "__ndarray__")
_NUMPY_KINDS = "biuf"  # bool, signed, unsigned, float: what round-trips through JSON numbers exactly


class StateFormatError(ValueError):
    """A state skeleton or its tensors do not fit together (a damaged or foreign file)."""


def encode(tree: Any) -> tuple[Any, dict[str, torch.Tensor]]:
    """Split ``tree`` into ``(skeleton, tensors)``; the skeleton is JSON-able, tensors are contiguous CPU."""
    tensors: dict[str, torch.Tensor] = {}

    def enc(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            name = f"t{len(tensors)}"
            tensors[name] = x.detach().to("cpu", copy=True).contiguous()
            return {"__tensor__": name}
        if x is None or isinstance(x, bool | int | float | str):
            return x
        if isinstance(x, np.ndarray):
            if x.dtype.kind not in _NUMPY_KINDS:
                raise TypeError(f"numpy array of dtype {x.dtype} cannot be stored as JSON numbers")
            return {"__ndarray__": {"dtype": x.dtype.str, "shape": list(x.shape), "data": x.ravel().tolist()}}
        if isinstance(x, np.generic):
            return enc(x.item())
        if isinstance(x, tuple):
            return {"__tuple__": [enc(v) for v in x]}
        if isinstance(x, list):
            return [enc(v) for v in x]
        if isinstance(x, dict):
            if all(isinstance(k, str) and not k.startswith("__") for k in x):
                return {k: enc(v) for k, v in x.items()}
            return {"__dict__": [[enc(k), enc(v)] for k, v in x.items()]}
        raise TypeError(f"cannot store a {type(x).__name__} in a checkpoint (tensors, numbers, strings, "
                        "None, lists, tuples, dicts and numeric numpy arrays only)")  # fmt: skip

    return enc(tree), tensors


def decode(skeleton: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """Inverse of :func:`encode`; raises :class:`StateFormatError` on anything it did not write."""
    used: set[str] = set()

    def dec(x: Any) -> Any:
        if x is None or isinstance(x, bool | int | float | str):
            return x
        if isinstance(x, list):
            return [dec(v) for v in x]
        if not isinstance(x, dict):
            raise StateFormatError(f"unexpected {type(x).__name__} in a state skeleton")
        tags = [k for k in x if k in _TAGS]
        if not tags:
            if any(k.startswith("__") for k in x):
                raise StateFormatError(f"unknown tag in a state skeleton: {sorted(x)[:3]}")
            return {k: dec(v) for k, v in x.items()}
        if len(x) != 1:
            raise StateFormatError(f"a tagged object has extra keys: {sorted(x)[:3]}")
        tag, body = tags[0], x[tags[0]]
        if tag == "__tensor__":
            if not isinstance(body, str) or body not in tensors:
                raise StateFormatError(f"the skeleton refers to a tensor {body!r} the tensor file lacks")
            used.add(body)
            return tensors[body]
        if tag == "__tuple__":
            if not isinstance(body, list):
                raise StateFormatError("__tuple__ must hold a list")
            return tuple(dec(v) for v in body)
        if tag == "__dict__":
            if not isinstance(body, list) or not all(isinstance(kv, list) and len(kv) == 2 for kv in body):
                raise StateFormatError("__dict__ must hold [key, value] pairs")
            out = {}
            for k, v in body:
                key = dec(k)
                if isinstance(key, list):
                    raise StateFormatError("a dict key cannot be a list")
                out[key] = dec(v)
            return out
        return _array(body)

    tree = dec(skeleton)
    unused = set(tensors) - used
    if unused:
        raise StateFormatError(f"the tensor file holds tensors the skeleton never uses: {sorted(unused)[:3]}")
    return tree


def _array(body: Any) -> np.ndarray:
    if not isinstance(body, dict) or set(body) != {"dtype", "shape", "data"}:
        raise StateFormatError("__ndarray__ must hold dtype, shape and data")
    try:
        dtype = np.dtype(body["dtype"])
    except TypeError as err:
        raise StateFormatError(f"__ndarray__ has an unknown dtype {body['dtype']!r}") from err
    if dtype.kind not in _NUMPY_KINDS:
        raise StateFormatError(f"__ndarray__ dtype {dtype} is not numeric")
    shape = body["shape"]
    if not isinstance(shape, list) or not all(isinstance(s, int) and s >= 0 for s in shape):
        raise StateFormatError("__ndarray__ shape must be a list of non-negative integers")
    data = body["data"]
    if not isinstance(data, list) or len(data) != int(np.prod(shape, dtype=np.int64)):
        raise StateFormatError("__ndarray__ data does not match its shape")
    try:
        return np.array(data, dtype=dtype).reshape(shape)
    except (TypeError, ValueError, OverflowError) as err:
        raise StateFormatError(f"__ndarray__ data does not fit dtype {dtype}: {err}") from err


def dumps(skeleton: Any) -> str:
    return json.dumps(skeleton, allow_nan=True, separators=(",", ":")) + "\n"


def loads(text: str, where: Path | str) -> Any:
    try:
        return json.loads(text)
    except (json.JSONDecodeError, RecursionError) as err:
        raise StateFormatError(f"{where} is not valid JSON ({type(err).__name__}: {err})") from None
