"""Tiny CLIP trained from scratch: a ViT image encoder and a text transformer that expose fine-grained
features (patch tokens, word tokens) next to the pooled global embeddings [ours; sizes by config].

Both encoders are pre-LayerNorm transformers. The image side pools with a CLS token (as CLIP ViT);
the text side is bidirectional with a padding mask and mean-pools its projected tokens [ours: the
word-level tokenizer has no EOS token to pool on]. Fine-grained features are the last-layer outputs
after the final LayerNorm and the projection into the joint space, L2-normalised (brief §1.1).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

LOGIT_SCALE_MAX = math.log(100.0)  # clamp as in CLIP / RoCLIP code


ARCHS = ("tiny", "hf_clip", "open_clip:<name>")


@dataclass(frozen=True)
class ModelConfig:
    arch: str = field(
        default="tiny",
        metadata={
            "help": "'tiny' (our TinyCLIP), 'hf_clip' (a transformers CLIPModel built from the sizes below, random "
            "init: ViT-B/32 = image 224, patch 32, width 768, 12 layers, 12 heads; text 512, 12 layers, 8 heads; "
            "embed 512) or 'open_clip:<name>': an open_clip model config name (ViT-B-32, RN50, ... random init), "
            "'reprlab-tiny-vit' (the CPU recipe's tiny ViT), a model config .json or a local-dir folder; its own "
            "sizes, tokenizer and preprocess_cfg, the sizes below ignored (needs open-clip-torch, which does not "
            "import beside this torch build: run it in the side venv of scripts/openclip_env.sh)"
        },
    )
    tokenizer: str = field(
        default="",
        metadata={
            "help": "hf_clip only: a local Hugging Face tokenizer folder (CLIP's BPE; text pooled at EOS, as CLIP); "
            "'' = our word tokenizer built from the captions, text mean-pooled [ours]"
        },
    )
    pretrained: str = field(
        default="",
        metadata={
            "help": "open_clip only [ours]: a local checkpoint file (open_clip state dict) to start from; '' = random "
            "init (hub tags are never downloaded)"
        },
    )
    image_size: int = field(default=56, metadata={"help": "input side in pixels"})
    patch_size: int = field(
        default=7, metadata={"help": "ViT patch side; (image_size/patch_size)^2 patch tokens"}
    )
    width: int = field(default=64, metadata={"help": "image transformer width"})
    layers: int = field(default=2, metadata={"help": "image transformer layers"})
    heads: int = field(default=4, metadata={"help": "image transformer heads"})
    text_width: int = field(default=64, metadata={"help": "text transformer width"})
    text_layers: int = field(default=2, metadata={"help": "text transformer layers"})
    text_heads: int = field(default=4, metadata={"help": "text transformer heads"})
    max_len: int = field(default=32, metadata={"help": "caption length in tokens (longer is truncated)"})
    embed_dim: int = field(default=64, metadata={"help": "joint embedding dimension"})
    feature_layer: int = field(
        default=-1,
        metadata={
            "help": "[ours; tiny only] block whose output gives the fine-grained features (patches, word tokens) "
            "used by OT, Python-indexed over the blocks (-1 = last, -2 = the one before, ...), passed through "
            "the same final LayerNorm and projection; the global embeddings always come from the last block"
        },
    )


@dataclass
class ImageFeatures:
    """``global_ (batch, d)`` and ``patches (batch, n, d)``, both L2-normalised; ``mask (batch, n)`` all True."""

    global_: torch.Tensor
    patches: torch.Tensor
    mask: torch.Tensor


@dataclass
class TextFeatures:
    """``global_ (batch, d)`` and ``tokens (batch, m, d)``, L2-normalised; ``mask (batch, m)`` True on words."""

    global_: torch.Tensor
    tokens: torch.Tensor
    mask: torch.Tensor


def _encoder(width: int, layers: int, heads: int) -> nn.TransformerEncoder:
    layer = nn.TransformerEncoderLayer(
        width, heads, 4 * width, dropout=0.0, activation="gelu", batch_first=True, norm_first=True
    )
    return nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)


class TinyCLIP(nn.Module):
    """CLIP with fine-grained outputs.

    Args:
        cfg: sizes.
        vocab_size: ``d_vocab`` of the word tokenizer.
        in_channels: image channels (1 for greyscale mosaics, 3 when tinted).
    """

    def __init__(self, cfg: ModelConfig, vocab_size: int, in_channels: int = 1):
        super().__init__()
        if cfg.image_size % cfg.patch_size:
            raise ValueError(f"image_size {cfg.image_size} is not a multiple of patch_size {cfg.patch_size}")
        self.cfg = cfg
        n_patches = (cfg.image_size // cfg.patch_size) ** 2
        self.patch_embed = nn.Conv2d(in_channels, cfg.width, cfg.patch_size, stride=cfg.patch_size)
        self.cls = nn.Parameter(torch.randn(1, 1, cfg.width) * 0.02)
        self.image_pos = nn.Parameter(torch.randn(1, n_patches + 1, cfg.width) * 0.02)
        self.image_blocks = _encoder(cfg.width, cfg.layers, cfg.heads)
        self.image_ln = nn.LayerNorm(cfg.width)
        self.image_proj = nn.Linear(cfg.width, cfg.embed_dim, bias=False)
        self.token_embed = nn.Embedding(vocab_size, cfg.text_width)
        self.text_pos = nn.Parameter(torch.randn(1, cfg.max_len, cfg.text_width) * 0.02)
        self.text_blocks = _encoder(cfg.text_width, cfg.text_layers, cfg.text_heads)
        self.text_ln = nn.LayerNorm(cfg.text_width)
        self.text_proj = nn.Linear(cfg.text_width, cfg.embed_dim, bias=False)
        self.logit_scale = nn.Parameter(torch.tensor(math.log(1 / 0.07)))
        for blocks in (self.image_blocks, self.text_blocks):
            if not -len(blocks.layers) <= cfg.feature_layer < len(blocks.layers):
                raise ValueError(
                    f"model.feature_layer {cfg.feature_layer} is outside the {len(blocks.layers)} blocks"
                )

    @property
    def n_patches(self) -> int:
        return self.image_pos.shape[1] - 1

    def encode_image(self, images: torch.Tensor) -> ImageFeatures:
        """Args: images ``float (batch, C, H, W)``, normalised to about [-1, 1]."""
        x = self.patch_embed(images).flatten(2).transpose(1, 2)  # [batch, n, width]
        x = torch.cat([self.cls.expand(len(x), -1, -1), x], dim=1) + self.image_pos
        last, early = self._run_blocks(self.image_blocks, x)
        h = F.normalize(self.image_proj(self.image_ln(last)), dim=-1)  # [batch, 1 + n, d]
        patches = h[:, 1:]
        if early is not None:  # [ours] fine-grained features from an earlier block
            patches = F.normalize(self.image_proj(self.image_ln(early[:, 1:])), dim=-1)
        return ImageFeatures(
            h[:, 0], patches, torch.ones(patches.shape[:2], dtype=torch.bool, device=h.device)
        )

    def encode_text(self, ids: torch.Tensor, mask: torch.Tensor) -> TextFeatures:
        """Args: ids ``int64 (batch, pos)``, mask ``bool (batch, pos)`` with pos <= max_len."""
        pos = ids.shape[1]
        x = self.token_embed(ids) + self.text_pos[:, :pos]
        h, early = self._run_blocks(self.text_blocks, x, ~mask)
        tokens = self.text_proj(self.text_ln(h))  # [batch, pos, d]
        w = mask.unsqueeze(-1).to(tokens.dtype)
        global_ = F.normalize((tokens * w).sum(1) / w.sum(1).clamp_min(1.0), dim=-1)
        if early is not None:  # [ours] fine-grained features from an earlier block
            tokens = self.text_proj(self.text_ln(early))
        return TextFeatures(global_, F.normalize(tokens, dim=-1) * w, mask)

    def _run_blocks(
        self, blocks: nn.TransformerEncoder, x: torch.Tensor, pad: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(last block's output, block model.feature_layer's output or None when that is the last)`` of
        ``blocks`` on ``x``, in one pass (the encoder has no final norm, so it is its blocks in turn)."""
        if self.cfg.feature_layer == -1:
            return blocks(x, src_key_padding_mask=pad), None
        keep, early = self.cfg.feature_layer % len(blocks.layers), None
        for i, block in enumerate(blocks.layers):
            x = block(x, src_key_padding_mask=pad)
            early = x if i == keep else early
        return x, early

    def scale(self) -> torch.Tensor:
        """exp(t) with t clamped at ln 100."""
        return self.logit_scale.clamp(max=LOGIT_SCALE_MAX).exp()


