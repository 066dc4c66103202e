"""Bad Norm-IC settings stop in preflight as one message naming the key (exit 2, no traceback, no run folder);
each printed a traceback after the run folder and minutes of work before."""

import json

import numpy as np
import pytest

from reprlab.errors import ConfigError
from reprlab.methods.norm_ic.extract import check_layers
from tests.cli_errors import assert_run_refused


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["static.glove_path=/nosuch"], "static.glove_path='/nosuch': /nosuch/glove_6B_50d_emb.npy"),
        (["encoder.layers=[99]"], "encoder.layers=[99] out of range for a model with 6 layers"),
        (["encoder.layers=[-8]"], "encoder.layers=[-8] out of range for a model with 6 layers"),
        (["static.normalizations=[nosuch]"], "static.normalizations: unknown ['nosuch']; valid: raw,"),
        (["decoder.normalizations=[raw,nosuch]"], "decoder.normalizations: unknown ['nosuch']; valid: raw,"),
        (["encoder.model={empty}"], "encoder.model='{empty}' is not a usable model"),
        (["encoder.model={unknown_type}"], "encoder.model='{unknown_type}' is not a usable model"),
    ],
)
def test_bad_normic_settings_exit_2_before_the_run_folder(tmp_path, overrides, expected):
    folders = {"empty": tmp_path / "empty", "unknown_type": tmp_path / "unknown_type"}
    for name, config in (("empty", {}), ("unknown_type", {"model_type": "nosuch"})):
        folders[name].mkdir()
        (folders[name] / "config.json").write_text(json.dumps(config))
    overrides = [o.format(**folders) for o in overrides]
    assert_run_refused(tmp_path / "out", "normic-tiny", overrides, expected.format(**folders))


def test_layers_are_checked_against_the_depth_with_python_style_negatives():
    assert check_layers([0, 3, -1, -7], 6, "encoder.layers") == [0, 3, 6, 0]
    with pytest.raises(ConfigError, match=r"decoder.layers=\[31\] out of range for a model with 30 layers"):
        check_layers([31], 30, "decoder.layers")  # a GGUF decoder's depth is known only once loaded


def _glove(folder, words, vectors):
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder.mkdir()
    np.save(folder / "glove_6B_50d_emb.npy", np.asarray(vectors, np.float32))
    pq.write_table(pa.table({"index": list(words)}), folder / "glove_6B_index.parquet")
    return folder


@pytest.mark.parametrize(
    ("make", "expected"),
    [
        (lambda w, v: (w, v[:-1]), "names 400 words but glove_6B_50d_emb.npy holds 399 vectors"),
        (lambda w, v: (w, v[:, 0]), "expected a (words, dims) array of vectors, got shape (400,)"),
        (
            lambda w, v: (w, v * [[float("nan")]] ** (np.arange(400)[:, None] == 7)),
            "1 of 400 vectors hold NaN",
        ),
        (lambda w, v: ([*w[:-1], w[0]], v), "1 word appears more than once (e.g. ['way'])"),
        (lambda w, v: (w, v), "400 of the candidate words (wordfreq's top 30000) are in its table"),
    ],
    ids=["counts", "one-dim", "nan", "duplicate", "too-few-words"],
)
def test_a_users_glove_table_is_read_and_checked_before_the_run_folder(tmp_path, make, expected):
    """A user's GloVe folder (static.glove_path) is read at preflight: a mismatch of words and vectors, a wrong
    shape, NaN rows, a word twice (a lookup would take the last row silently) and a table without enough of the
    candidate words each stop with the file named. Each was a traceback after the run folder before."""
    from reprlab.methods.norm_ic.vocab import candidate_words

    words = candidate_words(30000, 100)[:400]
    vectors = np.random.default_rng(0).normal(size=(400, 50))
    folder = _glove(tmp_path / "glove", *make(words, vectors))
    off = [
        "encoder.enabled=false",
        "decoder.enabled=false",
        "static.sgns=false",
        f"static.glove_path={folder}",
    ]
    assert_run_refused(tmp_path / "out", "normic-tiny", off, expected)
