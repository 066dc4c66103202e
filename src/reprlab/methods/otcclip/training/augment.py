"""The trainer's augmentations: random translation and brightness of images, EDA-style word dropout of captions.

Both draw from a generator the trainer seeds by (seed, epoch, step) for the whole global batch, so every rank
draws the same stream and a multi-rank run sees exactly the single-process batches.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def augment_images(
    images: torch.Tensor,
    g: torch.Generator,
    shift: int,
    brightness: float,
    rows: slice | None = None,
    device: torch.device | None = None,
) -> torch.Tensor:
    """Random translation (zero fill) and brightness of ``uint8 (B, C, H, W)`` -> float in [-1, 1].

    The random draws cover all B images (so every rank draws the same stream); only ``rows`` (default all) are
    computed, on ``device`` (default the images'): a rank augments its own rows, on its accelerator, rather
    than the whole global batch on the CPU. Returns ``(len(rows), C, H, W)``.
    """
    b, _, h, w = images.shape
    dx = torch.randint(0, 2 * shift + 1, (b,), generator=g).tolist()
    dy = torch.randint(0, 2 * shift + 1, (b,), generator=g).tolist()
    scale = 1 + (torch.rand(b, 1, 1, 1, generator=g) * 2 - 1) * brightness
    rows = rows or slice(0, b)
    padded = F.pad(images[rows].to(device).float(), (shift,) * 4)
    out = torch.stack(
        [
            padded[i - rows.start, :, dy[i] : dy[i] + h, dx[i] : dx[i] + w]
            for i in range(rows.start, rows.stop)
        ]
    )
    return (out * scale[rows].to(out.device)).clamp(0, 255) / 127.5 - 1.0


def drop_words(
    ids: torch.Tensor, mask: torch.Tensor, g: torch.Generator, p: float, keep_ids=()
) -> tuple[torch.Tensor, torch.Tensor]:
    """Delete each word with probability p (at least one kept), re-packing left. ``(B, pos)`` each.

    ``keep_ids``: the tokenizer's special ids (``special_ids``: open_clip's SOT/EOT, a HF CLIP tokenizer's
    BOS/EOS), never dropped; the stable re-packing keeps them in place (SOT first, EOT right after the last kept
    word), so EOT/EOS pooling still reads the EOT. Empty (our word tokenizer): the original rule, bit for bit.
    """
    keep = mask & (torch.rand(ids.shape, generator=g) >= p)
    if len(keep_ids):
        special = mask & torch.isin(ids, torch.as_tensor(list(keep_ids), dtype=ids.dtype))
        word = mask & ~special
        keep = (keep & word) | special
        # at least one word kept: the first one, where every word of a row was dropped
        rows = torch.nonzero(word.any(1) & ~(keep & word).any(1)).flatten()
        keep[rows, word[rows].to(torch.int8).argmax(1)] = True
    else:
        keep[:, 0] |= ~keep.any(1)
    order = torch.argsort((~keep).to(torch.int8), dim=1, stable=True)
    return torch.gather(ids * keep, 1, order), torch.gather(keep, 1, order)
