"""``model:``: the architecture (``arch``) and, for our TinyCLIP and a from-scratch ``hf_clip``, its sizes."""

from __future__ import annotations

from dataclasses import dataclass, field

from reprlab.errors import ConfigError


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

    def __post_init__(self) -> None:
        # the sizes build our TinyCLIP and a from-scratch hf_clip; an open_clip config brings its own
        if self.arch not in ("tiny", "hf_clip"):
            return
        for width, heads in (("width", "heads"), ("text_width", "text_heads")):
            w, h = getattr(self, width), getattr(self, heads)
            if h < 1 or w % h:
                raise ConfigError(
                    f"model.{heads} ({h}) must divide model.{width} ({w}): each head takes width / heads channels"
                )
