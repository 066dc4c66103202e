"""Adapter: any Hugging Face ``CLIPModel`` behind the TinyCLIP interface, so the trainer, the defenses,
the evaluation and the audit run unchanged on pretrained CLIP weights (for users who have them).

Fine-grained features follow brief §1.1: image patches are the last-layer patch tokens after the
vision ``post_layernorm`` and ``visual_projection``; caption tokens are the last-layer text states (after
``final_layer_norm``) times ``text_projection``, masked by the attention mask. Global features are HF's
own pooled + projected embeddings. [ours: applying ``post_layernorm`` to patch tokens, which HF applies
only to the pooled CLS token, so that patches and the global embedding share one normalisation.]
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from reprlab.methods.otcclip.model import LOGIT_SCALE_MAX, ImageFeatures, TextFeatures


@dataclass(frozen=True)
class AdapterSizes:
    """The two sizes the trainer reads from ``model.cfg``."""

    max_len: int
    embed_dim: int


class HFCLIPAdapter(nn.Module):
    """Wrap ``transformers.CLIPModel``.

    Args:
        clip: the model.
        max_len: caption length (defaults to the text model's ``max_position_embeddings``).
    """

    def __init__(self, clip, max_len: int | None = None):
        super().__init__()
        self.clip = clip
        vc, tc = clip.config.vision_config, clip.config.text_config
        self.image_size = vc.image_size
        self.cfg = AdapterSizes(max_len or tc.max_position_embeddings, clip.config.projection_dim)

    @property
    def logit_scale(self) -> nn.Parameter:
        return self.clip.logit_scale

    def scale(self) -> torch.Tensor:
        return self.clip.logit_scale.clamp(max=LOGIT_SCALE_MAX).exp()

    def _pixels(self, images: torch.Tensor) -> torch.Tensor:
        """Greyscale -> 3 channels and resize to the vision tower's input size."""
        if images.shape[1] == 1:
            images = images.expand(-1, 3, -1, -1)
        if images.shape[-1] != self.image_size or images.shape[-2] != self.image_size:
            images = F.interpolate(
                images, size=(self.image_size, self.image_size), mode="bilinear", align_corners=False
            )
        return images

    def encode_image(self, images: torch.Tensor) -> ImageFeatures:
        """Args: images ``float (batch, C, H, W)`` already normalised for the model."""
        out = self.clip.vision_model(pixel_values=self._pixels(images))
        vm = self.clip.vision_model
        patches = self.clip.visual_projection(
            vm.post_layernorm(out.last_hidden_state[:, 1:])
        )  # [batch, n, d]
        global_ = self.clip.visual_projection(out.pooler_output)
        mask = torch.ones(patches.shape[:2], dtype=torch.bool, device=patches.device)
        return ImageFeatures(F.normalize(global_, dim=-1), F.normalize(patches, dim=-1), mask)

    def encode_text(self, ids: torch.Tensor, mask: torch.Tensor) -> TextFeatures:
        """Args: ids ``int64 (batch, pos)`` in the model's vocabulary, mask ``bool (batch, pos)``."""
        out = self.clip.text_model(input_ids=ids, attention_mask=mask.long())
        tokens = self.clip.text_projection(out.last_hidden_state)  # [batch, pos, d]
        global_ = self.clip.text_projection(out.pooler_output)
        w = mask.unsqueeze(-1).to(tokens.dtype)
        return TextFeatures(F.normalize(global_, dim=-1), F.normalize(tokens, dim=-1) * w, mask)


class HFTokenizerAdapter:
    """A Hugging Face tokenizer behind the ``WordTokenizer`` interface (``encode``/``decode``)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def __len__(self) -> int:
        return len(self.tokenizer)

    def encode(self, texts, max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        enc = self.tokenizer(
            list(texts), padding="max_length", truncation=True, max_length=max_len, return_tensors="pt"
        )
        return enc["input_ids"], enc["attention_mask"].bool()

    def decode(self, ids: torch.Tensor) -> list[str]:
        return self.tokenizer.batch_decode(ids, skip_special_tokens=True)
