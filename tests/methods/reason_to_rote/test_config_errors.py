"""Bad rote-fda settings stop as one message naming the key (exit 2, no traceback), before the run folder is
made where the config alone tells; each printed a traceback, or was silently changed, before."""

import pytest
from typer.testing import CliRunner

from reprlab.cli import app
from reprlab.errors import ConfigError
from reprlab.methods.reason_to_rote.fda import FDAConfig
from tests.cli_errors import assert_run_refused

runner = CliRunner()


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["model.n_heads=3"], "model.n_heads=3 must divide model.d_model=64"),
        (["task.noise_rate=2"], "task.noise_rate must be in [0, 1)"),
        (["task.noise_rate=-0.1"], "task.noise_rate must be in [0, 1)"),
        (["task.noise_mode=nosuch"], "task.noise_mode: expected one of ['uniform', 'digit']"),
        (["task.digit_order=nosuch"], "task.digit_order: expected one of ['reversed', 'plain']"),
        (["task.n_train=0"], "task.n_train: must be >= 1, got 0"),
        (["task.n_test=0"], "task.n_test: must be >= 1, got 0"),
        (
            ["task.n_train=1", "task.noise_rate=0.6"],
            "task.n_train=1 with task.noise_rate=0.6 leaves no clean",
        ),
        (["analysis.neuron_layer=9"], "analysis.neuron_layer=9 is out of range for a model with 2 layers"),
        (["analysis.neuron_layer=-3"], "analysis.neuron_layer=-3 is out of range for a model with 2 layers"),
    ],
)
def test_bad_fda_settings_exit_2_before_the_run_folder(tmp_path, overrides, expected):
    assert_run_refused(tmp_path / "out", "rote-fda-tiny", overrides, expected)


def test_library_callers_get_config_errors_too():
    with pytest.raises(ConfigError, match="task.noise_rate"):
        FDAConfig(noise_rate=1.0)
    with pytest.raises(ConfigError, match="task.n_train=0"):
        FDAConfig(n_train=0)


def test_neuron_layer_of_a_hf_model_is_checked_once_loaded_before_training(tmp_path):
    from transformers import LlamaConfig

    folder = tmp_path / "llama"
    LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=32).save_pretrained(folder)  # fmt: skip
    out = tmp_path / "out"
    args = ["run", "rote-fda-tiny", "--out", str(out), f"model.hf_id={folder}", "model.from_config=true",
            "task.n_train=200", "task.n_test=20", "task.n_val=0", "train.steps=4", "train.eval_every=2",
            "analysis.probe_items=40", "analysis.circuit_items=5", "analysis.mean_items=10"]  # fmt: skip
    # (small enough that, were the layer wrapped instead, the whole run would end in seconds and this fail)
    result = runner.invoke(app, [*args, "analysis.neuron_layer=2"])
    assert result.exit_code == 2, result.output
    assert "analysis.neuron_layer=2 is out of range for a model with 2 layers" in result.output
    assert "Traceback" not in result.output
    assert not (out / "metrics.jsonl").exists()  # stopped before the first training step


def test_a_hf_folder_whose_config_does_not_load_stops_before_the_run_folder(tmp_path):
    """A folder with a config.json transformers cannot read passes the availability check (the file is there);
    preflight reads the config (no weights) so the run stops with the folder named, before any folder is made."""
    folder = tmp_path / "broken"
    folder.mkdir()
    (folder / "config.json").write_text('{"model_type": "nosuch"}')
    assert_run_refused(
        tmp_path / "out",
        "rote-fda-tiny",
        [f"model.hf_id={folder}"],
        f"model.hf_id='{folder}' is not a usable model",
    )


def test_a_hf_folder_without_a_tokenizer_stops_before_the_run_folder_when_tokens_need_one(tmp_path):
    """A model folder with a valid config but no tokenizer files: with ``model.tokens=tokenizer`` the task tokens
    go through the tokenizer, so preflight loads it and stops, naming the key and the fix; before, the run folder
    was made and the error came when the model was built."""
    from transformers import LlamaConfig

    folder = tmp_path / "no-tokenizer"
    LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=32).save_pretrained(folder)  # fmt: skip
    overrides = [f"model.hf_id={folder}", "model.from_config=true"]
    assert_run_refused(
        tmp_path / "out",
        "rote-fda-tiny",
        [*overrides, "model.tokens=tokenizer"],
        "no tokenizer could be loaded",
    )
    # the task's own ids need no tokenizer: the same folder passes preflight (checked without training)
    from reprlab.methods.reason_to_rote.recipe import preflight
    from reprlab.recipes import get_recipe

    preflight(get_recipe("rote-fda-tiny").build_config([*overrides, "model.tokens=task"]))
