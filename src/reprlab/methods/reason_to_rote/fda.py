"""FDA (four-digit addition) with a fixed share of noisy labels.

Paper: Du et al., *Reason to Rote: Rethinking Memorization in Reasoning* (EMNLP 2025, arXiv 2507.04782)
uses FDA with label noise; its exact format is unknown to us, so everything here is **[ours]**:

* prompt ``a3a2a1a0+b3b2b1b0=`` (zero-padded operands), answer = the 5-digit zero-padded sum, least
  significant digit first by default (``digit_order="reversed"``; ``"plain"`` keeps the usual order);
* ordered pairs (a, b) drawn uniformly from [0, 9999]^2 without repetition; the test split excludes any pair
  whose ordered *or swapped* version is in training, so commutativity cannot leak test answers;
* ``noise_rate`` of the training items get a fixed wrong label, drawn once from the seed (never resampled):
  ``uniform`` = a uniformly random 5-digit value in [0, 19998] different from the true sum; ``digit`` =
  one uniformly chosen answer digit replaced by a different digit;
* every item stores its true answer and intermediate results: per-column carries ``carries[k]`` (the carry
  *out of* column k, k = 0 is the units column) and sum digits ``sum_digits[k]`` (column k of the sum).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from reprlab.errors import ConfigError
from reprlab.methods.reason_to_rote.dataset import Dataset, Item

FDA_VOCAB = [*"0123456789", "+", "=", "<eos>", "<pad>"]


@dataclass(frozen=True)
class FDAConfig:
    """Generation parameters of the FDA task (all [ours])."""

    n_train: int = field(default=20000, metadata={"help": "training pairs", "ge": 1})
    n_test: int = field(
        default=2000,
        metadata={"help": "clean held-out test pairs (2 at least: the probes split them)", "ge": 2},
    )
    n_val: int = field(
        default=0, metadata={"help": "clean validation pairs for the stopping rule (0 = no split)", "ge": 0}
    )
    noise_rate: float = field(default=0.05, metadata={"help": "share of training items with a wrong label"})
    noise_mode: str = field(
        default="uniform", metadata={"help": "uniform | digit", "choices": ["uniform", "digit"]}
    )
    digit_order: str = field(
        default="reversed",
        metadata={"help": "answer digit order: reversed | plain", "choices": ["reversed", "plain"]},
    )

    def __post_init__(self) -> None:
        # Messages name the recipe keys (this config is rote-fda's ``task``): the CLI prints them alone.
        if self.noise_mode not in ("uniform", "digit"):
            raise ConfigError(f"task.noise_mode must be 'uniform' or 'digit', got {self.noise_mode!r}")
        if self.digit_order not in ("reversed", "plain"):
            raise ConfigError(f"task.digit_order must be 'reversed' or 'plain', got {self.digit_order!r}")
        if not 0.0 <= self.noise_rate < 1.0:
            raise ConfigError(f"task.noise_rate must be in [0, 1) (a share of the training items), got "
                              f"{self.noise_rate}")  # fmt: skip
        # The final evaluation and every analysis read the clean training items: at least one must be left.
        if self.n_train - round(self.noise_rate * self.n_train) < 1:
            raise ConfigError(f"task.n_train={self.n_train} with task.noise_rate={self.noise_rate} leaves no clean "
                              "training item; raise task.n_train (the recipes use thousands)")  # fmt: skip
        # [0, 9999]^2 has 1e8 ordered pairs, drawn without repetition: keep the sampling cheap
        if self.n_train + self.n_test + self.n_val > 50_000_000:
            raise ConfigError("task.n_train + task.n_test + task.n_val must be <= 50,000,000")


def column_digits(value: int) -> list[int]:
    """Digits of a sum by column, units first: 6912 -> [2, 1, 9, 6, 0] (5 columns)."""
    return [(value // 10**k) % 10 for k in range(5)]


def carries(a: int, b: int) -> list[int]:
    """Carry out of each of the 4 operand columns (units first): 0999+0001 -> [1, 1, 1, 0]."""
    out, c = [], 0
    for k in range(4):
        c = int((a // 10**k) % 10 + (b // 10**k) % 10 + c >= 10)
        out.append(c)
    return out


def answer_string(value: int, digit_order: str) -> str:
    """5-digit answer string in the configured order: 6912 -> '21960' (reversed) or '06912' (plain)."""
    digits = "".join(str(d) for d in column_digits(value))  # units first
    return digits if digit_order == "reversed" else digits[::-1]


def answer_value(text: str, digit_order: str) -> int:
    """Inverse of :func:`answer_string`."""
    return int(text[::-1] if digit_order == "reversed" else text)


def _noisy_label(true_sum: int, cfg: FDAConfig, rng: np.random.Generator) -> int:
    if cfg.noise_mode == "uniform":
        while True:
            wrong = int(rng.integers(0, 19999))
            if wrong != true_sum:
                return wrong
    digits = column_digits(true_sum)
    k = int(rng.integers(0, 5))
    digits[k] = (digits[k] + int(rng.integers(1, 10))) % 10  # a different digit, uniformly
    return sum(d * 10**i for i, d in enumerate(digits))


def generate_fda(cfg: FDAConfig, seed: int) -> Dataset:
    """Generate the FDA dataset deterministically from ``seed``.

    Returns:
        a :class:`Dataset` with splits ``train`` (n_train items, ``round(noise_rate * n_train)`` noisy),
        ``test`` (n_test clean items) and, when ``n_val > 0``, ``val`` (n_val clean items, disjoint from both
        under swap; used only by the stopping rule, so the reported test EM is not selected on).
    """
    rng = np.random.default_rng(seed)
    pairs: list[tuple[int, int]] = []
    seen: set[tuple[int, int]] = set()
    need = cfg.n_train + cfg.n_test + cfg.n_val
    while len(pairs) < need:
        a, b = (int(x) for x in rng.integers(0, 10000, size=2))
        if (a, b) in seen or (b, a) in seen:  # unordered uniqueness keeps train/test disjoint under swap
            continue
        seen.add((a, b))
        pairs.append((a, b))
    n_noisy = round(cfg.noise_rate * cfg.n_train)
    noisy_idx = set(rng.choice(cfg.n_train, size=n_noisy, replace=False).tolist())
    splits: dict[str, list[Item]] = {"train": [], "test": []} | ({"val": []} if cfg.n_val else {})
    for i, (a, b) in enumerate(pairs):
        split = "train" if i < cfg.n_train else "test" if i < cfg.n_train + cfg.n_test else "val"
        true_sum = a + b
        label = _noisy_label(true_sum, cfg, rng) if i in noisy_idx else true_sum
        splits[split].append(Item(
            id=f"fda-{split}-{i}", kind="fda", prompt=f"{a:04d}+{b:04d}=",
            true_answer=answer_string(true_sum, cfg.digit_order),
            train_answer=answer_string(label, cfg.digit_order), noisy=i in noisy_idx,
            meta={"a": a, "b": b, "carries": carries(a, b), "sum_digits": column_digits(true_sum)},
        ))  # fmt: skip
    manifest = {
        "task": "fda", "seed": seed, "tokenizer": "char", "vocab": FDA_VOCAB,
        "config": {**cfg.__dict__},
        "sizes": {k: len(v) for k, v in splits.items()}, "n_noisy": n_noisy,
    }  # fmt: skip
    return Dataset(manifest=manifest, splits=splits)


def validate_fda_item(item: Item, digit_order: str) -> str | None:
    """Return why an FDA item is inconsistent, or None when it is fine."""
    p = item.prompt
    if len(p) != 10 or p[4] != "+" or p[9] != "=" or not (p[:4] + p[5:9]).isdigit():
        return f"prompt {p!r} is not of the form dddd+dddd="
    a, b = int(p[:4]), int(p[5:9])
    if answer_value(item.true_answer, digit_order) != a + b:
        return f"true_answer {item.true_answer!r} is not {a}+{b}={a + b} in {digit_order} order"
    if len(item.train_answer) != 5 or not item.train_answer.isdigit():
        return f"train_answer {item.train_answer!r} is not 5 digits"
    if item.meta.get("carries") != carries(a, b) or item.meta.get("sum_digits") != column_digits(a + b):
        return "stored carries/sum_digits do not match the operands"
    return None


def answer_columns(digit_order: str) -> list[int]:
    """Sum column held by each of the 5 answer digits: [0..4] (reversed) or [4..0] (plain)."""
    return list(range(5)) if digit_order == "reversed" else list(range(4, -1, -1))


def column_features(items: list[Item], digit_order: str) -> list[list[int]]:
    """Per item, the feature that determines each answer token (6 = 5 digits + EOS) [ours].

    For the digit of column k < 4 it is the column sum ``a_k + b_k + carry_in`` (0..19), which fixes both
    the digit and the carry out; for column 4 it is the carry out of column 3 (0..1); EOS gets 0.
    """
    cols = answer_columns(digit_order)
    out = []
    for it in items:
        a, b, c = it.meta["a"], it.meta["b"], it.meta["carries"]
        feats = []
        for k in cols:
            if k == 4:
                feats.append(c[3])
            else:
                feats.append((a // 10**k) % 10 + (b // 10**k) % 10 + (c[k - 1] if k else 0))
        out.append(feats + [0])
    return out


def cascading_carry(item: Item) -> bool:
    """True for items with a carry chain through >= 3 columns (e.g. 4999+5001), reported separately."""
    c = item.meta["carries"]
    return any(all(c[i : i + 3]) for i in range(2))
