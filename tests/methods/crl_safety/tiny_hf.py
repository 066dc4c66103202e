"""A tiny random Llama saved as a Hugging Face folder with a real byte-level tokenizer and a chat template.

``reprlab.models.hf.tiny_llama``'s tokenizer is a stand-in transformers cannot save or load; exports need a
folder that ``AutoTokenizer`` reads, built here offline with the ``tokenizers`` library.
"""

from __future__ import annotations

from pathlib import Path

import torch

SPECIALS = ["<pad>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def tiny_llama_folder(path: Path, seed: int = 0, **overrides) -> Path:
    """Write the model (4 blocks, d_model 32) and its tokenizer to ``path``; returns ``path``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

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
    cfg = dict(vocab_size=len(vocab), hidden_size=32, intermediate_size=64, num_hidden_layers=4,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, bos_token_id=1,
               eos_token_id=2, pad_token_id=0, initializer_range=0.3, tie_word_embeddings=False)  # fmt: skip
    cfg.update(overrides)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**cfg)).eval()
    model.save_pretrained(str(path))
    tok.save_pretrained(str(path))
    return Path(path)
