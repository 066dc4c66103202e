"""THR (two-hop relational reasoning) with a fixed share of noisy answers.

Reason to Rote (arXiv 2507.04782) uses THR, e.g. "Who is the mother of the CEO of lunarlabs? Cindy" memorised
while the model knows "the CEO of lunarlabs is Parker" (the bridge entity) and "Parker's mother is Bella".
Everything concrete here is **[ours]** (the paper's entity counts, templates and splits are unknown):

* generated single-token names for ``n_people`` people and ``n_orgs`` organisations;
* relations: ``ceo`` (organisation -> person) plus the first ``n_relations - 1`` of
  mother / mentor / spouse / friend, then generic ``rel5``, ``rel6``, ... (person -> person), each a random
  function with no fixed points;
* atomic facts ``the <r> of <e> is`` -> ``<answer>``, *all* in training (the model must store them);
* two-hop questions ``who is the <r2> of the <r1> of <e> ?`` -> ``<answer>``, split into train and held-out
  test; ``noise_rate`` of the training questions get a fixed wrong person, different from both the true
  answer and the bridge entity, drawn once from the seed;
* ``inferred_ratio`` (phi, after Wang et al. 2024, arXiv 2405.15071: the ratio of inferred to atomic facts
  decides how fast two-hop composition generalises) subsamples the training questions to
  ``phi * n_atomic``; the held-out questions are chosen first, so every phi is tested on the same items.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from reprlab.methods.reason_to_rote.dataset import Dataset, Item

PERSON_RELATIONS = ("mother", "mentor", "spouse", "friend")
MAX_RELATIONS = 40  # [ours] generic names rel5.. beyond the four named person relations
TEMPLATE_WORDS = ("the", "of", "is", "who", "?")
_ONSETS = "b c d f g h j k l m n p r s t v w z br ch dr gr kl pr st tr".split()
_VOWELS = "a e i o u ai ea io".split()
_CODAS = ["", "n", "r", "l", "s", "th", "x"]


@dataclass(frozen=True)
class THRConfig:
    """Generation parameters of the THR task (all [ours])."""

    n_people: int = field(default=120, metadata={"help": "people"})
    n_orgs: int = field(default=30, metadata={"help": "organisations"})
    n_relations: int = field(
        default=3,
        metadata={"help": f"relations incl. ceo (2..{MAX_RELATIONS}; beyond 5 generic rel5, rel6, ...)"},
    )
    test_fraction: float = field(default=0.2, metadata={"help": "share of two-hop questions held out"})
    noise_rate: float = field(
        default=0.05, metadata={"help": "share of training questions with a wrong answer"}
    )
    inferred_ratio: float = field(
        default=0.0,
        metadata={"help": "phi [ours, after Wang et al. 2024]: keep phi * n_atomic_facts training questions "
                          "(subsampled; held-out questions fixed first); 0 keeps all non-held-out questions"},
    )  # fmt: skip

    def __post_init__(self) -> None:
        if not 2 <= self.n_relations <= MAX_RELATIONS:
            raise ValueError(f"n_relations must be in [2, {MAX_RELATIONS}], got {self.n_relations}")
        if self.inferred_ratio < 0:
            raise ValueError(f"inferred_ratio must be >= 0, got {self.inferred_ratio}")
        if self.n_people < 4 or self.n_orgs < 1:
            raise ValueError("THR needs at least 4 people and 1 organisation")
        if not 0.0 < self.test_fraction < 1.0 or not 0.0 <= self.noise_rate < 1.0:
            raise ValueError("test_fraction must be in (0, 1) and noise_rate in [0, 1)")


def person_relations(n_relations: int) -> list[str]:
    """The ``n_relations - 1`` person -> person relation names (named ones first, then ``rel5``, ...)."""
    named = list(PERSON_RELATIONS[: n_relations - 1])
    return named + [f"rel{i}" for i in range(len(PERSON_RELATIONS) + 1, n_relations)]


def _names(n: int, rng: np.random.Generator, taken: set[str], suffix: str = "") -> list[str]:
    out: list[str] = []
    while len(out) < n:
        name = (
            "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) for _ in range(2)) + rng.choice(_CODAS) + suffix
        )
        if name not in taken:
            taken.add(name)
            out.append(name)
    return out


def _derangement(n: int, rng: np.random.Generator) -> np.ndarray:
    while True:
        p = rng.permutation(n)
        if not (p == np.arange(n)).any():
            return p


def generate_thr(cfg: THRConfig, seed: int) -> Dataset:
    """Generate THR deterministically from ``seed``: splits ``train`` (facts + questions) and ``test``."""
    rng = np.random.default_rng(seed)
    taken: set[str] = (
        set(TEMPLATE_WORDS) | set(person_relations(MAX_RELATIONS)) | set(PERSON_RELATIONS) | {"ceo"}
    )
    people = _names(cfg.n_people, rng, taken)
    orgs = _names(cfg.n_orgs, rng, taken, suffix="labs")
    rels = person_relations(cfg.n_relations)
    fn: dict[str, dict[str, str]] = {"ceo": {o: people[int(rng.integers(cfg.n_people))] for o in orgs}}
    for r in rels:
        perm = _derangement(cfg.n_people, rng)
        fn[r] = {p: people[perm[i]] for i, p in enumerate(people)}
    facts = [Item(id=f"thr-fact-{r}-{e}", kind="fact", prompt=f"the {r} of {e} is", true_answer=a,
                  train_answer=a, meta={"relation": r, "subject": e})
             for r, table in fn.items() for e, a in table.items()]  # fmt: skip
    questions = []
    for r1, table in fn.items():
        for e, bridge in table.items():
            for r2 in rels:
                answer = fn[r2][bridge]
                questions.append((f"who is the {r2} of the {r1} of {e} ?", answer, bridge, r1, r2, e))
    order = rng.permutation(len(questions))
    n_test = max(1, round(cfg.test_fraction * len(questions)))
    test_idx, train_idx = order[:n_test], order[n_test:]
    if cfg.inferred_ratio > 0:
        n_keep = round(cfg.inferred_ratio * len(facts))
        if n_keep > len(train_idx):
            raise ValueError(
                f"inferred_ratio={cfg.inferred_ratio} needs {n_keep} training questions, only "
                f"{len(train_idx)} exist (phi <= {len(train_idx) / len(facts):.2f}); add relations"
            )
        # a separate stream: the default data (inferred_ratio=0) stays bit-identical to earlier versions
        train_idx = np.random.default_rng([seed, 7]).permutation(train_idx)[:n_keep]
    n_noisy = round(cfg.noise_rate * len(train_idx))
    noisy = set(rng.choice(train_idx, size=n_noisy, replace=False).tolist()) if n_noisy else set()

    def item(i: int, split: str) -> Item:
        prompt, answer, bridge, r1, r2, e = questions[i]
        label = answer
        if i in noisy:
            while label in (answer, bridge):
                label = people[int(rng.integers(cfg.n_people))]
        return Item(id=f"thr-{split}-{i}", kind="two_hop", prompt=prompt, true_answer=answer, train_answer=label,
                    noisy=i in noisy, meta={"bridge": bridge, "r1": r1, "r2": r2, "subject": e})  # fmt: skip

    splits = {"train": facts + [item(int(i), "train") for i in sorted(train_idx)],
              "test": [item(int(i), "test") for i in sorted(test_idx)]}  # fmt: skip
    vocab = [*TEMPLATE_WORDS, "ceo", *rels, *people, *orgs, "<eos>", "<pad>"]
    manifest = {"task": "thr", "seed": seed, "tokenizer": "word", "vocab": vocab, "config": {**cfg.__dict__},
                "people": people, "orgs": orgs, "relations": ["ceo", *rels], "n_noisy": n_noisy,
                "inferred_ratio_actual": len(train_idx) / len(facts),
                "sizes": {k: len(v) for k, v in splits.items()}}  # fmt: skip
    return Dataset(manifest=manifest, splits=splits)


def validate_thr_item(item: Item, facts: dict[tuple[str, str], str] | None = None) -> str | None:
    """Why a THR item is inconsistent (wrong template, noisy label equal to the bridge), or None."""
    words = item.prompt.split()
    if item.kind == "fact":
        if len(words) != 5 or words[0] != "the" or words[2] != "of" or words[4] != "is":
            return f"fact prompt {item.prompt!r} does not match 'the <r> of <e> is'"
    elif item.kind == "two_hop":
        if len(words) != 10 or words[:3] != ["who", "is", "the"] or words[-1] != "?":
            return f"question {item.prompt!r} does not match 'who is the <r2> of the <r1> of <e> ?'"
        if "bridge" not in item.meta:
            return "two-hop item without its bridge entity"
        if item.noisy and item.train_answer == item.meta["bridge"]:
            return "noisy label equals the bridge entity"
        if facts is not None:
            bridge = facts.get((words[6], words[8]))
            if bridge != item.meta["bridge"] or facts.get((words[3], bridge)) != item.true_answer:
                return "true answer or bridge disagrees with the atomic facts"
    else:
        return f"unknown THR item kind {item.kind!r}"
    return None
