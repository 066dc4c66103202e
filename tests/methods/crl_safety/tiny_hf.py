"""A tiny random Llama saved as a Hugging Face folder with a real byte-level tokenizer and a chat template
(:mod:`reprlab.models.random_llama`, under the name these tests import)."""

from reprlab.models.random_llama import CHAT_TEMPLATE, SPECIALS, random_llama_folder

tiny_llama_folder = random_llama_folder

__all__ = ["CHAT_TEMPLATE", "SPECIALS", "tiny_llama_folder"]
