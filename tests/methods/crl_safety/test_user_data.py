"""User JSONL validation and the recipe's preflight: every error names the file (and line), before any model loads."""

import json

import pytest

from reprlab.errors import ConfigError, DataError
from reprlab.methods.crl_safety import data as D
from reprlab.methods.crl_safety import recipe as R


def _write(path, rows):
    path.write_text(
        "\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n", encoding="utf-8"
    )
    return path


GOOD = [{"prompt": f"bad {i}", "harmful": True, "response": f"Sure, step {i}"} for i in range(4)] + [
    {"prompt": f"good {i}", "harmful": False} for i in range(4)
]


@pytest.mark.parametrize(
    "row,needle",
    [
        ({"prompt": "x", "harmful": "false"}, "'harmful' must be JSON true or false, got 'false'"),
        ({"prompt": "x", "harmful": 0}, "'harmful' must be JSON true or false"),
        ({"prompt": "x", "harmful": None}, "'harmful' must be JSON true or false"),
        ({"prompt": None, "harmful": True}, "'prompt' must be a non-empty string, got None"),
        ({"prompt": "   ", "harmful": True}, "'prompt' must be a non-empty string"),
        ({"prompt": 7, "harmful": True}, "'prompt' must be a non-empty string, got 7"),
        ({"prompt": "x", "harmful": True, "response": 3}, "'response' must be a non-empty string"),
        ({"prompt": "x"}, "missing key 'harmful'"),
        ({"prompt": "x", "harmful": True, "label": 1}, "unknown key"),
        ("[1, 2]", "expected a JSON object, got list"),
        ("{not json", "not valid JSON"),
    ],
)
def test_bad_line_is_a_data_error_naming_file_and_line(tmp_path, row, needle):
    # the bad row is line 3 (after two good ones): the message must say mine.jsonl:3
    p = _write(tmp_path / "mine.jsonl", [GOOD[0], GOOD[4], row])
    with pytest.raises(DataError) as e:
        D.load_user_jsonl(p)
    assert f"{p}:3" in str(e.value) and needle in str(e.value)


@pytest.mark.parametrize(
    "row",
    [{"prompt": 5, "harmful": True}, {"prompt": "x", "harmful": True, "label": 1}, "[1, 2]", "{not json"],
)
def test_bad_line_prints_the_line_format_once(tmp_path, row):
    """Through the CLI, as the user sees it: one message naming file:line, and the format hint once."""
    from typer.testing import CliRunner

    from reprlab.cli import app

    bad = _write(tmp_path / "badtype.jsonl", [GOOD[0], GOOD[4], row])
    out = tmp_path / "run"
    result = CliRunner().invoke(app, ["run", "crl-tiny", "--out", str(out), f"data.user_jsonl={bad}"])
    assert result.exit_code == 2 and "badtype.jsonl:3" in result.output, result.output
    assert result.output.count("each line:") == 1, result.output
    assert not out.exists()


def test_a_prompt_labelled_both_ways_is_rejected_at_preflight(tmp_path, monkeypatch):
    """The training file gets the evaluation file's label check: same prompt (up to case and whitespace), two
    labels."""
    monkeypatch.setattr(
        R, "load_model", lambda *a, **k: (_ for _ in ()).throw(AssertionError("model loaded"))
    )
    p = _write(tmp_path / "conflict.jsonl", [*GOOD, {"prompt": "  BAD 1 ", "harmful": False}])
    with pytest.raises(DataError, match=r"conflict\.jsonl:9: prompt .* harmful=False here but harmful=True on "
                       r"line 2 \(data\.user_jsonl\)") as e:  # fmt: skip
        R.preflight(_tiny_cfg(user_jsonl=str(p)))
    assert "one label" in e.value.hint


def test_strict_booleans_keep_real_booleans(tmp_path):
    ex = D.load_user_jsonl(_write(tmp_path / "ok.jsonl", GOOD))
    assert [e.harmful for e in ex] == [True] * 4 + [False] * 4  # JSON booleans pass through unchanged
    assert ex[0].response == "Sure, step 0" and ex[4].response is None


def test_non_utf8_file_is_named(tmp_path):
    p = tmp_path / "latin1.jsonl"
    p.write_bytes(
        json.dumps(GOOD[0]).encode() + b"\n" + '{"prompt": "caf\u00e9", "harmful": true}'.encode("latin-1")
    )
    with pytest.raises(DataError, match=r"latin1\.jsonl:2: not UTF-8"):
        D.load_user_jsonl(p)


