"""Is a named model usable without a download? Checked before any work (the recipe's ``preflight``).

A model is available when it is a packaged alias whose package is installed, an existing local folder, or a
hub id whose ``config.json`` is already in the local Hugging Face cache. Anything else would fail only after
the GloVe/SGNS stages, with a hub traceback (issue 14: 16 s of work, 42 frames); we fail first, saying which
aliases exist. [ours]
"""

from __future__ import annotations

from pathlib import Path

from reprlab.errors import ModelNotAvailableError


def _in_hf_cache(model_id: str) -> bool:
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:  # pragma: no cover - transformers depends on huggingface_hub
        return False
    try:
        hit = try_to_load_from_cache(model_id, "config.json")
    except Exception:  # malformed repo ids raise validation errors: not in the cache, then
        return False
    return isinstance(hit, str) and Path(hit).exists()


def check_model_available(model_id: str, what: str = "model") -> str:
    """Say how ``model_id`` resolves offline (``"packaged"``, ``"folder"``, ``"cache"``) or raise.

    Raises:
        ModelNotAvailableError: with a hint naming the packaged aliases.
    """
    from reprlab.assets import AssetMissingError
    from reprlab.models.hf import PACKAGED_MODELS, _resolve

    aliases = ", ".join(sorted(PACKAGED_MODELS))
    hint = (f"use a packaged alias ({aliases}), a local model folder, a model already in the Hugging Face "
            "cache, or set allow_download=true on a machine with hub access")  # fmt: skip
    if model_id.lower() in PACKAGED_MODELS:
        try:
            _resolve(model_id)
        except (AssetMissingError, FileNotFoundError) as err:
            raise ModelNotAvailableError(f"{what} {model_id!r}: packaged alias, but {err}", hint) from err
        return "packaged"
    path = Path(model_id).expanduser()
    if path.is_dir():
        if not (path / "config.json").exists() and not any(path.glob("*.gguf")):
            raise ModelNotAvailableError(f"{what} folder {path} has no config.json", hint)
        return "folder"
    if _in_hf_cache(model_id):
        return "cache"
    raise ModelNotAvailableError(f"{what} {model_id!r} is not available offline (not a packaged alias, not a "
                                 "local folder, not in the local Hugging Face cache)", hint)  # fmt: skip
