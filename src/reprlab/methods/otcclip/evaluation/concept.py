"""The nearest-neighbour caption's concept-match rate [ours]: the quantity that decides whether caption
re-matching (RoCLIP, OTCCLIP) can help on a data set.

For each clean training image whose caption is true (not a poison, not alt-text noise), take its nearest caption
by global cosine in a random bank of ``bank_size`` training captions (the image's own caption excluded, as in
RoCLIP's FIFO bank, which is queried before the batch's own captions enter) and ask whether that caption describes
the image's concept (the same ``sig``: the same class on the web-like testbed, the same scene on the mosaics).
On web data many images share a concept and the rate is high; on the mosaic testbed scenes seldom repeat
(``docs/otcclip_testbed.md`` compares them).
"""

from __future__ import annotations

import torch


def nn_concept_match(
    img: torch.Tensor,
    txt: torch.Tensor,
    sig: torch.Tensor,
    rows: torch.Tensor,
    bank_size: int,
    seed: int,
    chunk: int = 256,
) -> float:
    """Share of ``rows`` whose nearest bank caption has the row's own ``sig``.

    Args:
        img: ``(N, d)`` normalised image embeddings of the training pairs.
        txt: ``(N, d)`` normalised caption embeddings of the same pairs (row i is image i's own caption).
        sig: ``(N,)`` concept id of each caption (for the ``rows``, also the image's concept).
        rows: ``(R,)`` pair indices to score (clean pairs with true captions).
        bank_size: captions per bank; each chunk of ``chunk`` rows draws a fresh random bank (from ``seed``), and
            ``bank_size >= N`` uses every caption.
        seed: bank draws.

    Returns:
        the match share in [0, 1] (NaN when ``rows`` is empty).
    """
    if len(rows) == 0:
        return float("nan")
    g = torch.Generator().manual_seed(seed)
    n = len(txt)
    hits = 0
    for s in range(0, len(rows), chunk):
        r = rows[s : s + chunk]
        bank = torch.arange(n) if bank_size >= n else torch.randperm(n, generator=g)[:bank_size]
        sim = img[r] @ txt[bank].T  # (chunk, bank)
        sim[bank[None, :] == r[:, None]] = -float("inf")  # the own caption is never a candidate
        hits += int((sig[bank[sim.argmax(1)]] == sig[r]).sum())
    return hits / len(rows)
