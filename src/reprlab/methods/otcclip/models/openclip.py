"""Adapter: an open_clip model (open-clip-torch) behind the TinyCLIP interface, so the trainer, the defenses, the
streamed path and the evaluation run unchanged on open_clip architectures [ours: open_clip is where CLIP ViT and
ResNet towers are commonly built and kept].

``model.arch=open_clip:<name>`` builds, randomly initialised, any of open_clip's model configs
(``open_clip.list_models()``: ``ViT-B-32``, ``RN50``...), a model-config JSON file (open_clip's flat format,
``embed_dim``/``vision_cfg``/``text_cfg``, or its ``open_clip_config.json`` format with ``model_cfg`` and
``preprocess_cfg``), or a ``local-dir`` folder holding ``open_clip_config.json`` and weights; the packaged
``reprlab-tiny-vit`` is the CPU recipe's tiny ViT. ``model.pretrained`` loads weights from a local file (never a
hub download).

Fine-grained features (as TinyCLIP's, :mod:`.tiny`), read from open_clip's own forward pass:

- ViT towers: global = open_clip's ``encode_image``; patches = the tower's patch tokens after ``ln_post``, times
  ``visual.proj`` (open_clip's ``output_tokens`` output; with ``final_ln_after_pool`` the adapter applies
  ``ln_post`` to the tokens too, so patches and the global embedding share one normalisation [ours]).
- ModifiedResNet towers (RN50...): global = open_clip's ``encode_image`` (the attention pool's mean-token query);
  patches = the attention pool's spatial outputs (its HW other queries, projected by ``c_proj`` [ours: the 49
  spatial outputs of a ResNet-50, as the baselines' model code pools only the first]), the attention recomputed
  with the pool's own weights from its input (tested: its first row equals open_clip's output).
- Text (open_clip's ``TextTransformer``, in ``CLIP`` or ``CustomTextCLIP``): global = open_clip's
  ``encode_text``; tokens = the last layer after ``ln_final`` (read by a hook in the same forward pass) times
  ``text_projection``, masked by ``ids != 0`` (open_clip pads with 0; SOT and EOT are kept).

Images: the trainer and the evaluation give pixels in [-1, 1]; the adapter maps them to the model's own
preprocess_cfg mean/std (``((x + 1) / 2 - mean) / std``), greyscale to 3 channels, and resizes (bilinear) only
when the input is not at the model's size (the streamed path already decodes at ``preprocess_cfg['size']``,
shortest side bicubic + centre crop, as open_clip's ``resize_mode='shortest'``).
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from reprlab.errors import ConfigError
from reprlab.methods.otcclip.models.features import (
    LOGIT_SCALE_MAX,
    AdapterSizes,
    ImageFeatures,
    TextFeatures,
    clip_pixels,
)
from reprlab.methods.otcclip.models.hf import hf_special_ids

TINY_CONFIG = Path(__file__).parent / "reprlab-tiny-vit.json"
SUPPORTED_TOWERS = (
    "image: open_clip VisionTransformer (pool_type 'tok' or 'avg', no attentional pool) or ModifiedResNet "
    "(RN50...); text: open_clip TextTransformer"
)
_REGISTERED: dict[str, str] = {}


def _register_json(path: Path) -> tuple[str, dict]:
    """Register a model-config JSON with open_clip under a private name; returns (name, preprocess_cfg)."""
    import open_clip

    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise ConfigError(f"model.arch open_clip:{path}: cannot read the model config JSON ({err})") from err
    model_cfg = raw.get("model_cfg", raw)
    if not all(k in model_cfg for k in ("embed_dim", "vision_cfg", "text_cfg")):
        raise ConfigError(
            f"model.arch open_clip:{path}: not an open_clip model config (needs embed_dim, vision_cfg, text_cfg, "
            "at the top level or under model_cfg)"
        )
    key = str(path.resolve())
    if key not in _REGISTERED:
        # open_clip registers configs from files named <model name>.json: a private copy without preprocess_cfg
        folder = Path(tempfile.mkdtemp(prefix="reprlab-openclip-"))
        atexit.register(shutil.rmtree, folder, True)
        name = f"reprlab-{len(_REGISTERED)}-{path.stem}"
        (folder / f"{name}.json").write_text(json.dumps(model_cfg))
        open_clip.add_model_config(folder / f"{name}.json")
        _REGISTERED[key] = name
    return _REGISTERED[key], raw.get("preprocess_cfg", {})


def create_openclip(name: str, pretrained: str = "") -> nn.Module:
    """The open_clip model ``name`` (module docstring), random init or ``pretrained``'s weights (a local file).

    Raises:
        ConfigError: unknown name, a hub name or tag, a missing weights file.
    """
    import open_clip

    force_pp: dict = {}
    name = _alias(name)
    if name.startswith("hf-hub:"):
        raise ConfigError(
            f"model.arch open_clip:{name}: hub models are not downloaded; give a local folder or file"
        )
    path = Path(name.removeprefix("local-dir:"))
    if name.startswith("local-dir:") or path.is_dir():
        if not (path / "open_clip_config.json").is_file():
            raise ConfigError(f"model.arch open_clip:{name}: {path} has no open_clip_config.json")
        if pretrained:
            raise ConfigError(
                "model.pretrained: a local-dir model loads the weights in its folder; leave it empty"
            )
        return open_clip.create_model(f"local-dir:{path}")
    if name.endswith(".json"):
        if not path.is_file():
            raise ConfigError(f"model.arch open_clip:{name}: no such model config file")
        name, force_pp = _register_json(path)
    elif name not in open_clip.list_models():
        raise ConfigError(
            f"model.arch open_clip:{name} is not an open_clip model config; choose one of open_clip.list_models() "
            f"(e.g. ViT-B-32, RN50), 'reprlab-tiny-vit', a model config .json or a folder with "
            "open_clip_config.json"
        )
    if pretrained and not os.path.isfile(pretrained):
        raise ConfigError(
            f"model.pretrained {pretrained!r} is not a file: give a local checkpoint (open_clip state dict); "
            "pretrained tags are not downloaded"
        )
    with _quiet_random_init():
        return open_clip.create_model(
            name, pretrained=pretrained or None, force_preprocess_cfg=force_pp or None
        )


class _quiet_random_init(logging.Filter):
    """Drop open_clip's root-logger warning that a model without ``pretrained`` is randomly initialised (the
    intended case here: training from scratch), while the model is created."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "No pretrained weights loaded" not in record.getMessage()

    def __enter__(self):
        logging.getLogger().addFilter(self)

    def __exit__(self, *exc):
        logging.getLogger().removeFilter(self)


