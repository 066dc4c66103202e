"""Task items, the JSONL + manifest format, validation, and tensorisation for training.

A dataset folder holds ``manifest.json`` (task, seed, tokenizer, vocab, sizes, noise settings) and one
``<split>.jsonl`` per split, one :class:`Item` per line. Loading validates everything (counts, vocabulary,
noisy flags, and the task's own consistency checks) and names the file and line of the first problem.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from reprlab.jsonfile import dumps_json


class DatasetError(ValueError):
    """A dataset file is missing, malformed, or inconsistent; the message names the file."""


@dataclass(frozen=True)
class Item:
    """One task example.

    Attributes:
        id: unique id.
        kind: ``fda``, ``fact`` (THR atomic fact) or ``two_hop`` (THR question).
        prompt: input text (characters for FDA, space-separated words for THR).
        true_answer: the correct answer text.
        train_answer: the label used for training (differs from ``true_answer`` iff ``noisy``).
        noisy: whether the label is a fixed wrong label.
        meta: task-specific intermediate results (FDA carries/sum digits, THR bridge entity).
    """

    id: str
    kind: str
    prompt: str
    true_answer: str
    train_answer: str
    noisy: bool = False
    meta: dict = field(default_factory=dict)


@dataclass
class Dataset:
    """A manifest and its splits (``train``, ``test``, ...)."""

    manifest: dict
    splits: dict[str, list[Item]]

    def save(self, folder: Path) -> None:
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        for name, items in self.splits.items():
            tmp = folder / f"{name}.jsonl.tmp"
            with tmp.open("w") as f:
                for it in items:
                    f.write(dumps_json(asdict(it), indent=None, sort_keys=True) + "\n")
            tmp.replace(folder / f"{name}.jsonl")
        manifest = {**self.manifest, "sizes": {k: len(v) for k, v in self.splits.items()}}
        (folder / "manifest.json").write_text(dumps_json(manifest, indent=2, sort_keys=True))


def load_dataset(folder: Path, validate_item: Callable[[Item], str | None] | None = None) -> Dataset:
    """Load and validate a dataset folder.

    Args:
        folder: folder with ``manifest.json`` and the split files.
        validate_item: task check returning an error string for a bad item (see ``validate_fda_item``).

    Raises:
        DatasetError: naming the file (and line) of the first problem found.
    """
    folder = Path(folder)
    mpath = folder / "manifest.json"
    if not mpath.exists():
        raise DatasetError(f"{mpath}: manifest is missing")
    try:
        manifest = json.loads(mpath.read_text())
    except json.JSONDecodeError as e:
        raise DatasetError(f"{mpath}: not valid JSON ({e})") from e
    for key in ("task", "seed", "tokenizer", "vocab", "sizes"):
        if key not in manifest:
            raise DatasetError(f"{mpath}: missing key {key!r}")
    vocab = Vocab(manifest["vocab"], manifest["tokenizer"])
    splits: dict[str, list[Item]] = {}
    ids: set[str] = set()
    for name, size in manifest["sizes"].items():
        path = folder / f"{name}.jsonl"
        if not path.exists():
            raise DatasetError(f"{path}: split file listed in the manifest is missing")
        items = []
        with path.open() as f:
            for lineno, line in enumerate(f, 1):
                try:
                    item = Item(**json.loads(line))
                except (json.JSONDecodeError, TypeError) as e:
                    raise DatasetError(f"{path}:{lineno}: malformed item ({e})") from e
                problem = _check_item(item, vocab, ids) or (validate_item(item) if validate_item else None)
                if problem:
                    raise DatasetError(f"{path}:{lineno}: {problem}")
                ids.add(item.id)
                items.append(item)
        if len(items) != size:
            raise DatasetError(f"{path}: manifest says {size} items, file has {len(items)}")
        if not items:
            raise DatasetError(f"{path}: split {name!r} is empty")
        splits[name] = items
    return Dataset(manifest=manifest, splits=splits)


def _check_item(item: Item, vocab: Vocab, seen: set[str]) -> str | None:
    if item.id in seen:
        return f"duplicate id {item.id!r}"
    if item.noisy != (item.true_answer != item.train_answer):
        return f"noisy={item.noisy} but true_answer={item.true_answer!r}, train_answer={item.train_answer!r}"
    for text in (item.prompt, item.true_answer, item.train_answer):
        unknown = [t for t in vocab.split(text) if t not in vocab.index]
        if unknown:
            return f"tokens {unknown[:5]} are not in the manifest vocabulary"
    return None


class Vocab:
    """Token <-> id map; ``char`` tokenizer splits into characters, ``word`` on whitespace."""

    def __init__(self, tokens: list[str], tokenizer: str):
        if tokenizer not in ("char", "word"):
            raise DatasetError(f"unknown tokenizer {tokenizer!r} (expected char or word)")
        if "<eos>" not in tokens or "<pad>" not in tokens:
            raise DatasetError("vocabulary must contain <eos> and <pad>")
        self.tokens, self.tokenizer = list(tokens), tokenizer
        self.index = {t: i for i, t in enumerate(tokens)}
        self.eos, self.pad = self.index["<eos>"], self.index["<pad>"]

    def __len__(self) -> int:
        return len(self.tokens)

    def split(self, text: str) -> list[str]:
        return list(text) if self.tokenizer == "char" else text.split()

    def encode(self, text: str) -> list[int]:
        return [self.index[t] for t in self.split(text)]

    def decode(self, ids: list[int]) -> str:
        sep = "" if self.tokenizer == "char" else " "
        return sep.join(self.tokens[i] for i in ids if i not in (self.eos, self.pad))


@dataclass
class Batch:
    """Tensorised items, right-padded.

    Attributes:
        ids: (batch, pos) prompt + answer + EOS, answers = ``train_answer``.
        ids_true: (batch, pos) the same with ``true_answer`` (equal to ``ids`` for clean items).
        answer_start: (batch,) index of the first answer token.
        answer_len: (batch,) answer length including EOS.
        noisy: (batch,) bool.
    """

    ids: Tensor
    ids_true: Tensor
    answer_start: Tensor
    answer_len: Tensor
    noisy: Tensor

    def __len__(self) -> int:
        return self.ids.shape[0]

    def select(self, idx: Tensor) -> Batch:
        return Batch(self.ids[idx], self.ids_true[idx], self.answer_start[idx], self.answer_len[idx],
                     self.noisy[idx])  # fmt: skip

    def answer_mask(self) -> Tensor:
        """(batch, pos) True at answer-token positions (the loss covers only these)."""
        pos = torch.arange(self.ids.shape[1], device=self.ids.device)
        start = self.answer_start[:, None]
        return (pos >= start) & (pos < start + self.answer_len[:, None])

    def to(self, device) -> Batch:
        return Batch(*(t.to(device) for t in (self.ids, self.ids_true, self.answer_start, self.answer_len,
                                              self.noisy)))  # fmt: skip


def tensorize(items: list[Item], vocab: Vocab) -> Batch:
    """Encode items into a right-padded :class:`Batch`."""
    if not items:
        raise DatasetError("cannot tensorise an empty list of items")
    rows, rows_true, starts, lens = [], [], [], []
    for it in items:
        p = vocab.encode(it.prompt)
        a, t = vocab.encode(it.train_answer) + [vocab.eos], vocab.encode(it.true_answer) + [vocab.eos]
        if len(a) != len(t):
            raise DatasetError(f"item {it.id}: train and true answers differ in length")
        rows.append(p + a)
        rows_true.append(p + t)
        starts.append(len(p))
        lens.append(len(a))
    width = max(len(r) for r in rows)

    def pad(rs: list[list[int]]) -> Tensor:
        return torch.tensor([r + [vocab.pad] * (width - len(r)) for r in rs], dtype=torch.long)

    return Batch(pad(rows), pad(rows_true), torch.tensor(starts), torch.tensor(lens),
                 torch.tensor([it.noisy for it in items]))  # fmt: skip
