"""Evaluation on the user's own images: the summary keys of :mod:`.testbed` (``zeroshot_acc``,
``linear_probe_acc``, ``asr_targeted``, ``asr_backdoor``) from ImageFolders and a poison manifest.

* Zero-shot [CLIP]: the classes of ``eval.zeroshot_dir`` (folder names or a JSON), each embedded as the mean of
  its prompts (``eval.templates``, else CLIP's 80 ImageNet templates); top-1 over the folder's images.
* Linear probe [CLIP's protocol]: scikit-learn logistic regression on frozen, normalised image embeddings,
  fitted on ``eval.probe_train_dir`` and scored on ``eval.probe_test_dir`` (else the zero-shot folder).
* ASR_targeted [RoCLIP]: share of the manifest's target images (its ``targets/`` copies) classified as their
  adversarial class. ASR_backdoor [CleanCLIP]: share of the zero-shot folder's images whose class is not the
  backdoor target that, with the manifest's trigger applied (same kind, seed and parameters, at the size it
  was planted at, then fitted to the model's input), are classified as the target. A manifest with several
  backdoors (one per trigger) gives ``asr_backdoor_<trigger>`` for each and ``asr_backdoor`` their mean [ours].

Class names the manifest names must be classes of the zero-shot folder. Images are decoded once per input size
and reused for every defense of a run.
"""

from __future__ import annotations

from pathlib import Path

import torch

from reprlab.errors import DataError
from reprlab.methods.otcclip.config import EvalConfig
from reprlab.methods.otcclip.data.folder import ImageFolder, image_folder, load_images
from reprlab.methods.otcclip.data.mosaic import class_prompts
from reprlab.methods.otcclip.data.pairs import LabeledSet
from reprlab.methods.otcclip.data.poison_io import read_manifest
from reprlab.methods.otcclip.data.templates import load_templates
from reprlab.methods.otcclip.data.transforms import fit_image, model_transform, to_uint8
from reprlab.methods.otcclip.data.triggers import apply_trigger
from reprlab.methods.otcclip.evaluation import metrics as ev


