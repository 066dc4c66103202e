"""run.log keeps what a run printed; third-party noise is filtered by name, our own warnings never."""

import logging
import warnings

import pytest

from reprlab.quiet import third_party_quiet
from reprlab.runs.runlog import run_log


def test_run_log_keeps_info_warnings_and_resumes_below_a_marker(tmp_path, recwarn):
    with run_log(tmp_path) as path:
        logging.getLogger("reprlab.x").info("hello %d", 1)
        warnings.warn("something to act on", UserWarning, stacklevel=1)
    logging.getLogger("reprlab.x").info("after the run")  # not in the file: the handler is gone
    with run_log(tmp_path, resumed=True):
        logging.getLogger("reprlab.x").info("second part")
    assert [str(w.message) for w in recwarn] == ["something to act on"]  # still shown (recorded) as before
    text = path.read_text()
    assert "INFO reprlab.x: hello 1" in text and "something to act on" in text and "after the run" not in text
    assert text.index("hello 1") < text.index("--- resumed") < text.index("second part")


def test_third_party_future_warnings_are_quiet_ours_are_not(monkeypatch):
    def emit(module):
        warnings.warn_explicit("`x` is deprecated", FutureWarning, "f.py", 1, module=module)

    monkeypatch.delenv("REPRLAB_VERBOSE", raising=False)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with third_party_quiet():
            emit("transformers.modeling_utils")
            emit("peft.peft_model")
            emit("reprlab.methods.x")
    assert [str(w.message) for w in seen] == ["`x` is deprecated"] and seen[0].filename == "f.py"
    monkeypatch.setenv("REPRLAB_VERBOSE", "1")  # `reprlab -v`: everything shows
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with third_party_quiet():
            emit("transformers.modeling_utils")
    assert len(seen) == 1


@pytest.mark.parametrize("verbose", ["0", "1"])
def test_gensim_info_lines_are_kept_out_unless_verbose(monkeypatch, caplog, verbose):
    monkeypatch.setenv("REPRLAB_VERBOSE", verbose)
    gensim = logging.getLogger("gensim")
    before = gensim.level
    gensim.setLevel(logging.NOTSET)  # as in a fresh process (the CLI tests of this session quiet it for good)
    try:
        caplog.set_level(logging.INFO)
        with third_party_quiet():
            logging.getLogger("gensim.models.word2vec").info("EPOCH 1: training on 1000 raw words")
        assert ("EPOCH 1" in caplog.text) == (verbose == "1")
        assert gensim.level == logging.NOTSET  # restored after the block
    finally:
        gensim.setLevel(before)


def test_a_run_folder_gets_run_log(tmp_path):
    from reprlab.runner import execute

    out = execute("smoke-digits", ["train.epochs=1"], tmp_path / "r", quiet=True)
    text = (out / "run.log").read_text()
    assert "run folder:" in text and "smoke-digits: " in text and " done in " in text  # the progress summary
    assert "summary, claims and report written" in text
