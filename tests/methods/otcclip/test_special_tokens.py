"""Word dropout never drops a CLIP tokenizer's SOT/EOT (BOS/EOS): open_clip's text tower pools at argmax(ids) = EOT
and a HF CLIP at its EOS, so a dropped EOT would move the pooled caption feature onto another word. Our word
tokenizer has no special tokens and its dropout stays bit-identical to the original rule."""

import json

import pytest
import torch

from reprlab.methods.otcclip.config import TrainConfig
from reprlab.methods.otcclip.data.tokenizer import WordTokenizer, words
from reprlab.methods.otcclip.models.hf import HFTokenizerAdapter
from reprlab.methods.otcclip.models.openclip import OpenCLIPTokenizer
from reprlab.methods.otcclip.training.augment import drop_words
from reprlab.methods.otcclip.training.trainer import Trainer

CAPTIONS = [
    "a sneaker top left a bag bottom right",
    "a bag",
    "a shirt on the left and a coat on the right",
    "coat",
    "the bag on the top left and the sneaker on the bottom right",
] * 8
WORDS = sorted({w for c in CAPTIONS for w in words(c)})


def _old_drop_words(ids, mask, g, p):
    """drop_words before special tokens were kept (the oracle for the word tokenizer)."""
    keep = mask & (torch.rand(ids.shape, generator=g) >= p)
    keep[:, 0] |= ~keep.any(1)
    order = torch.argsort((~keep).to(torch.int8), dim=1, stable=True)
    return torch.gather(ids * keep, 1, order), torch.gather(keep, 1, order)


class _FakeOpenCLIP:
    """open_clip's SimpleTokenizer contract: ``[SOT, words..., EOT, 0...]`` of ``context_length``; SOT/EOT are the
    two largest ids (49406, 49407), so open_clip's ``argmax(ids)`` pooling lands on EOT."""

    sot_token_id, eot_token_id = 49406, 49407
    all_special_ids = [49406, 49407]
    vocab_size = 49408
    context_length = 77

    def __call__(self, texts, context_length=77):
        out = torch.zeros(len(texts), context_length, dtype=torch.long)
        for r, t in enumerate(texts):
            toks = [self.sot_token_id, *(1000 + WORDS.index(w) for w in words(t))][: context_length - 1]
            out[r, : len(toks) + 1] = torch.tensor([*toks, self.eot_token_id])
        return out


def _hf_clip_tokenizer(folder):
    """A real ``CLIPTokenizer`` (CLIP's BPE) from a tiny vocab/merges written here, offline; BOS/EOS are the two
    largest ids as in OpenAI CLIP's vocabulary, and pad is EOS (as there)."""
    from transformers import AutoTokenizer, CLIPTokenizer

    chars = "abcdefghijklmnopqrstuvwxyz"
    vocab = [*chars, *(c + "</w>" for c in chars)]
    merges = []
    for w in WORDS:
        cur = w[0]
        for i, c in enumerate(w[1:], 1):
            nxt = c + ("</w>" if i == len(w) - 1 else "")
            merges.append(f"{cur} {nxt}")
            cur += nxt
            vocab.append(cur)
    vocab = list(dict.fromkeys([*vocab, "<|startoftext|>", "<|endoftext|>"]))
    (folder / "vocab.json").write_text(json.dumps({t: i for i, t in enumerate(vocab)}))
    (folder / "merges.txt").write_text("#version: 0.2\n" + "\n".join(dict.fromkeys(merges)) + "\n")
    CLIPTokenizer(str(folder / "vocab.json"), str(folder / "merges.txt")).save_pretrained(folder / "tok")
    return HFTokenizerAdapter(AutoTokenizer.from_pretrained(folder / "tok"))


def _check_kept_in_place(ids, mask, new, new_mask, sot, eot):
    """SOT first, EOT right after the last kept word (the last valid token, where the pooling reads), each once,
    at least one word kept, the kept words in their order."""
    n = new_mask.sum(1)
    assert torch.equal(new_mask, torch.arange(new.shape[1]) < n[:, None])  # left-packed
    assert (new[:, 0] == sot).all()
    last = n - 1
    assert (new[torch.arange(len(new)), last] == eot).all()
    assert ((new == sot) & new_mask).sum(1).eq(1).all() and ((new == eot) & new_mask).sum(1).eq(1).all()
    assert (n >= 3).all()  # SOT, a word, EOT
    assert torch.equal(new.argmax(-1), last)  # open_clip's pooling position is the EOT
    assert torch.equal((new == eot).int().argmax(-1), last)  # HF CLIP's (first EOS)
    for r in range(len(ids)):
        orig, kept = ids[r][mask[r]].tolist(), new[r][new_mask[r]].tolist()
        it = iter(orig)
        assert all(t in it for t in kept)  # a subsequence: order kept
    dropped = mask.sum(1) - n
    assert dropped.sum() > 0.5 * (mask.sum(1) - 2).sum()  # p = 0.9 did drop words


