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


def test_config_prints_keys_with_help():
    result = runner.invoke(app, ["config", "smoke-digits", "hidden=8"])
    assert result.exit_code == 0, result.output
    assert "hidden: 8" in result.output and "train.lr" in result.output


def test_report_on_missing_folder_names_it(tmp_path):
    result = runner.invoke(app, ["report", str(tmp_path / "nope")])
    assert result.exit_code == 2 and "nope" in result.output and "Traceback" not in result.output
