"""Adapter: any Hugging Face ``CLIPModel`` behind the TinyCLIP interface, so the trainer, the defenses,
the evaluation and the audit run unchanged on pretrained CLIP weights (for users who have them).

Fine-grained features (as TinyCLIP's, :mod:`.tiny`): image patches are the last-layer patch tokens after the
vision ``post_layernorm`` and ``visual_projection``; caption tokens are the last-layer text states (after
``final_layer_norm``) times ``text_projection``, masked by the attention mask. Global features are HF's
own pooled + projected embeddings. [ours: applying ``post_layernorm`` to patch tokens, which HF applies
only to the pooled CLS token, so that patches and the global embedding share one normalisation.]
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from reprlab.methods.otcclip.models.features import (
    LOGIT_SCALE_MAX,
    AdapterSizes,
    ImageFeatures,
    TextFeatures,
    clip_pixels,
)


def clip_config(cfg, vocab_size: int):
    """A ``transformers.CLIPConfig`` from our ``ModelConfig`` sizes (MLP width 4x, as CLIP), for training from
    scratch; token ids 0 (pad) and 1 are inside any vocabulary (our word tokenizer has no BOS/EOS)."""
    from transformers import CLIPConfig

    return CLIPConfig(
        text_config=dict(
            vocab_size=vocab_size,
            hidden_size=cfg.text_width,
            intermediate_size=4 * cfg.text_width,
            num_hidden_layers=cfg.text_layers,
            num_attention_heads=cfg.text_heads,
            max_position_embeddings=cfg.max_len,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=1,
        ),
        vision_config=dict(
            image_size=cfg.image_size,
            patch_size=cfg.patch_size,
            hidden_size=cfg.width,
            intermediate_size=4 * cfg.width,
            num_hidden_layers=cfg.layers,
            num_attention_heads=cfg.heads,
        ),
        projection_dim=cfg.embed_dim,
    )


def processor_stats(folder: str | None = None) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Image mean and std of a local CLIP processor folder (``preprocessor_config.json``), else the CLIP image
    processor's defaults (OpenAI CLIP's)."""
    from transformers.image_utils import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD

    path = Path(folder) / "preprocessor_config.json" if folder else None
    if path is not None and path.exists():
        pc = json.loads(path.read_text())
        return tuple(pc.get("image_mean", OPENAI_CLIP_MEAN)), tuple(pc.get("image_std", OPENAI_CLIP_STD))
    return tuple(OPENAI_CLIP_MEAN), tuple(OPENAI_CLIP_STD)


