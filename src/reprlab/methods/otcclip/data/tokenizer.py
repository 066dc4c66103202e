"""Word-level tokenizer for the tiny text encoder [ours].

The testbeds have a closed vocabulary of a few dozen words, so a word-level tokenizer keeps the token
features of the text encoder aligned with words (what the OT patch-token matching reasons about).
For user data the vocabulary is built from the captions (``from_texts``) and unseen words map to
``<unk>``.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch

PAD, UNK = "<pad>", "<unk>"
# hyphenated words stay whole so that "t-shirt" is one token distinct from "shirt"
_WORD = re.compile(r"[a-z0-9]+(?:-[a-z0-9]+)*")


def words(text: str) -> list[str]:
    """Lower-cased word list of ``text`` (punctuation dropped)."""
    return _WORD.findall(text.lower())


class WordTokenizer:
    """Maps captions to padded id tensors.

    Args:
        vocab: token list; index 0 must be ``<pad>`` and index 1 ``<unk>``.
    """

    special_ids: tuple[int, ...] = ()  # no SOT/EOT: word dropout may drop any token

    def __init__(self, vocab: Sequence[str]):
        if len(vocab) < 2 or vocab[0] != PAD or vocab[1] != UNK:
            raise ValueError("vocab must start with '<pad>', '<unk>'")
        self.vocab = list(vocab)
        self.index = {w: i for i, w in enumerate(self.vocab)}
        if len(self.index) != len(self.vocab):
            raise ValueError("vocab has duplicate entries")

    @classmethod
    def from_texts(cls, texts: Iterable[str], min_count: int = 1, max_size: int = 20000) -> WordTokenizer:
        """Vocabulary of the most frequent words (ties broken alphabetically, so it is deterministic)."""
        counts = Counter(w for t in texts for w in words(t))
        kept = sorted((w for w, c in counts.items() if c >= min_count), key=lambda w: (-counts[w], w))
        return cls([PAD, UNK, *kept[: max_size - 2]])

    def __len__(self) -> int:
        return len(self.vocab)

    def encode(self, texts: Sequence[str], max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Encode captions.

        Args:
            texts: ``batch`` captions.
            max_len: ``pos``; longer captions are truncated.

        Returns:
            ids ``int64 (batch, pos)`` (``<pad>`` = 0) and mask ``bool (batch, pos)`` (True on real tokens).
            An empty caption becomes a single ``<unk>`` so that every row has a valid token.
        """
        ids = torch.zeros(len(texts), max_len, dtype=torch.long)
        for row, text in enumerate(texts):
            toks = [self.index.get(w, 1) for w in words(text)][:max_len] or [1]
            ids[row, : len(toks)] = torch.tensor(toks)
        return ids, ids != 0

    def decode(self, ids: torch.Tensor) -> list[str]:
        """Inverse of :meth:`encode` for ``(batch, pos)`` ids (padding dropped)."""
        return [" ".join(self.vocab[i] for i in row.tolist() if i != 0) for row in ids]

    def save(self, path: Path) -> None:
        Path(path).write_text(json.dumps(self.vocab))

    @classmethod
    def load(cls, path: Path) -> WordTokenizer:
        try:
            return cls(json.loads(Path(path).read_text()))
        except (OSError, json.JSONDecodeError) as err:
            raise ValueError(f"cannot read tokenizer vocabulary {path}: {err}") from err
