"""sentence-transformers pipelines: the model's own pooling and normalisation, from its ``modules.json``.

A sentence-transformers folder lists its modules in ``modules.json`` (e.g. all-MiniLM-L6-v2: Transformer ->
Pooling(mean) -> Normalize). :func:`load_sentence_pipeline` loads it with ``SentenceTransformer`` (extra
``normic``) and exposes the transformer module (an HF ``AutoModel`` and its tokenizer, for token-level
states) and :meth:`SentencePipeline.pool`, which runs the pipeline's own modules after the transformer on any
layer's token states, so the last layer's pooled vector is exactly ``SentenceTransformer.encode``'s.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn


def _offline() -> bool:
    return any(os.environ.get(k, "0") not in ("", "0") for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def modules_json(model_id: str) -> Path | None:
    """The ``modules.json`` of a packaged alias, local folder or hub id (cache, or the hub when online)."""
    from reprlab.models.hf import PACKAGED_MODELS, _resolve

    folder = Path(model_id).expanduser()
    if model_id.lower() in PACKAGED_MODELS:
        path, kwargs = _resolve(model_id)
        if kwargs.get("gguf_file"):
            return None
        folder = Path(path)
    if folder.is_dir():
        found = folder / "modules.json"
        return found if found.is_file() else None
    try:
        from huggingface_hub import hf_hub_download, try_to_load_from_cache

        hit = try_to_load_from_cache(model_id, "modules.json")
        if isinstance(hit, str):
            return Path(hit)
        if not _offline():
            return Path(hf_hub_download(model_id, "modules.json"))
    except Exception:  # no such repo or file, or no network: not a sentence-transformers pipeline
        return None
    return None


def is_sentence_transformer(model_id: str) -> bool:
    """True when ``model_id`` is a sentence-transformers pipeline (it has a ``modules.json``)."""
    return modules_json(model_id) is not None


@dataclass
class SentencePipeline:
    """A loaded sentence-transformers model, split into what Norm-IC reads.

    Attributes:
        model: the transformer module's HF model (``AutoModel``), eval mode.
        tokenizer: its tokenizer (``model_max_length`` = the pipeline's ``max_seq_length``).
        after: the modules after the transformer (Pooling, Normalize, Dense...), in pipeline order.
        pooling: the Pooling module's mode (``"mean"``, ``"cls"``, ...).
        normalize: whether a Normalize module follows.
    """

    model: nn.Module
    tokenizer: object
    after: list[nn.Module]
    pooling: str
    normalize: bool

    def describe(self, normalize: bool | None = None) -> str:
        """``"mean, normalize: true (from modules.json)"``; ``normalize=False`` says the module was skipped."""
        if normalize is False and self.normalize:
            return f"{self.pooling}, normalize: skipped (modules.json has it; every norm would be 1)"
        return f"{self.pooling}, normalize: {str(self.normalize).lower()} (from modules.json)"

    @torch.inference_mode()
    def pool(self, token_states: Tensor, attention_mask: Tensor, normalize: bool = True) -> Tensor:
        """The pipeline's modules after the transformer on ``token_states`` ``(batch, pos, d_model)``.

        Args:
            attention_mask: ``(batch, pos)``, 1 on real tokens (specials included, as the pipeline sees them).
            normalize: False skips Normalize modules (for norms, which Normalize sets to 1).

        Returns:
            ``(batch, d_out)`` sentence embeddings.
        """
        from sentence_transformers.base.modules.normalize import Normalize

        feats = {"token_embeddings": token_states, "attention_mask": attention_mask}
        for mod in self.after:
            if isinstance(mod, Normalize) and not normalize:
                continue
            feats = mod(feats)
        return feats["sentence_embedding"]


def load_sentence_pipeline(model_id: str, device: str | torch.device = "cpu") -> SentencePipeline:
    """Load a sentence-transformers pipeline (packaged alias, folder or hub id).

    Raises:
        ModelNotAvailableError: sentence-transformers is not installed (names the extra).
        ValueError: the first module is not a transformer, or there is no Pooling module.
    """
    from reprlab.errors import ModelNotAvailableError
    from reprlab.models.hf import PACKAGED_MODELS, _resolve

    if importlib.util.find_spec("sentence_transformers") is None:
        raise ModelNotAvailableError(f"{model_id!r} is a sentence-transformers pipeline (modules.json), and "
                                     "sentence-transformers is not installed",
                                     "pip install 'reprlab[normic]' (or pip install sentence-transformers)")  # fmt: skip
    from sentence_transformers import SentenceTransformer

    path = _resolve(model_id)[0] if model_id.lower() in PACKAGED_MODELS else model_id
    st = SentenceTransformer(str(path), device=str(device)).eval()
    mods = list(st)
    first = mods[0]
    if not hasattr(first, "auto_model"):
        raise ValueError(
            f"{model_id}: the first module of the pipeline is {type(first).__name__}, not a Transformer"
        )
    pooling = next((m for m in mods[1:] if type(m).__name__ == "Pooling"), None)
    if pooling is None:
        raise ValueError(
            f"{model_id}: the pipeline has no Pooling module ({[type(m).__name__ for m in mods]})"
        )
    tok = st.tokenizer
    tok.model_max_length = min(int(tok.model_max_length), int(st.max_seq_length or tok.model_max_length))
    normalize = any(type(m).__name__ == "Normalize" for m in mods[1:])
    return SentencePipeline(first.auto_model.eval(), tok, mods[1:], str(pooling.pooling_mode), normalize)