class OpenCLIPAdapter(nn.Module):
    """Wrap an open_clip ``CLIP`` / ``CustomTextCLIP`` (module docstring).

    Args:
        clip: the model.
        pixel_norm: apply the model's preprocess_cfg mean/std to inputs in [-1, 1] (``False``: inputs are already
            normalised for the model).

    Raises:
        ConfigError: a tower the adapter cannot read patch or token features from (``SUPPORTED_TOWERS``).
    """

    def __init__(self, clip, pixel_norm: bool = True):
        super().__init__()
        from open_clip import get_model_preprocess_cfg
        from open_clip.modified_resnet import ModifiedResNet
        from open_clip.transformer import TextTransformer, VisionTransformer

        self.clip = clip
        vis = clip.visual
        if isinstance(vis, VisionTransformer):
            if vis.attn_pool is not None or vis.pool_type not in ("tok", "avg"):
                raise ConfigError(
                    "open_clip ViT with an attentional pool or pool_type 'none' (CoCa-style) is not supported; "
                    f"supported towers: {SUPPORTED_TOWERS}"
                )
            self.tower = "vit"
        elif isinstance(vis, ModifiedResNet):
            self.tower = "resnet"
        else:
            raise ConfigError(
                f"open_clip image tower {type(vis).__name__} (timm or other) exposes no patch features here; "
                f"supported towers: {SUPPORTED_TOWERS}"
            )
        text = getattr(clip, "text", None)
        if text is not None and (not isinstance(text, TextTransformer) or text.cls_emb is not None):
            raise ConfigError(
                f"open_clip text tower {type(text).__name__} (HF or CoCa-style) is not supported; supported "
                f"towers: {SUPPORTED_TOWERS}"
            )
        self._ln_final = clip.ln_final if text is None else text.ln_final
        self._text_proj = clip.text_projection if text is None else text.text_projection
        pp = get_model_preprocess_cfg(clip)
        size = pp.get("size", vis.image_size)
        size = size if isinstance(size, int) else tuple(size)
        if not isinstance(size, int) and size[0] != size[1]:
            raise ConfigError(f"open_clip model with a non-square input {size} is not supported")
        self.image_size = size if isinstance(size, int) else size[0]
        self.preprocess_cfg = pp
        context = clip.context_length if text is None else text.context_length
        self.cfg = AdapterSizes(int(context), int(vis.output_dim))
        self.pixel_norm = pixel_norm
        self.register_buffer("pixel_mean", torch.tensor(pp["mean"]).view(1, -1, 1, 1), persistent=False)
        self.register_buffer("pixel_std", torch.tensor(pp["std"]).view(1, -1, 1, 1), persistent=False)

    @property
    def logit_scale(self) -> nn.Parameter:
        return self.clip.logit_scale

    def scale(self) -> torch.Tensor:
        return self.clip.logit_scale.clamp(max=LOGIT_SCALE_MAX).exp().reshape(())

    def _pixels(self, images: torch.Tensor) -> torch.Tensor:
        """Greyscale -> 3 channels, the model's preprocess_cfg mean/std (with ``pixel_norm``), its input size."""
        return clip_pixels(images, self.pixel_mean, self.pixel_std, self.image_size, self.pixel_norm)

    # ------------------------------------------------------------------ image
    def encode_image(self, images: torch.Tensor) -> ImageFeatures:
        """Args: images ``float (batch, C, H, W)``: in [-1, 1] with ``pixel_norm``, else normalised for the model."""
        x = self._pixels(images)
        if self.tower == "vit":
            global_, patches = self._vit(x)
        else:
            global_, patches = self._resnet(x)
        mask = torch.ones(patches.shape[:2], dtype=torch.bool, device=patches.device)
        return ImageFeatures(F.normalize(global_, dim=-1), F.normalize(patches, dim=-1), mask)

    def _vit(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        vis = self.clip.visual
        flag = vis.output_tokens
        vis.output_tokens = True  # open_clip's forward then also returns the patch tokens
        try:
            global_, tokens = vis(x)
        finally:
            vis.output_tokens = flag
        if vis.final_ln_after_pool:  # tokens come before ln_post then
            tokens = vis.ln_post(tokens)
        return global_, tokens @ vis.proj if vis.proj is not None else tokens

    def _resnet(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        pool = self.clip.visual.attnpool
        seen: list[torch.Tensor] = []
        handle = pool.register_forward_pre_hook(lambda _m, args: seen.append(args[0]))
        try:
            global_ = self.clip.visual(x)
        finally:
            handle.remove()
        return global_, attnpool_queries(pool, seen[0])[:, 1:]

    # ------------------------------------------------------------------ text
    def encode_text(self, ids: torch.Tensor, mask: torch.Tensor) -> TextFeatures:
        """Args: ids ``int64 (batch, context_length)`` from :class:`OpenCLIPTokenizer`, mask ``bool`` (same shape)."""
        n, ctx = ids.shape[1], self.cfg.max_len
        if n > ctx:
            raise ValueError(f"{n} token positions exceed the model's context length {ctx}")
        full = F.pad(ids, (0, ctx - n)) if n < ctx else ids  # open_clip adds all ctx positional embeddings
        seen: list[torch.Tensor] = []
        handle = self._ln_final.register_forward_hook(lambda _m, _a, out: seen.append(out))
        try:
            global_ = self.clip.encode_text(full)
        finally:
            handle.remove()
        # causal attention: positions < n do not see the padding appended after them
        h, proj = seen[0][:, :n], self._text_proj
        if proj is None:
            tokens = h
        elif isinstance(proj, nn.Linear):
            tokens = proj(h)
        else:
            tokens = h @ proj
        w = mask.unsqueeze(-1).to(tokens.dtype)
        return TextFeatures(F.normalize(global_, dim=-1), F.normalize(tokens, dim=-1) * w, mask)


def attnpool_queries(pool, x: torch.Tensor) -> torch.Tensor:
    """Every query output of open_clip's ``AttentionPool2d`` on its input ``x (batch, C, H, W)``:
    ``(batch, 1 + H*W, output_dim)``; row 0 is the pooled embedding open_clip returns (its only output), rows 1..HW
    the spatial outputs (the patch features of a ResNet tower [ours]). The pool's own attention, weights, mean token and positional embedding."""
    b, c = x.shape[:2]
    seq = x.reshape(b, c, -1).permute(2, 0, 1)  # (HW, batch, C)
    seq = torch.cat([seq.mean(dim=0, keepdim=True), seq], dim=0) + pool.positional_embedding[:, None].to(
        x.dtype
    )
    out, _ = F.multi_head_attention_forward(
        query=seq, key=seq, value=seq, embed_dim_to_check=c, num_heads=pool.num_heads,
        q_proj_weight=pool.q_proj.weight, k_proj_weight=pool.k_proj.weight, v_proj_weight=pool.v_proj.weight,
        in_proj_weight=None, in_proj_bias=torch.cat([pool.q_proj.bias, pool.k_proj.bias, pool.v_proj.bias]),
        bias_k=None, bias_v=None, add_zero_attn=False, dropout_p=0.0,
        out_proj_weight=pool.c_proj.weight, out_proj_bias=pool.c_proj.bias,
        use_separate_proj_weight=True, training=pool.training, need_weights=False,
    )  # fmt: skip
    return out.transpose(0, 1)


class OpenCLIPTokenizer:
    """open_clip's tokenizer (``open_clip.get_tokenizer``: CLIP's BPE, shipped in the package) behind the
    ``WordTokenizer`` interface (``encode``/``decode``/``len``). ``encode`` pads to ``max_len`` (the model's
    context length) with 0, SOT/EOT included, as open_clip."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        # ids word dropout never drops: SOT/EOT (open_clip's text tower pools at argmax(ids) = EOT)
        ids = {getattr(tokenizer, k, None) for k in ("sot_token_id", "eot_token_id")}
        ids |= set(getattr(tokenizer, "all_special_ids", ()) or ())
        # open_clip's HFTokenizer wraps a transformers tokenizer
        inner = getattr(tokenizer, "tokenizer", None)
        if inner is not None:
            ids |= set(hf_special_ids(inner))
        self.special_ids = tuple(sorted(i for i in ids if isinstance(i, int) and i != 0))

    @classmethod
    def for_arch(cls, name: str) -> OpenCLIPTokenizer:
        import open_clip

        name = _alias(name)
        if name.endswith(".json"):
            name = _register_json(Path(name))[0]
        elif Path(name.removeprefix("local-dir:")).is_dir():
            name = f"local-dir:{name.removeprefix('local-dir:')}"
        return cls(open_clip.get_tokenizer(name))

    @classmethod
    def for_config(cls, model_cfg) -> OpenCLIPTokenizer:
        """The tokenizer of ``model.arch=open_clip:<name>``."""
        return cls.for_arch(model_cfg.arch.partition(":")[2])

    def __len__(self) -> int:
        return int(getattr(self.tokenizer, "vocab_size", 49408))

    def save(self, path) -> None:
        """What identifies the tokenizer (it ships in open_clip): its class and context length."""
        Path(path).write_text(
            json.dumps(
                {"open_clip": type(self.tokenizer).__name__, "context_length": self.tokenizer.context_length}
            )
        )

    def encode(self, texts, max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        ids = self.tokenizer(list(texts), context_length=max_len).long()
        return ids, ids != 0

    def decode(self, ids: torch.Tensor) -> list[str]:
        special = set(self.special_ids)
        return [
            self.tokenizer.decode([t for t in row.tolist() if t != 0 and t not in special]).strip()
            for row in ids
        ]


def _alias(name: str) -> str:
    """Our packaged tiny config's short name (``reprlab-tiny-vit``) as its file; other names unchanged."""
    return str(TINY_CONFIG) if name == "reprlab-tiny-vit" else name


def model_config(name: str) -> dict:
    """open_clip's ``model_cfg`` of ``model.arch=open_clip:<name>`` (``embed_dim``, ``vision_cfg``, ``text_cfg``...):
    a built-in config, a model-config JSON (or ``reprlab-tiny-vit``), or a ``local-dir`` folder's."""
    import open_clip

    name = _alias(name)
    path = Path(name.removeprefix("local-dir:"))
    if name.startswith("local-dir:") or path.is_dir():
        return json.loads((path / "open_clip_config.json").read_text())["model_cfg"]
    if name.endswith(".json"):
        name = _register_json(path)[0]
    return open_clip.get_model_config(name)


def build(name: str, pretrained: str = "") -> OpenCLIPAdapter:
    """``model.arch=open_clip:<name>`` (with ``model.pretrained``) as the trainer's model."""
    return OpenCLIPAdapter(create_openclip(name, pretrained))


__all__ = [
    "OpenCLIPAdapter",
    "OpenCLIPTokenizer",
    "SUPPORTED_TOWERS",
    "attnpool_queries",
    "build",
    "create_openclip",
    "model_config",
]
