"""Embedding sources as uniform *item sets*: per word (or text), a padded sequence of item vectors.

* static tables (GloVe, SGNS): one item per word, so every subword composition reduces to the vector;
  for texts the items are the words;
* a model's input embedding table: the rows of the word's subword pieces;
* a contextual layer: the piece states at hidden-state index ℓ, plus the CLS/EOS ``pooled`` state.

Subword probabilities for SIF are estimated as p(t) ∝ Σ_w p(w)·count(t in pieces(w)) over the wordfreq
candidate list [ours: the models ship no token frequencies].
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from reprlab.methods.norm_ic.extract import TokenStates, input_table_states, piece_ids
from reprlab.methods.norm_ic.static import StaticEmbeddings


@dataclass
class ItemSet:
    """Item vectors of ``n`` words/texts.

    Attributes:
        x: ``(n, pos, d_model)`` float32, left-aligned items.
        mask: ``(n, pos)`` bool.
        p: ``(n, pos)`` item probabilities (for SIF).
        pooled: ``(n, d_model)`` CLS/EOS states, or None for static sources.
        surprisal: ``(n, pos)`` LM surprisal of each piece in nats (decoders), else None.
        ids: ``(n, pos)`` long piece ids (padding −1; static tables: the word's row), for the random-vector null.
    """

    x: Tensor
    mask: Tensor
    p: Tensor
    pooled: Tensor | None = None
    surprisal: Tensor | None = None
    ids: Tensor | None = None


def static_words(table: StaticEmbeddings, words: list[str], p_words: np.ndarray) -> ItemSet:
    """One item per word: ``x`` is ``(n, 1, d_model)``."""
    x = torch.from_numpy(table.lookup(words)).float()[:, None]
    ids = torch.tensor([table.index[w] for w in words], dtype=torch.long)[:, None]
    return ItemSet(x, torch.ones(len(words), 1, dtype=torch.bool), torch.from_numpy(p_words).float()[:, None],
                   ids=ids)  # fmt: skip


def static_texts(table: StaticEmbeddings, texts: list[list[str]], p_of: dict[str, float]) -> ItemSet:
    """Word items of tokenised texts, padded: ``x`` is ``(n, max_words, d_model)``."""
    pos = max(len(t) for t in texts)
    d = table.vectors.shape[1]
    x, mask, p = (
        torch.zeros(len(texts), pos, d),
        torch.zeros(len(texts), pos, dtype=torch.bool),
        torch.ones(len(texts), pos),
    )
    for i, t in enumerate(texts):
        x[i, : len(t)] = torch.from_numpy(table.lookup(t))
        mask[i, : len(t)] = True
        p[i, : len(t)] = torch.tensor([p_of[w] for w in t])
    return ItemSet(x, mask, p)


def subword_probabilities(tok, words: list[str], p_words: np.ndarray, arch: str) -> dict[int, float]:
    """p(t) ∝ Σ_w p(w)·count(t in pieces(w)) over ``words``, normalised to sum 1."""
    acc: dict[int, float] = defaultdict(float)
    for ids, pw in zip(piece_ids(tok, words, arch), p_words):
        for t in ids:
            acc[t] += float(pw)
    total = sum(acc.values())
    return {t: v / total for t, v in acc.items()}


def piece_p(piece_ids_: Tensor, p_sub: dict[int, float]) -> Tensor:
    """Probabilities ``(n, pos)`` of padded piece ids; unseen pieces get the smallest known p [ours]."""
    floor = min(p_sub.values())
    flat = [p_sub.get(t, floor) if t >= 0 else 1.0 for t in piece_ids_.reshape(-1).tolist()]
    return torch.tensor(flat).reshape(piece_ids_.shape)


def layer_items(states: TokenStates, layer: int, p_sub: dict[int, float]) -> ItemSet:
    """Items of hidden-state index ``layer`` (must be one of ``states.layers``)."""
    if layer not in states.layers:
        raise ValueError(f"layer {layer} was not extracted; have {states.layers}")
    k = states.layers.index(layer)
    return ItemSet(states.states[:, k], states.mask, piece_p(states.piece_ids, p_sub), states.pooled[:, k],
                   states.surprisal, states.piece_ids)  # fmt: skip


def input_items(model, states: TokenStates, p_sub: dict[int, float]) -> ItemSet:
    """Items from the model's input embedding table at the same pieces (no pooled state)."""
    return ItemSet(input_table_states(model, states.piece_ids), states.mask, piece_p(states.piece_ids, p_sub),
                   ids=states.piece_ids)  # fmt: skip
