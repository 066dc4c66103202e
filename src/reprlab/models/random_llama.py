"""A randomly initialised Llama saved as a Hugging Face folder, with a real byte-level tokenizer and a chat
template: a model any ``model=`` argument takes, built offline.

Two uses: tests (tiny blocks, seconds on a CPU) and measuring time and memory of a model's shape where its
weights cannot be had (``SMOLLM2_135M_BLOCKS``: the transformer blocks of SmolLM2-135M, as its GGUF declares them).
:func:`reprlab.models.hf.tiny_llama` is the in-memory variant, whose tokenizer transformers cannot save.
"""

from __future__ import annotations

from pathlib import Path

import torch

SPECIALS = ["<pad>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
TINY_BLOCKS = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                   num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.3,
                   tie_word_embeddings=False)  # fmt: skip
# SmolLM2-135M-Instruct's blocks (llama.block_count, embedding_length, feed_forward_length, head_count(_kv),
# rope.freq_base, layer_norm_rms_epsilon of the packaged GGUF); its 49,152-token vocabulary is not reproduced: the
# byte tokenizer has 262 ids, so the embedding and output matrices are smaller (0.15M instead of 28M parameters each)
SMOLLM2_135M_BLOCKS = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                           num_key_value_heads=3, max_position_embeddings=2048, rope_theta=100000.0,
                           rms_norm_eps=1e-5, initializer_range=0.02, tie_word_embeddings=True)  # fmt: skip


def byte_tokenizer():
    """A ``PreTrainedTokenizerFast``: one token per UTF-8 byte after :data:`SPECIALS`, left padding, the chat
    template :data:`CHAT_TEMPLATE`; saved and loaded by ``AutoTokenizer`` like any other."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {s: i for i, s in enumerate(SPECIALS)}
    for ch in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[ch] = len(vocab)
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))  # no merges: one token per byte
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                  additional_special_tokens=SPECIALS[3:])  # fmt: skip
    tok.chat_template = CHAT_TEMPLATE
    tok.padding_side = "left"
    return tok


def random_llama_folder(path: Path | str, seed: int = 0, blocks: dict | None = None, **overrides) -> Path:
    """Write a random ``LlamaForCausalLM`` (``blocks``: :data:`TINY_BLOCKS` by default, then ``overrides``) and
    :func:`byte_tokenizer` to ``path``; returns ``path``. The same ``seed`` and shape give the same weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = byte_tokenizer()
    cfg = dict(vocab_size=len(tok), bos_token_id=1, eos_token_id=2, pad_token_id=0)
    cfg.update(TINY_BLOCKS if blocks is None else blocks)
    cfg.update(overrides)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**cfg)).eval()
    model.save_pretrained(str(path))
    tok.save_pretrained(str(path))
    return Path(path)
