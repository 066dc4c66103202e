"""A trained OTCCLIP model in the formats its architecture's own library loads [ours: the folder layouts are the
libraries' own].

* ``model.arch=open_clip:<name>`` -> an open_clip model folder: ``open_clip_config.json`` (``model_cfg`` +
  ``preprocess_cfg``, the layout open_clip pushes to the hub) and ``open_clip_model.safetensors`` (the ``CLIP``
  state dict); ``open_clip.create_model_and_transforms("local-dir:<folder>")`` and
  ``open_clip.get_tokenizer("local-dir:<folder>")`` load it.
* ``model.arch=hf_clip`` -> ``CLIPModel.save_pretrained`` (``config.json``, ``model.safetensors``), the
  ``CLIPImageProcessor`` with the run's mean/std and input size, and the run's Hugging Face tokenizer when it had
  one (``model.tokenizer``): ``CLIPModel.from_pretrained`` / ``CLIPProcessor.from_pretrained`` load it.
* ``model.arch=tiny``, our own small ViT, has no third-party format (:class:`NoThirdPartyFormat`).

The exported ``logit_scale`` is the run's, clamped at :data:`~.features.LOGIT_SCALE_MAX` as the trainer uses it,
so the library's logits are reprlab's. Features: the libraries' own global image and text embeddings equal the
adapters' (``encode_image``/``get_image_features``; ``encode_text``/``get_text_features``), except the text of an
``hf_clip`` run trained with our word tokenizer: the adapter mean-pools the projected tokens there (the word
tokenizer has no EOS), ``get_text_features`` pools at the config's EOS id, so only the image tower, the text
tower's states and the vocabulary (``reprlab_word_vocab.json``) carry over; ``reprlab_export.json`` says so.
Each folder is written under a temporary name and renamed: a finished export or none.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from reprlab.errors import ConfigError
from reprlab.methods.otcclip.models.features import LOGIT_SCALE_MAX
from reprlab.runs.atomic import publish_dir, temp_sibling_dir


class NoThirdPartyFormat(ConfigError):
    """An architecture that no other library loads (our tiny ViT)."""


def _write(out: Path, fill) -> Path:
    """Fill a temporary sibling of ``out`` with ``fill(folder)``, then rename it onto ``out``."""
    tmp = temp_sibling_dir(Path(out))
    try:
        fill(tmp)
        return publish_dir(tmp, Path(out), replace=False)  # a user's folder: never deleted
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _clamped_scale(param: torch.Tensor) -> torch.Tensor:
    return param.detach().clamp(max=LOGIT_SCALE_MAX).clone()


def write_open_clip(adapter, model_cfg: dict, out: Path, note: str = "") -> Path:
    """An :class:`~.openclip.OpenCLIPAdapter`'s model as an open_clip ``local-dir`` folder (module docstring).

    Args:
        adapter: the trained adapter. model_cfg: open_clip's ``model_cfg`` of its arch
            (:func:`~.openclip.model_config`). out: the folder. note: a line for the README.
    """
    from safetensors.torch import save_file

    state = {k: v.detach().cpu().contiguous().clone() for k, v in adapter.clip.state_dict().items()}
    state["logit_scale"] = _clamped_scale(state["logit_scale"])
    pp = {k: list(v) if isinstance(v, tuple) else v for k, v in adapter.preprocess_cfg.items()}

    def fill(tmp: Path) -> None:
        save_file(state, str(tmp / "open_clip_model.safetensors"), metadata={"format": "pt"})
        config = {"model_cfg": model_cfg, "preprocess_cfg": pp}
        (tmp / "open_clip_config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
        (tmp / "README.md").write_text(
            f"# open_clip model exported by reprlab\n\n{note}\n\n```python\nimport open_clip\nmodel, _, preprocess = "
            'open_clip.create_model_and_transforms("local-dir:<this folder>")\ntokenizer = '
            'open_clip.get_tokenizer("local-dir:<this folder>")\n```\n',
            encoding="utf-8",
        )

    return _write(out, fill)


def write_hf(adapter, tokenizer, out: Path, note: str = "") -> Path:
    """An :class:`~.hf.HFCLIPAdapter`'s model as a transformers CLIP folder (module docstring).

    Args:
        adapter: the trained adapter. tokenizer: the run's tokenizer (``HFTokenizerAdapter`` or our word
            tokenizer). out: the folder. note: a line for the README.
    """
    from transformers import CLIPImageProcessor
    from transformers.image_utils import PILImageResampling

    clip = adapter.clip
    size = int(adapter.image_size)
    mean, std = (adapter.pixel_mean.flatten().tolist(), adapter.pixel_std.flatten().tolist())
    if not adapter.pixel_norm:  # the adapter took inputs already normalised: nothing to record but the size
        mean, std = [0.0, 0.0, 0.0], [1.0, 1.0, 1.0]
    processor = CLIPImageProcessor(
        image_mean=mean, image_std=std, size={"shortest_edge": size}, crop_size={"height": size, "width": size},
        resample=PILImageResampling.BICUBIC,
    )  # fmt: skip
    info = {"text_pool": adapter.text_pool, "max_len": adapter.cfg.max_len, "image_size": size, "note": note}
    if adapter.text_pool == "mean":
        info["text_features"] = (
            "the run mean-pooled the projected token states over the attention mask (its word tokenizer has no "
            "EOS); CLIPModel.get_text_features pools at eos_token_id instead and differs"
        )

    def fill(tmp: Path) -> None:
        saved = clip.logit_scale.detach().clone()
        try:
            with torch.no_grad():
                clip.logit_scale.copy_(_clamped_scale(saved))
            clip.save_pretrained(str(tmp))
        finally:
            with torch.no_grad():
                clip.logit_scale.copy_(saved)
        processor.save_pretrained(str(tmp))
        inner = getattr(tokenizer, "tokenizer", None)
        if inner is not None and hasattr(inner, "save_pretrained"):
            inner.save_pretrained(str(tmp))
        elif hasattr(tokenizer, "save"):
            tokenizer.save(tmp / "reprlab_word_vocab.json")
        (tmp / "reprlab_export.json").write_text(json.dumps(info, indent=2), encoding="utf-8")
        load = 'from transformers import CLIPModel\nmodel = CLIPModel.from_pretrained("<this folder>")'
        if inner is not None:
            load += '\nfrom transformers import CLIPProcessor\nprocessor = CLIPProcessor.from_pretrained("<this folder>")'
        extra = f"\n\nText features: {info['text_features']}.\n" if "text_features" in info else "\n"
        (tmp / "README.md").write_text(
            f"# CLIP model exported by reprlab\n\n{note}\n\n```python\n{load}\n```{extra}", encoding="utf-8"
        )

    return _write(out, fill)


def no_third_party_format(arch: str) -> NoThirdPartyFormat:
    return NoThirdPartyFormat(
        f"model.arch {arch!r} is reprlab's own tiny ViT: neither open_clip nor transformers can load it, so it "
        "has no --open-clip or --hf export",
        hint="train with model.arch=open_clip:<name> (exports --open-clip) or model.arch=hf_clip (exports --hf); "
        "a tiny run's weights load in reprlab with reprlab.methods.otcclip.models.run_model.load_run_model",
    )