def test_missing_and_empty_files_are_named(tmp_path):
    with pytest.raises(DataError, match="nope.jsonl"):
        D.load_user_jsonl(tmp_path / "nope.jsonl")
    with pytest.raises(DataError, match=r"empty\.jsonl is empty"):
        D.load_user_jsonl(_write(tmp_path / "empty.jsonl", ["", "  "]))


def test_too_few_user_prompts_names_the_file(tmp_path):
    p = _write(tmp_path / "small.jsonl", GOOD)
    with pytest.raises(DataError, match=r"small\.jsonl: asked for 9 harmful eval"):
        D.make_splits(0, 2, 9, 2, 2, 2, user_jsonl=str(p))


def _tiny_cfg(**data):
    from reprlab.config import load_config

    return load_config(R.Config, {"model": "tiny-llama", "data": {"n_harmful_train": 2, "n_harmful_eval": 2,
                                                                  "n_harmless_train": 2, "n_harmless_eval": 2,
                                                                  "n_xstest": 2, **data}})  # fmt: skip


def test_preflight_rejects_bad_data_and_config_without_loading(tmp_path, monkeypatch):
    def no_load(*a, **k):
        raise AssertionError("a model was loaded before the data were checked")

    monkeypatch.setattr(R, "load_model", no_load)
    bad = _write(tmp_path / "bad.jsonl", [*GOOD, {"prompt": "x", "harmful": "false"}])
    with pytest.raises(DataError, match=r"bad\.jsonl:9"):
        R.preflight(_tiny_cfg(user_jsonl=str(bad)))
    with pytest.raises(ConfigError, match="judge.backend"):
        R.preflight(R.Config(judge=R.JudgeCfg(backend="gpt4")))
    with pytest.raises(ConfigError, match="models"):
        R.preflight(R.Config(models=("base", "dpo")))
    R.preflight(_tiny_cfg(user_jsonl=str(_write(tmp_path / "ok.jsonl", GOOD))))  # a good file passes


def test_runner_stops_before_the_run_folder_and_the_model(tmp_path, monkeypatch):
    """Through the runner: the error comes from preflight, no run folder exists and no model loaded."""
    from reprlab.runner import execute

    monkeypatch.setattr(
        R, "load_model", lambda *a, **k: (_ for _ in ()).throw(AssertionError("model loaded"))
    )
    bad = _write(tmp_path / "bad.jsonl", [*GOOD, {"prompt": None, "harmful": True}])
    out = tmp_path / "run"
    with pytest.raises(DataError, match=r"bad\.jsonl:9: 'prompt'"):
        execute("crl-tiny", [f"data.user_jsonl={bad}"], out=out, quiet=True)
    assert not out.exists()


def test_a_50_mb_line_is_an_error_naming_the_line_not_a_crash(tmp_path):
    p = tmp_path / "big.jsonl"
    p.write_bytes(json.dumps(GOOD[0]).encode() + b"\n" + b"[" * 50_000_000 + b"\n")
    with pytest.raises(DataError, match=r"big\.jsonl:2: line longer than 1,048,576 bytes") as e:
        D.load_user_jsonl(p)
    assert '"prompt"' in e.value.hint  # the expected line format


def test_deeply_nested_json_within_the_line_limit_is_an_error_naming_the_line(tmp_path):
    p = tmp_path / "deep.jsonl"
    p.write_bytes(json.dumps(GOOD[0]).encode() + b"\n" + b"[" * 900_000 + b"\n")  # a RecursionError in json
    with pytest.raises(DataError, match=r"deep\.jsonl:2: JSON nested too deeply"):
        D.load_user_jsonl(p)


def test_line_separators_inside_a_prompt_are_text(tmp_path):
    """U+2028/U+2029 (legal raw in JSON strings), NEL and form feed split lines for str.splitlines()."""
    rows = [{"prompt": f"first{sep}second {i}", "harmful": i % 2 == 0} for i, sep in
            enumerate(["\u2028", "\u2029", "\u0085", "\x0c"])]  # fmt: skip
    p = tmp_path / "sep.jsonl"
    p.write_text("\r\n".join(json.dumps(r, ensure_ascii=False) for r in rows) + "\r\n", encoding="utf-8")
    assert [e.prompt for e in D.load_user_jsonl(p)] == [r["prompt"] for r in rows]
