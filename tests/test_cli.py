from typer.testing import CliRunner

from reprlab.cli import app

runner = CliRunner()


def test_recipes_lists_smoke():
    result = runner.invoke(app, ["recipes"])
    assert result.exit_code == 0, result.output
    assert "smoke-digits" in result.output


def test_bad_override_is_a_clear_error(tmp_path):
    result = runner.invoke(app, ["run", "smoke-digits", "--out", str(tmp_path / "r"), "train.epoch=1"])
    assert result.exit_code == 2  # an input error: one message, no traceback
    assert "did you mean 'epochs'" in result.output and "Traceback" not in result.output
    assert not (tmp_path / "r").exists()  # checked before any folder is made


def test_config_prints_each_value_with_its_source_and_help():
    result = runner.invoke(app, ["config", "smoke-digits", "hidden=8"])
    assert result.exit_code == 0, result.output
    lines = {ln.split("=", 1)[0]: ln for ln in result.output.splitlines() if not ln.startswith("#")}
    assert lines["hidden"].split()[:3] == ["hidden=8", "override", "(default"]  # differs from the default 64
    assert "MLP hidden width" in lines["hidden"]
    assert lines["train.epochs"].split()[:2] == ["train.epochs=10", "recipe"]  # = the default: none shown
    assert "(default" not in lines["train.epochs"]
    assert lines["train.weight_decay"].split()[:2] == ["train.weight_decay=0.0001", "default"]


def test_config_agrees_with_what_run_uses():
    from reprlab.config import config_to_dict
    from reprlab.config.load import resolved_rows
    from reprlab.recipes import get_recipe

    r = get_recipe("otcclip-mosaic-tiny")
    cfg = r.build_config([*r.demo, "train.lr=5e-4"])
    result = runner.invoke(app, ["config", "otcclip-mosaic-tiny", "--demo", "train.lr=5e-4"])
    assert result.exit_code == 0, result.output
    shown = dict(
        ln.split(maxsplit=1)[0].split("=", 1) for ln in result.output.splitlines() if not ln.startswith("#")
    )
    rows = {row["key"]: row for row in resolved_rows(type(cfg), cfg, [])}
    assert set(shown) == set(rows)  # every leaf key, once
    flat = config_to_dict(cfg)
    assert shown["data.n_pairs"] == str(flat["data"]["n_pairs"]) == "1000"  # the demo value, not the recipe's
    out = result.output
    assert "data.n_pairs=1000" in out and "demo (default 2000)" in out
    assert "data.backdoor_pairs=120" in out and "recipe (default 60)" not in out  # demo sets it last
    assert "defense.top_k=4" in out and "recipe (default 16)" in out and "train.lr=0.0005" in out


def test_report_on_missing_folder_names_it(tmp_path):
    result = runner.invoke(app, ["report", str(tmp_path / "nope")])
    assert result.exit_code == 2 and "nope" in result.output and "Traceback" not in result.output
