"""Tiny CLIP trained from scratch: a ViT image encoder and a text transformer that expose fine-grained
features (patch tokens, word tokens) next to the pooled global embeddings [ours; sizes by config].

Both encoders are pre-LayerNorm transformers. The image side pools with a CLS token (as CLIP ViT);
the text side is bidirectional with a padding mask and mean-pools its projected tokens [ours: the
word-level tokenizer has no EOS token to pool on]. Fine-grained features are the last-layer outputs
after the final LayerNorm and the projection into the joint space, L2-normalised [ours: the paper's abstract
names patch-token OT but not the layer; the last projected layer is where the global embeddings live].
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from reprlab.methods.otcclip.config import ModelConfig
from reprlab.methods.otcclip.models.features import LOGIT_SCALE_MAX, ImageFeatures, TextFeatures


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