def build_model(cfg: ModelConfig, vocab_size: int, in_channels: int = 1) -> nn.Module:
    """The model ``cfg.arch`` names, randomly initialised from the current torch seed.

    Raises:
        ConfigError: an unknown arch. ModelNotAvailableError: ``open_clip:<name>`` without open-clip-torch.
    """
    from reprlab.errors import ConfigError

    if cfg.arch == "tiny":
        return TinyCLIP(cfg, vocab_size, in_channels)
    if cfg.feature_layer != -1:
        raise ConfigError(f"model.feature_layer={cfg.feature_layer} is implemented for model.arch=tiny only")
    if cfg.arch == "hf_clip":
        from reprlab.methods.otcclip.hf_adapter import HFCLIPAdapter, clip_config

        return HFCLIPAdapter.from_config(clip_config(cfg, vocab_size), cfg)
    if cfg.arch.startswith("open_clip:"):
        return _open_clip(cfg.arch.partition(":")[2], cfg.pretrained)
    raise ConfigError(f"model.arch {cfg.arch!r} is not one of {list(ARCHS)}")


def build_tokenizer(cfg: ModelConfig):
    """The tokenizer the arch itself brings: open_clip's BPE for ``open_clip:<name>``, the Hugging Face tokenizer
    of ``model.tokenizer`` (a local folder) for ``hf_clip``; ``None`` where the caller builds our word tokenizer
    from its captions."""
    if cfg.arch.startswith("open_clip:"):
        from reprlab.methods.otcclip.openclip_adapter import OpenCLIPTokenizer

        return OpenCLIPTokenizer.for_config(cfg)
    if cfg.arch == "hf_clip" and cfg.tokenizer:
        from transformers import AutoTokenizer

        from reprlab.methods.otcclip.hf_adapter import HFTokenizerAdapter

        return HFTokenizerAdapter(AutoTokenizer.from_pretrained(cfg.tokenizer))
    return None


def _open_clip(name: str, pretrained: str = "") -> nn.Module:
    """An open_clip architecture behind the TinyCLIP interface [issue 11 item 5] (``openclip_adapter``), imported
    only when asked for."""
    from reprlab.errors import ModelNotAvailableError

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
    from reprlab.methods.otcclip.openclip_adapter import build

    return build(name, pretrained)