class HFCLIPAdapter(nn.Module):
    """Wrap ``transformers.CLIPModel``.

    Args:
        clip: the model.
        max_len: caption length (defaults to the text model's ``max_position_embeddings``).
        pixel_norm: ``(mean, std)`` per channel: inputs are then in [-1, 1] (as the trainer and the evaluation
            give them) and are mapped to the processor's normalisation, ``((x + 1) / 2 - mean) / std``;
            ``None``: inputs are already normalised for the model.
        text_pool: ``"eos"`` (HF's pooled output, CLIP's EOS token) or ``"mean"`` (masked mean of the projected
            tokens, for tokenizers without EOS, as TinyCLIP) [ours].
    """

    def __init__(self, clip, max_len: int | None = None, pixel_norm=None, text_pool: str = "eos"):
        super().__init__()
        self.clip = clip
        vc, tc = clip.config.vision_config, clip.config.text_config
        self.image_size = vc.image_size
        self.cfg = AdapterSizes(max_len or tc.max_position_embeddings, clip.config.projection_dim)
        if text_pool not in ("eos", "mean"):
            raise ValueError(f"text_pool must be 'eos' or 'mean'; got {text_pool!r}")
        self.text_pool = text_pool
        self.pixel_norm = pixel_norm is not None
        mean, std = pixel_norm if pixel_norm is not None else ((0.0,) * 3, (1.0,) * 3)
        self.register_buffer("pixel_mean", torch.tensor(mean).view(1, -1, 1, 1), persistent=False)
        self.register_buffer("pixel_std", torch.tensor(std).view(1, -1, 1, 1), persistent=False)

    @classmethod
    def from_config(cls, config, cfg) -> HFCLIPAdapter:
        """A randomly initialised CLIP of ``config`` for training from scratch with our ``ModelConfig`` ``cfg``:
        the processor's mean/std (``cfg.tokenizer``'s folder or CLIP's defaults), EOS pooling with a HF tokenizer,
        mean pooling with our word tokenizer."""
        from transformers import AutoTokenizer, CLIPModel

        if cfg.tokenizer:
            # HF pools at the first id == eos_token_id: the tokenizer's EOS, not clip_config's 1 (the word tokenizer)
            tok = AutoTokenizer.from_pretrained(cfg.tokenizer)
            config.text_config.eos_token_id = tok.eos_token_id
            config.text_config.bos_token_id = tok.bos_token_id
        return cls(
            CLIPModel(config),
            cfg.max_len,
            pixel_norm=processor_stats(cfg.tokenizer or None),
            text_pool="eos" if cfg.tokenizer else "mean",
        )

    @property
    def logit_scale(self) -> nn.Parameter:
        return self.clip.logit_scale

    def scale(self) -> torch.Tensor:
        return self.clip.logit_scale.clamp(max=LOGIT_SCALE_MAX).exp()

    def _pixels(self, images: torch.Tensor) -> torch.Tensor:
        return clip_pixels(images, self.pixel_mean, self.pixel_std, self.image_size, self.pixel_norm)

    def encode_image(self, images: torch.Tensor) -> ImageFeatures:
        """Args: images ``float (batch, C, H, W)``: in [-1, 1] with ``pixel_norm``, else normalised for the model."""
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
        w = mask.unsqueeze(-1).to(tokens.dtype)
        if self.text_pool == "mean":
            global_ = (tokens * w).sum(1) / w.sum(1).clamp_min(1.0)
        else:
            global_ = self.clip.text_projection(out.pooler_output)
        return TextFeatures(F.normalize(global_, dim=-1), F.normalize(tokens, dim=-1) * w, mask)


def hf_special_ids(tokenizer) -> tuple[int, ...]:
    """BOS/EOS (CLS/SEP) ids of a transformers tokenizer: the sequence markers, not unk or a distinct pad."""
    ids = {getattr(tokenizer, f"{k}_token_id", None) for k in ("bos", "eos", "cls", "sep")}
    return tuple(sorted(i for i in ids if isinstance(i, int)))


class HFTokenizerAdapter:
    """A Hugging Face tokenizer behind the ``WordTokenizer`` interface (``encode``/``decode``)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.special_ids = hf_special_ids(tokenizer)  # never dropped by word dropout (EOS pooling reads EOS)

    def __len__(self) -> int:
        return len(self.tokenizer)

    def encode(self, texts, max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        enc = self.tokenizer(
            list(texts), padding="max_length", truncation=True, max_length=max_len, return_tensors="pt"
        )
        return enc["input_ids"], enc["attention_mask"].bool()

    def decode(self, ids: torch.Tensor) -> list[str]:
        return self.tokenizer.batch_decode(ids, skip_special_tokens=True)


def load_hf_model(model_id: str, max_len: int = 77):
    """A Hugging Face CLIP (hub id or local folder) and its tokenizer, behind our interfaces."""
    from transformers import AutoTokenizer, CLIPModel

    clip = CLIPModel.from_pretrained(model_id)
    # the audit's images are in [-1, 1] like the trainer's; the adapter maps them to the processor's mean/std
    norm = processor_stats(_processor_folder(model_id))
    tok = HFTokenizerAdapter(AutoTokenizer.from_pretrained(model_id))
    return HFCLIPAdapter(clip, max_len, pixel_norm=norm), tok


def _processor_folder(model_id: str) -> str | None:
    """The folder holding ``model_id``'s ``preprocessor_config.json``: the local folder itself, or the hub
    cache's snapshot (never a download); ``None`` falls back to OpenAI CLIP's statistics."""
    if Path(model_id).is_dir():
        return model_id
    try:
        from huggingface_hub import try_to_load_from_cache

        hit = try_to_load_from_cache(model_id, "preprocessor_config.json")
    except Exception:  # an id the cache cannot parse: use the defaults
        return None
    return str(Path(hit).parent) if isinstance(hit, str) else None
