"""Passes of a frozen model, run once per list of pairs and shared by every reader [ours: a cache, exact].

Within a run the base model and stage 0 never change, yet many parts read the same forward passes of them over the
same pairs: the centre of the cosines and the frozen states of RR, CRL and CRL+mining (stage 0 on the training pairs),
the mechanism metric of each defence (stage 0 on the held-out pairs), the benign KL and the refusal model's mechanism
(the base on the held-out pairs). Each used to run its own pass. A :class:`FrozenStore` belongs to one frozen model
(the caller's promise: one store, one set of weights) and keys its entries on the pairs themselves, so changed data
is a new entry, never a stale one. The first reader of a list runs it in chunks of ``chunk`` pairs, left-padded as
every reader did on its own, and keeps per pair the state of every real token at every layer and, when any reader
needs them, the logits predicting its response tokens; each reader slices its layers and tokens.

Exact: a slice is bitwise the tensor the reader's own pass gave (the same chunks through the same forward call;
``logits_to_keep`` only trims the head's input, never the hidden states), which the tests check against the
readers' own passes.

Memory: every layer and token of every pair (SmolLM2, 118 training pairs of ~41 tokens: 31 x 576 floats per token,
about 345 MB); readers that would not fit use ``optim.cache_frozen=false`` (the GPU recipes), which skips the store.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from reprlab.methods.crl_safety.chat import Batch, collate, response_logits
from reprlab.train.timing import section

Pair = tuple[list[int], list[int]]
TOKENS = ("response", "last", "all")


def pairs_key(pairs: Sequence[Pair]) -> str:
    """Digest of the token ids of ``pairs`` (order included)."""
    h = hashlib.sha1()
    for p, r in pairs:
        h.update(repr((list(p), list(r))).encode())
    return h.hexdigest()


@dataclass
class FrozenPass:
    """Per pair: ``states [n_layers + 1, n_tok, d_model]`` over its real tokens (response tokens last), the number of
    response tokens, and ``logits [n_response, d_vocab]`` predicting them (None when no reader asked)."""

    states: list[Tensor]
    n_response: list[int]
    logits: list[Tensor] | None

    def select(self, layers: Sequence[int], tokens: str = "response") -> list[Tensor]:
        """Per pair ``[len(layers), k, d_model]``: all real tokens, the response tokens or the last response token
        (none for a pair without a response), as a reader's token mask picks them."""
        if tokens not in TOKENS:
            raise ValueError(f"tokens must be one of {TOKENS}, got {tokens!r}")
        idx = torch.tensor(list(layers), dtype=torch.long)
        out = []
        for st, k in zip(self.states, self.n_response):
            n = st.shape[1]
            start = 0 if tokens == "all" else n - k if tokens == "response" else n - min(k, 1)
            out.append(st.index_select(0, idx.to(st.device))[:, start:])
        return out


class FrozenStore:
    """Frozen-model passes keyed on the pairs; see the module docstring.

    Args:
        name: what the weights are (``"base"``, ``"stage 0"``), for messages.
        chunk: pairs per forward pass (every reader's own passes used 8).
    """

    def __init__(self, name: str, chunk: int = 8):
        self.name, self.chunk = name, chunk
        self._entries: dict[str, FrozenPass] = {}
        self._want_logits: set[str] = set()
        self.passes = 0  # forward passes run (tests count them)

    def want_logits(self, pairs: Sequence[Pair]) -> None:
        """Declare that some reader will need the logits of ``pairs``, so the first pass keeps them."""
        self._want_logits.add(pairs_key(pairs))

    def get(self, pairs: Sequence[Pair], run: Callable[[Batch, int], object], pad_id: int, device,
            logits: bool = False) -> FrozenPass:  # fmt: skip
        """The entry of ``pairs``, running the frozen model once if needed.

        Args:
            run: ``run(batch, logits_last)`` returns the frozen model's HF output with ``hidden_states`` (the caller
                puts the model in its frozen state, e.g. under peft's ``disable_adapter``).
            logits: the reader needs the response logits.
        """
        key = pairs_key(pairs)
        hit = self._entries.get(key)
        if hit is not None and (hit.logits is not None or not logits):
            return hit
        keep_logits = logits or key in self._want_logits
        states, n_resp, rows = [], [], [] if keep_logits else None
        with torch.no_grad(), section("frozen passes"):
            for s in range(0, len(pairs), self.chunk):
                b = collate(pairs[s : s + self.chunk], pad_id).to(device)
                out = run(b, b.n_response + 1 if keep_logits else 1)
                self.passes += 1
                real = b.attention_mask.bool()
                for r in range(real.shape[0]):
                    states.append(torch.stack([h[r][real[r]] for h in out.hidden_states]))
                    n_resp.append(int(b.response_mask[r].sum()))
                if keep_logits:
                    lg, _, m = response_logits(out.logits, b)
                    rows += [lg[r][m[r]] for r in range(m.shape[0])]
        self._entries[key] = FrozenPass(states, n_resp, rows)
        return self._entries[key]
