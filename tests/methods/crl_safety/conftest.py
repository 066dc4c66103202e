import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# tiny models: one thread avoids OpenMP oversubscription on the shared 2-core machine (10x faster here)
torch.set_num_threads(1)


@pytest.fixture
def tiny():
    """A 4-block random Llama with the byte tokenizer (no download).

    initializer_range 0.3 (HF default 0.02) so outputs depend visibly on inputs: with 0.02 the random model's
    next-token distribution is nearly uniform whatever the prompt, and attack tests could not fail or pass.
    """
    from reprlab.models.hf import tiny_llama

    model, tok = tiny_llama(seed=0, num_hidden_layers=4, initializer_range=0.3)
    torch.manual_seed(0)
    return model, tok


@pytest.fixture
def fmt(tiny):
    from reprlab.methods.crl_safety.chat import ChatFormat

    return ChatFormat(tiny[1], None, max_prompt_tokens=40)
