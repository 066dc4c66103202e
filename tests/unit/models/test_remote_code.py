"""A model id or folder never runs the repository's own Python: reprlab passes trust_remote_code=False
everywhere it loads a model, and a folder whose config points at custom code is refused, its code unrun."""

import json
import re
from pathlib import Path

import pytest

import reprlab
from reprlab.models.hf import load_causal_lm, load_encoder

SRC = Path(reprlab.__file__).parent


def test_trust_remote_code_is_never_set_true_in_the_library():
    hits = []
    for path in SRC.rglob("*.py"):
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            for m in re.finditer(r"trust_remote_code\W+(\w+)", line):
                if m.group(1) != "False":
                    hits.append(f"{path.relative_to(SRC)}:{n}: {line.strip()}")
    assert not hits, hits


@pytest.mark.parametrize("loader", [load_causal_lm, load_encoder])
def test_a_folder_with_custom_code_is_refused_without_running_it(tmp_path, loader):
    marker = tmp_path / "ran"
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({
        "model_type": "reprlab-custom", "architectures": ["Custom"],
        "auto_map": {"AutoConfig": "custom.Config", "AutoModel": "custom.Model", "AutoModelForCausalLM": "custom.Model"},
    }))  # fmt: skip
    (folder / "custom.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    _plain_tokenizer(folder)  # so that loading reaches the model, whose config asks for custom code
    with pytest.raises(ValueError, match="trust_remote_code"):
        loader(str(folder))
    assert not marker.exists()


def _plain_tokenizer(folder):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", eos_token="[UNK]").save_pretrained(
        folder
    )