class FolderEval:
    """The folder evaluation of a run: indexes the folders and reads the manifest at construction (errors before
    any training), decodes images on first use at the model's input size, then evaluates any model.

    Args:
        cfg: the ``eval:`` section. manifest: the poison manifest to use when ``cfg.poison_manifest`` is ''.
        seed: the seed of the ``max_per_class`` subsets.
    """

    def __init__(self, cfg: EvalConfig, manifest: str | Path = "", seed: int = 0):
        if not cfg.zeroshot_dir:
            raise DataError("eval.zeroshot_dir is empty: the folder evaluation needs an ImageFolder")
        self.cfg, self.seed = cfg, seed
        self.zs = self._folder(cfg.zeroshot_dir, "eval.zeroshot_dir")
        self.names = self.zs.class_names
        self.templates = load_templates(cfg.templates)
        self.probe_train = (
            self._folder(cfg.probe_train_dir, "eval.probe_train_dir") if cfg.probe_train_dir else None
        )
        self.probe_test = (
            self._folder(cfg.probe_test_dir, "eval.probe_test_dir") if cfg.probe_test_dir else None
        )
        for f in (self.probe_train, self.probe_test):
            if f is not None and f.class_names != self.names:
                raise DataError(
                    f"{f.root}: class folders {list(f.class_names)} differ from eval.zeroshot_dir's"
                )
        path = cfg.poison_manifest or manifest
        self.manifest = read_manifest(path) if path else None
        self.targets, self.backdoors = None, []
        if self.manifest is not None:
            self._check_manifest(str(path))
        self._cache: dict = {}

    def _folder(self, root: str, key: str) -> ImageFolder:
        return image_folder(root, self.cfg.class_names, self.cfg.max_per_class, self.seed, key=key)

    def _class(self, name: str, path: str) -> int:
        if name not in self.names:
            raise DataError(
                f"{path}: class {name!r} is not a class of eval.zeroshot_dir {self.zs.root} ({list(self.names)})",
                hint="name the classes as the poison did (eval.class_names maps folder names to class names)",
            )
        return self.names.index(name)

    def _check_manifest(self, path: str) -> None:
        m, root = self.manifest, Path(self.manifest["_dir"])
        if m["targeted"]:
            self.targets = [(root / t["image"], self._class(t["target_class"], path)) for t in m["targeted"]]
        self.backdoors = [(b["trigger"], self._class(b["target_class"], path)) for b in m["backdoors"]]

    def info(self) -> dict:
        """What the evaluation runs on, for ``analysis/data.json`` (and the poison rate of the manifest)."""
        out = {
            "eval_zeroshot_dir": str(self.zs.root),
            "eval_classes": list(self.names),
            "eval_n_zeroshot": len(self.zs),
            "eval_n_templates": len(self.templates),
            "eval_n_probe_train": len(self.probe_train) if self.probe_train is not None else 0,
        }
        if self.manifest is not None:
            m = self.manifest
            out["poison_manifest"] = str(Path(m["_dir"]) / "manifest.json")
            out["n_targets"] = len(m["targeted"])
            out["n_poisoned"] = len(m["planted"])
            if m.get("n_samples"):
                out["poison_rate"] = len(m["planted"]) / m["n_samples"]
            if m["backdoors"]:
                out["trigger"] = ", ".join(b["trigger"]["kind"] for b in m["backdoors"])
                out["backdoor_target"] = m["backdoors"][0]["target_class"]
        return out

    def prompts(self) -> list[str]:
        """Every zero-shot prompt (for a word vocabulary built before training)."""
        return [p for row in class_prompts(self.names, self.templates) for p in row]

    def _images(self, size: int, channels: int) -> dict:
        key = (size, channels)
        if key not in self._cache:
            zs = self.zs
            out = {
                "zs": LabeledSet(
                    load_images(zs.paths, size, channels, "eval: zero-shot"), torch.from_numpy(zs.labels)
                )
            }
            for name, f in (("probe_train", self.probe_train), ("probe_test", self.probe_test)):
                if f is not None:
                    out[name] = LabeledSet(
                        load_images(f.paths, size, channels, f"eval: {name}"), torch.from_numpy(f.labels)
                    )
            if self.targets:
                out["targets"] = load_images([p for p, _ in self.targets], size, channels, "eval: targets")
            out["triggered"] = [
                self._triggered(trig, target, size, channels) for trig, target in self.backdoors
            ]
            self._cache[key] = out
        return self._cache[key]

    def _triggered(self, trig: dict, target: int, size: int, channels: int) -> torch.Tensor:
        """The zero-shot folder's images of classes other than ``target``, triggered as planted (``trig``), fitted
        to ``size``."""
        from PIL import Image

        paths = [p for p, y in zip(self.zs.paths, self.zs.labels) if y != target]
        if not paths:
            raise DataError(f"eval.zeroshot_dir {self.zs.root}: no image outside the backdoor target class")
        s = trig["image_size"]
        x = load_images(paths, s, channels, "eval: triggered")
        x = apply_trigger(x, trig["kind"], trig["seed"], trig["patch"], trig["alpha"], **trig["params"])
        if s == size:
            return x
        arrs = [img[0].numpy() if channels == 1 else img.permute(1, 2, 0).numpy() for img in x]
        return torch.stack([to_uint8(fit_image(Image.fromarray(a), size)) for a in arrs])

    @torch.no_grad()
    def __call__(self, model, tok, max_len: int, probe: bool = True) -> dict[str, float]:
        """The summary keys for ``model`` (its tokenizer ``tok``); ``probe``: also the linear probe."""
        t = model_transform(model)
        data = self._images(t.size, t.channels)
        class_emb = ev.class_embeddings(model, tok, class_prompts(self.names, self.templates), max_len)
        out = {"zeroshot_acc": ev.zero_shot_accuracy(model, data["zs"], class_emb)}
        if probe and "probe_train" in data:
            test = data.get("probe_test", data["zs"])
            c, it = self.cfg.probe_c, self.cfg.probe_max_iter
            out["linear_probe_acc"] = ev.linear_probe_accuracy(model, data["probe_train"], test, c, it)
        if "targets" in data:
            want = torch.tensor([y for _, y in self.targets])
            out["asr_targeted"] = float(
                (ev.predict(model, data["targets"], class_emb) == want).float().mean()
            )
        asrs = []
        for (trig, target), images in zip(self.backdoors, data["triggered"]):
            asrs.append(float((ev.predict(model, images, class_emb) == target).float().mean()))
            if len(self.backdoors) > 1:
                out[f"asr_backdoor_{trig['kind']}"] = asrs[-1]
        if asrs:
            out["asr_backdoor"] = sum(asrs) / len(asrs)
        return out
