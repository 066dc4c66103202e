"""Batched, eval-mode, gradient-free embeddings of images and captions, for any model of :mod:`.features`' interface
(evaluation, SafeCLIP's split, the audit)."""

from __future__ import annotations

import torch

from reprlab.methods.otcclip.data.transforms import to_input


class _EvalMode:
    def __init__(self, model):
        self.model, self.was_training = model, model.training

    def __enter__(self):
        self.model.eval()

    def __exit__(self, *exc):
        self.model.train(self.was_training)


def _device(model) -> torch.device:
    return next(model.parameters()).device


@torch.no_grad()
def embed_images(model, images: torch.Tensor, batch_size: int = 512) -> torch.Tensor:
    """Global image embeddings ``(N, d)`` (normalised) of ``uint8 (N, C, H, W)`` images."""
    dev, out = _device(model), []
    with _EvalMode(model):
        for s in range(0, len(images), batch_size):
            out.append(model.encode_image(to_input(images[s : s + batch_size]).to(dev)).global_.cpu())
    return torch.cat(out)


@torch.no_grad()
def embed_texts(model, ids: torch.Tensor, mask: torch.Tensor, batch_size: int = 1024) -> torch.Tensor:
    """Global caption embeddings ``(N, d)`` of ``ids/mask (N, pos)``."""
    dev, out = _device(model), []
    with _EvalMode(model):
        for s in range(0, len(ids), batch_size):
            out.append(
                model.encode_text(
                    ids[s : s + batch_size].to(dev), mask[s : s + batch_size].to(dev)
                ).global_.cpu()
            )
    return torch.cat(out)
