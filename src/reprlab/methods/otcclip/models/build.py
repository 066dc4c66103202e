"""The model registry: ``model.arch`` -> a model and the tokenizer it brings.

The one place that knows every architecture: ``tiny`` (:mod:`.tiny`), ``hf_clip`` (:mod:`.hf`) and
``open_clip:<name>`` (:mod:`.openclip`). The adapters know only the feature interface (:mod:`.features`), never
this builder or each other's models, so adding an architecture is a new module plus a branch here.
"""

from __future__ import annotations

from torch import nn

from reprlab.errors import ConfigError, ModelNotAvailableError
from reprlab.methods.otcclip.config import ModelConfig
from reprlab.methods.otcclip.models import openclip
from reprlab.methods.otcclip.models.hf import HFCLIPAdapter, HFTokenizerAdapter, clip_config
from reprlab.methods.otcclip.models.tiny import TinyCLIP

ARCHS = ("tiny", "hf_clip", "open_clip:<name>")


def build_model(cfg: ModelConfig, vocab_size: int, in_channels: int = 1) -> nn.Module:
    """The model ``cfg.arch`` names, randomly initialised from the current torch seed.

    Raises:
        ConfigError: an unknown arch. ModelNotAvailableError: ``open_clip:<name>`` without open-clip-torch.
    """
    if cfg.arch == "tiny":
        return TinyCLIP(cfg, vocab_size, in_channels)
    if cfg.feature_layer != -1:
        raise ConfigError(f"model.feature_layer={cfg.feature_layer} is implemented for model.arch=tiny only")
    if cfg.arch == "hf_clip":
        return HFCLIPAdapter.from_config(clip_config(cfg, vocab_size), cfg)
    if cfg.arch.startswith("open_clip:"):
        return _open_clip(cfg.arch.partition(":")[2], cfg.pretrained)
    raise ConfigError(f"model.arch {cfg.arch!r} is not one of {list(ARCHS)}")


def build_tokenizer(cfg: ModelConfig):
    """The tokenizer the arch itself brings: open_clip's BPE for ``open_clip:<name>``, the Hugging Face tokenizer
    of ``model.tokenizer`` (a local folder) for ``hf_clip``; ``None`` where the caller builds our word tokenizer
    from its captions."""
    if cfg.arch.startswith("open_clip:"):
        return openclip.OpenCLIPTokenizer.for_config(cfg)
    if cfg.arch == "hf_clip" and cfg.tokenizer:
        from transformers import AutoTokenizer  # lazy: transformers is a slow import

        return HFTokenizerAdapter(AutoTokenizer.from_pretrained(cfg.tokenizer))
    return None


def _open_clip(name: str, pretrained: str = "") -> nn.Module:
    """An open_clip architecture behind the TinyCLIP interface (:mod:`.openclip`); open-clip-torch is imported
    only when asked for."""
    try:
        import open_clip  # noqa: F401
    except Exception as err:  # ImportError, or torchvision failing to load beside this torch build
        raise ModelNotAvailableError(
            f"model.arch open_clip:{name} needs the open-clip-torch package, which cannot be imported here "
            f"({type(err).__name__}: {err})",
            hint="open-clip-torch needs torchvision, which does not import beside the project's torch 2.13.0 CPU "
            "build: build the side venv with scripts/openclip_env.sh (torch 2.14.1 + torchvision 0.29.1 + "
            "open-clip-torch) and run there, or use model.arch=hf_clip (same ViT-B/32 sizes through transformers)",
        ) from err
    return openclip.build(name, pretrained)
