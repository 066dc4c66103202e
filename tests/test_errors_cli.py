"""Input errors reach the user as one message (and its fix) with exit status 2, before any folder is made;
``--debug`` brings the traceback back. Each case here printed a 12-42 frame traceback before user errors were caught at the CLI."""

import os
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from reprlab.cli import app
from reprlab.errors import ModelNotAvailableError
from reprlab.models.hf import check_model_available

runner = CliRunner()


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["run", "nosuch-recipe"], "unknown recipe 'nosuch-recipe'"),
        (["run", "smoke-digit"], "Did you mean 'smoke-digits'"),
        (["run", "smoke-digits", "train.batch_size=0"], "train.batch_size: must be >= 1, got 0"),
        (["run", "smoke-digits", "device=gpu"], "device='gpu' is not a device name"),
        (["run", "smoke-digits", "train.lr=fast"], "train.lr: expected float"),
        (["run", "smoke-digits", "lr"], "not of the form key=value"),
        (["run", "smoke-digits", "--resume"], "does not exist"),
        (["run", "smoke-digits", "--resume", "--overwrite"], "contradict"),
        (["run", "smoke-digits", "--track", "mlflow"], "tensorboard"),
        (["run", "crl-tiny", "model=nosuch-org/nosuch-model"], "not available offline"),
        (["run", "normic-tiny", "encoder.model=nosuch-org/nosuch-model"], "not available offline"),
        (["run", "otcclip-tiny", "defense.flag=none"], "act only with a flag"),  # OTCCLIP trains 4th of 5
        (["run", "otcclip-tiny", "model.heads=3"], "model.heads (3) must divide model.width (64)"),
        (["run", "otcclip-tiny", "defenses=[none,nosuch]"], "unknown defense 'nosuch'"),
        (["config", "nosuch-recipe"], "unknown recipe"),
        (["report", "/nonexistent/run"], "does not exist"),
        (["aggregate", "/nonexistent/run"], "does not exist"),
    ],
)
def test_input_errors_exit_2_without_traceback_and_make_no_folder(tmp_path, args, expected):
    out = tmp_path / "out"
    if args[0] == "run":
        args = [*args[:2], "--out", str(out), *args[2:]]
    result = runner.invoke(app, args)
    assert result.exit_code == 2, result.output
    assert expected in result.output and "Traceback" not in result.output
    assert not out.exists()


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the error of a CPU-only machine")
def test_cuda_on_a_cpu_machine_is_refused_before_work(tmp_path):
    result = runner.invoke(app, ["run", "smoke-digits", "--out", str(tmp_path / "o"), "device=cuda"])
    assert result.exit_code == 2 and "no CUDA device" in result.output and "use device=cpu" in result.output
    assert not (tmp_path / "o").exists()


def test_the_console_script_exits_2_and_debug_shows_the_traceback(tmp_path):
    env = {**os.environ, "REPRLAB_QUIET": "1"}
    cmd = [sys.executable, "-m", "reprlab.cli", "run", "nosuch-recipe"]
    plain = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp_path)
    assert (
        plain.returncode == 2
        and plain.stderr.startswith("error: unknown recipe")
        and "Traceback" not in plain.stderr
    )
    debug = subprocess.run(
        [*cmd[:3], "--debug", *cmd[3:]], capture_output=True, text=True, env=env, cwd=tmp_path
    )
    assert debug.returncode != 0 and "Traceback" in debug.stderr and "RecipeError" in debug.stderr


def test_model_not_available_offline_names_the_packaged_aliases(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "empty-cache"))  # nothing cached
    with pytest.raises(ModelNotAvailableError, match="not in the local Hugging Face cache") as err:
        check_model_available("bert-base-uncased")
    assert "smollm2-135m-instruct" in err.value.hint and "all-minilm-l6-v2" in err.value.hint
    with pytest.raises(ModelNotAvailableError, match="does not exist"):
        check_model_available(str(tmp_path / "no-such-folder"))
    check_model_available("all-minilm-l6-v2")  # packaged: available offline


def test_config_demo_prints_the_demo_variant():
    result = runner.invoke(app, ["config", "smoke-digits", "--demo"])
    assert result.exit_code == 0 and "demo = its demo overrides (none)" in result.output
    assert "# claims" in result.output and "learns: {test_acc} >= 0.85" in result.output


def test_demo_with_an_unknown_recipe_is_an_input_error(tmp_path):
    result = runner.invoke(app, ["demo", "--out", str(tmp_path / "d"), "--only", "nosuch"])
    assert (
        result.exit_code == 2
        and "unknown recipes ['nosuch']" in result.output
        and "Traceback" not in result.output
    )
