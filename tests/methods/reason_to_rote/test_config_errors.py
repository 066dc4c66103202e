"""Bad rote-fda settings stop as one message naming the key (exit 2, no traceback), before the run folder is
made where the config alone tells; each printed a traceback, or was silently changed, before."""

import pytest
from typer.testing import CliRunner

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
        (["task.n_test=0"], "task.n_test: must be >= 2, got 0"),
        (["task.n_test=1"], "task.n_test: must be >= 2, got 1"),  # the probes split the test items in two
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


def _llama_folder(folder, **kw):
    from transformers import LlamaConfig

    LlamaConfig(**{"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                   "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 32, **kw}
                ).save_pretrained(folder)  # fmt: skip
    return folder


def test_what_a_hf_models_config_decides_is_checked_before_the_run_folder(tmp_path):
    """The neuron layer against the model's depth, the task's length against its positions, and an architecture
    the hook sites cannot read (BERT loads as a causal LM, BertLMHeadModel): each read from the config and a
    weightless copy of the model at preflight. Before, each stopped after the run folder was made, and a
    re-run into it was refused as an unfinished run."""
    from transformers import BertConfig

    llama = _llama_folder(tmp_path / "llama")
    common = [f"model.hf_id={llama}", "model.from_config=true"]
    assert_run_refused(tmp_path / "o1", "rote-fda-tiny", [*common, "analysis.neuron_layer=2"],
                       "analysis.neuron_layer=2 is out of range for a model with 2 layers")  # fmt: skip
    short = _llama_folder(tmp_path / "short", max_position_embeddings=8)
    assert_run_refused(tmp_path / "o2", "rote-fda-tiny", [f"model.hf_id={short}", "model.from_config=true"],
                       "takes 8 positions, the task needs 16")  # fmt: skip
    bert = tmp_path / "bert"
    BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
               intermediate_size=64).save_pretrained(bert)  # fmt: skip
    assert_run_refused(tmp_path / "o3", "rote-fda-tiny", [f"model.hf_id={bert}", "model.from_config=true"],
                       "is not a causal LM reprlab can hook")  # fmt: skip


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