@pytest.mark.parametrize("kind", ["open_clip", "hf_clip"])
def test_drop_words_keeps_sot_and_eot_in_place(kind, tmp_path):
    if kind == "open_clip":
        tok = OpenCLIPTokenizer(_FakeOpenCLIP())
        sot, eot = 49406, 49407
    else:
        tok = _hf_clip_tokenizer(tmp_path)
        sot, eot = tok.tokenizer.bos_token_id, tok.tokenizer.eos_token_id
        assert eot == len(tok) - 1  # as OpenAI CLIP's: the argmax check below is meaningful
    assert set(tok.special_ids) == {sot, eot}
    ids, mask = tok.encode(CAPTIONS, 24)
    assert (ids[:, 0] == sot).all() and (ids[torch.arange(len(ids)), mask.sum(1) - 1] == eot).all()
    for seed in range(5):
        new, new_mask = drop_words(ids, mask, torch.Generator().manual_seed(seed), 0.9, tok.special_ids)
        _check_kept_in_place(ids, mask, new, new_mask, sot, eot)
    # every word dropped by the draw: the first word is kept between SOT and EOT
    new, new_mask = drop_words(ids, mask, torch.Generator().manual_seed(0), 1.0, tok.special_ids)
    assert torch.equal(new[:, :3], torch.stack([ids[:, 0], ids[:, 1], torch.full_like(ids[:, 0], eot)], 1))
    assert new_mask.sum(1).eq(3).all()


def test_word_tokenizer_drop_words_is_the_original_rule_bit_for_bit():
    tok = WordTokenizer.from_texts(CAPTIONS)
    assert tok.special_ids == ()
    ids, mask = tok.encode(CAPTIONS, 16)
    for seed, p in [(0, 0.1), (1, 0.5), (2, 0.9), (3, 1.0)]:
        g_new, g_old = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed)
        new = drop_words(ids, mask, g_new, p, tok.special_ids)
        old = _old_drop_words(ids, mask, g_old, p)
        assert torch.equal(new[0], old[0]) and torch.equal(new[1], old[1])
        # the same draws: later augmentations unchanged
        assert torch.equal(g_new.get_state(), g_old.get_state())


def test_trainer_batches_keep_the_tokenizers_sot_and_eot(items):
    """The call site: the trainer's two dropped caption views pass the tokenizer's special ids."""
    from reprlab.methods.otcclip.models.tiny import TinyCLIP
    from tests.methods.otcclip.test_trainer import CFG, DCFG, _data

    class Small(_FakeOpenCLIP):  # ids inside a TinyCLIP vocabulary
        sot_token_id, eot_token_id = 98, 99
        all_special_ids = [98, 99]
        vocab_size = 100

        def __call__(self, texts, context_length=77):
            out = super().__call__(texts, context_length)
            return out.where(out < 1000, out - 1000 + 2).where(out != 49406, 98).where(out != 49407, 99)

    data = _data(items)
    data.captions[:] = [CAPTIONS[i % len(CAPTIONS)] for i in range(len(data.captions))]
    tok = OpenCLIPTokenizer(Small())
    torch.manual_seed(0)
    tr = Trainer(
        TinyCLIP(CFG, len(tok)),
        data,
        tok,
        "none",
        TrainConfig(epochs=1, batch_size=16, warmup_steps=1, word_dropout=0.9),
        DCFG,
        seed=0,
    )
    b = tr.batch(torch.arange(16), 0, 0, "clip")
    for ids, mask in ((b.ids1, b.mask1), (b.ids2, b.mask2)):
        n = mask.sum(1)
        assert (ids[:, 0] == 98).all() and (ids[torch.arange(len(ids)), n - 1] == 99).all()
        assert torch.equal(ids.argmax(-1), n - 1)


def test_hf_clip_from_scratch_with_a_clip_tokenizer_pools_at_its_eos_also_after_dropout(tmp_path):
    """``model.arch=hf_clip model.tokenizer=<folder>``: the text feature is the EOS token's (HF pools at the first
    id equal to the config's eos_token_id, which must be the tokenizer's), before and after word dropout."""
    from reprlab.methods.otcclip.config import ModelConfig
    from reprlab.methods.otcclip.models.build import build_model

    tok = _hf_clip_tokenizer(tmp_path)
    cfg = ModelConfig(arch="hf_clip", tokenizer=str(tmp_path / "tok"), width=16, text_width=16, layers=1,
                      text_layers=1, heads=2, text_heads=2, embed_dim=8, image_size=14, patch_size=7, max_len=24)  # fmt: skip
    torch.manual_seed(0)
    model = build_model(cfg, len(tok)).eval()
    ids, mask = tok.encode(CAPTIONS[:5], cfg.max_len)
    dropped = drop_words(ids, mask, torch.Generator().manual_seed(0), 0.9, tok.special_ids)
    for i, m in ((ids, mask), dropped):
        with torch.no_grad():
            got = model.encode_text(i, m).global_
            h = model.clip.text_model(input_ids=i, attention_mask=m.long()).last_hidden_state
            want = model.clip.text_projection(h[torch.arange(len(i)), m.sum(1) - 1])
        assert torch.allclose(got, torch.nn.functional.normalize(want, dim=-1), atol=1e-5)
