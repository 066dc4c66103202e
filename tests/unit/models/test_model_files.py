"""A local model folder is checked before any run folder exists: its weights, a tokenizer that loads and
tokenizes, and (where the recipe formats chats) a chat template. Each case was a traceback after the run folder
was made, or, for an encoder folder without tokenizer files, a run that exited 0 with every word read as
[UNK] (transformers builds an empty vocabulary) and every statistic undefined."""

import pytest

from reprlab.errors import ConfigError
from reprlab.models.hf import check_model_files
from tests.cli_errors import assert_run_refused

WORDS = "the quick brown fox jumps over lazy dog".split()


def _tokenizer(folder, chat: bool):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["[UNK]", "[EOS]", *WORDS])}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="[UNK]", eos_token="[EOS]")
    if chat:
        tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    tok.save_pretrained(folder)


def _bert(folder, weights=True):
    from transformers import BertConfig, BertModel

    cfg = BertConfig(
        vocab_size=16, hidden_size=8, num_hidden_layers=1, num_attention_heads=2, intermediate_size=8
    )
    (BertModel(cfg).save_pretrained if weights else cfg.save_pretrained)(folder)
    return str(folder)


def _gpt2(folder):
    from transformers import GPT2Config, GPT2LMHeadModel

    GPT2LMHeadModel(GPT2Config(vocab_size=16, n_positions=16, n_embd=8, n_layer=1, n_head=2)).save_pretrained(
        folder
    )
    return str(folder)


def test_folders_without_weights_or_a_working_tokenizer_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="holds no weights"):
        check_model_files(_bert(tmp_path / "config-only", weights=False), "encoder.model")
    check_model_files(
        str(tmp_path / "config-only"), "m", weights=False, tokenizer=False
    )  # built from its config
    # no tokenizer files: BERT gets an empty WordPiece vocabulary (every word [UNK]), GPT-2 one that gives nothing
    with pytest.raises(ConfigError, match=r"encoder.model=.*turns plain text into only the unknown token"):
        check_model_files(_bert(tmp_path / "bert"), "encoder.model")
    with pytest.raises(ConfigError, match=r"turns plain text into no token|no tokenizer could be loaded"):
        check_model_files(_gpt2(tmp_path / "gpt2"), "model")
    _tokenizer(tmp_path / "bert", chat=False)  # the same folder with a real (tiny) tokenizer passes
    check_model_files(str(tmp_path / "bert"), "encoder.model")
    with pytest.raises(ConfigError, match="no chat template"):
        check_model_files(str(tmp_path / "bert"), "model", chat_template=True)
    _tokenizer(tmp_path / "bert", chat=True)
    check_model_files(str(tmp_path / "bert"), "model", chat_template=True)
    check_model_files("smollm2-135m-instruct", "model", chat_template=True)  # packaged: left to its loader


def test_a_tokenizer_whose_ids_pass_the_models_embedding_is_refused(tmp_path):
    """Another model's tokenizer in the folder: its ids index past the embedding (an IndexError mid-run, or two
    words sharing a row). The tiny tokenizer's ids reach 9; a 16-row model passes, an 8-row one does not."""
    from reprlab.models.hf import preflight_model

    _tokenizer(tmp_path / "bert", chat=False)
    _bert(tmp_path / "bert")
    preflight_model(str(tmp_path / "bert"), "encoder.model")
    check_model_files(str(tmp_path / "bert"), "m", vocab_size=16)
    with pytest.raises(ConfigError, match=r"gives ids up to 9, past the 8 embedding rows"):
        check_model_files(str(tmp_path / "bert"), "m", vocab_size=8)


def test_recipes_refuse_such_folders_before_the_run_folder(tmp_path):
    bert = _bert(tmp_path / "bert")
    assert_run_refused(tmp_path / "n", "normic-tiny", [f"encoder.model={bert}"], "turns plain text into only")
    only = _bert(tmp_path / "config-only", weights=False)
    assert_run_refused(tmp_path / "c", "crl-tiny", [f"model={only}"], "holds no weights")
    assert_run_refused(tmp_path / "t", "rote-thr-tiny", [f"model.hf_id={only}"], "holds no weights")


def test_crl_layer_specs_are_checked_against_a_folder_models_depth(tmp_path):
    """crl-tiny's default `third:-2` selects no layer of a 2-layer model: refused at preflight, naming the key,
    instead of a traceback once stage 0 had trained."""
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = tmp_path / "llama2"
    cfg = LlamaConfig(vocab_size=16, hidden_size=8, intermediate_size=16, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)  # fmt: skip
    LlamaForCausalLM(cfg).save_pretrained(folder)
    _tokenizer(folder, chat=True)
    assert_run_refused(tmp_path / "c", "crl-tiny", [f"model={folder}"], "does not fit a model with 2 layers")


def test_normic_refuses_a_causal_lm_read_as_an_encoder_and_the_reverse(tmp_path):
    """A causal LM as `encoder.model` ran to exit 0 with 'pooled' = its first token's state, which no word can
    change under the causal mask; an encoder as `decoder.model` stopped mid-run on a missing EOS. Both are
    read from the folder's saved classes at preflight."""
    gpt2 = _gpt2(tmp_path / "gpt2")
    _tokenizer(tmp_path / "gpt2", chat=False)
    bert = _bert(tmp_path / "bert")
    _tokenizer(tmp_path / "bert", chat=False)
    off = ["static.sgns=false", "static.glove=false", "length.enabled=false"]
    assert_run_refused(tmp_path / "o1", "normic-tiny", [*off, f"encoder.model={gpt2}", "encoder.layers=[-1]"],
                       "is a decoder (GPT2LMHeadModel), but encoder.arch='encoder'")  # fmt: skip
    assert_run_refused(tmp_path / "o2", "normic-tiny", [*off, "encoder.enabled=false", "decoder.enabled=true",
                                                        f"decoder.model={bert}", "decoder.layers=[-1]"],
                       "is an encoder (bert: BertModel), but decoder.arch='decoder'")  # fmt: skip
    # a class that is not plainly one or the other (a bare LlamaModel, a multimodal wrapper) is left to the loader
    from transformers import LlamaConfig

    from reprlab.methods.norm_ic.recipe import _check_arch

    bare = LlamaConfig(architectures=["LlamaModel"])
    _check_arch(bare, "decoder", "decoder", "m")
    _check_arch(LlamaConfig(architectures=["Gemma3ForConditionalGeneration"]), "decoder", "decoder", "m")


def test_normic_warns_when_a_users_model_keeps_the_recipes_label(tmp_path, caplog):
    """encoder.model set and encoder.name left at the recipe's 'minilm': the summary, tables and paper claims
    would name the user's model as MiniLM; preflight says so (a warning: a deliberate re-label is allowed)."""
    import logging

    from reprlab.methods.norm_ic.recipe import preflight
    from reprlab.recipes import get_recipe

    bert = _bert(tmp_path / "bert")
    _tokenizer(tmp_path / "bert", chat=False)
    off = ["static.sgns=false", "static.glove=false", "length.enabled=false", "encoder.layers=[-1]"]
    with caplog.at_level(logging.WARNING):
        preflight(get_recipe("normic-tiny").build_config([*off, f"encoder.model={bert}"]))
    assert "is labelled 'minilm' (encoder.name)" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        preflight(
            get_recipe("normic-tiny").build_config([*off, f"encoder.model={bert}", "encoder.name=mine"])
        )
    assert "is labelled" not in caplog.text
