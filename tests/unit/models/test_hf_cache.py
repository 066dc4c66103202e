"""The dequantised-GGUF caches of ``load_causal_lm``: one read of the file, then exact copies (memory, disk)."""

import os

import pytest
import torch

from reprlab.models import hf


@pytest.fixture
def fake_gguf(tmp_path, monkeypatch):
    """A GGUF alias whose 'dequantisation' builds a tiny random Llama with a real (packaged MiniLM) HF tokenizer, so
    the disk entry goes through save_pretrained / from_pretrained like the real one; counts the GGUF reads."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    minilm = hf._resolve("all-minilm-l6-v2")[0]  # a real HF tokenizer folder, packaged offline
    gguf_dir = tmp_path / "pkg"
    gguf_dir.mkdir()
    (gguf_dir / "m.gguf").write_bytes(b"GGUF fake")
    monkeypatch.setattr(hf, "_resolve", lambda model_id: (str(gguf_dir), {"gguf_file": "m.gguf"}))
    monkeypatch.setenv("REPRLAB_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(hf, "_IN_MEMORY", {})
    reads = []
    real = hf._from_pretrained

    def from_pretrained(path, kwargs, dtype):
        if path != str(gguf_dir):
            return real(path, kwargs, dtype)  # the disk entry: the real transformers loader
        reads.append(path)
        torch.manual_seed(0)
        cfg = LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)  # fmt: skip
        return LlamaForCausalLM(cfg).to(dtype), AutoTokenizer.from_pretrained(minilm)

    monkeypatch.setattr(hf, "_from_pretrained", from_pretrained)
    return gguf_dir / "m.gguf", reads


def _same(a, b) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb) and all(
        torch.equal(sa[k], sb[k]) for k in sa
    )  # exact: a copy, not a recomputation
    assert a.lm_head.weight.data_ptr() == a.model.embed_tokens.weight.data_ptr()  # tied weights stay tied
    assert b.lm_head.weight.data_ptr() == b.model.embed_tokens.weight.data_ptr()


def test_one_gguf_read_then_memory_and_disk_copies(fake_gguf):
    path, reads = fake_gguf
    m1, t1 = hf.load_causal_lm("any")
    assert len(reads) == 1
    entries = list((path.parent.parent / "cache" / "gguf").iterdir())
    assert len(entries) == 1 and (entries[0] / "model.safetensors").exists()
    m2, t2 = hf.load_causal_lm("any")  # same process: a deep copy, nothing read
    assert len(reads) == 1 and m2 is not m1
    _same(m1, m2)
    m2.model.embed_tokens.weight.data.add_(1.0)  # a caller's edits never reach the kept copy
    _same(m1, hf.load_causal_lm("any")[0])
    hf._IN_MEMORY.clear()  # a new process: the disk entry
    m3, t3 = hf.load_causal_lm("any")
    assert len(reads) == 1
    _same(m1, m3)
    assert t3.encode("hello world") == t1.encode("hello world") and t3.pad_token == t1.pad_token
    x = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        assert torch.equal(m1(x).logits, m3(x).logits)


def test_a_changed_file_or_dtype_is_a_new_entry_and_off_disables_the_disk(fake_gguf, monkeypatch):
    path, reads = fake_gguf
    hf.load_causal_lm("any")
    hf.load_causal_lm("any", dtype=torch.float64)
    assert len(reads) == 2
    st = path.stat()
    os.utime(
        path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9)
    )  # the file changed: its entry no longer applies
    hf._IN_MEMORY.clear()
    hf.load_causal_lm("any")
    assert len(reads) == 3
    monkeypatch.setenv("REPRLAB_CACHE", "off")
    hf._IN_MEMORY.clear()
    n = len(list((path.parent.parent / "cache" / "gguf").iterdir()))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 2 * 10**9))
    hf.load_causal_lm("any")
    assert len(reads) == 4 and len(list((path.parent.parent / "cache" / "gguf").iterdir())) == n


def test_a_damaged_disk_entry_is_read_again_from_the_gguf(fake_gguf):
    path, reads = fake_gguf
    hf.load_causal_lm("any")
    (entry,) = (path.parent.parent / "cache" / "gguf").iterdir()
    (entry / "model.safetensors").write_bytes(b"not safetensors")
    hf._IN_MEMORY.clear()
    m, _ = hf.load_causal_lm("any")
    assert len(reads) == 2
    hf._IN_MEMORY.clear()  # the entry was rewritten: the next process reads it, not the GGUF
    _same(m, hf.load_causal_lm("any")[0])
    assert len(reads) == 2


@pytest.mark.slow
def test_packaged_smollm2_from_the_disk_entry_equals_the_gguf(tmp_path, monkeypatch):
    """The real GGUF (about a minute of CPU): the disk entry gives bitwise the same logits and token ids."""
    monkeypatch.setenv("REPRLAB_CACHE", str(tmp_path))
    monkeypatch.setattr(hf, "_IN_MEMORY", {})
    path, kwargs = hf._resolve("smollm2-135m-instruct")
    ref, rtok = hf._from_pretrained(path, kwargs, torch.float32)
    m, tok = hf.load_causal_lm("smollm2-135m-instruct")  # reads the GGUF, writes the entry
    hf._IN_MEMORY.clear()
    m2, tok2 = hf.load_causal_lm("smollm2-135m-instruct")  # from the entry
    text = "<|im_start|>user\nHow do I bake bread?<|im_end|>\n<|im_start|>assistant\n"
    ids = rtok.encode(text, add_special_tokens=False)
    assert tok.encode(text, add_special_tokens=False) == ids == tok2.encode(text, add_special_tokens=False)
    with torch.no_grad():
        want = ref.eval()(torch.tensor([ids])).logits
        assert torch.equal(m(torch.tensor([ids])).logits, want) and torch.equal(
            m2(torch.tensor([ids])).logits, want
        )
    assert m2.generation_config.to_dict() == ref.generation_config.to_dict()


def test_quiet_switches_off_the_gguf_conversion_bar_and_restores_it(capsys):
    # transformers draws "Converting and de-quantizing GGUF tensors" with a plain tqdm; --quiet must hide it
    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    from reprlab.models.hf import _gguf_bar_off

    before = gguf_utils.tqdm
    with _gguf_bar_off(True):
        for _ in gguf_utils.tqdm(range(3), desc="de-quantizing"):
            pass
    assert "de-quantizing" not in capsys.readouterr().err
    assert gguf_utils.tqdm is before
    with _gguf_bar_off(False):
        for _ in gguf_utils.tqdm(range(3), desc="de-quantizing"):
            pass
    assert "de-quantizing" in capsys.readouterr().err
