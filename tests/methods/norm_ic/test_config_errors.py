"""Bad Norm-IC settings stop in preflight as one message naming the key (exit 2, no traceback, no run folder);
each printed a traceback after the run folder and minutes of work before."""

import json

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
