"""Re-matching (OTCCLIP OT re-ranking, RoCLIP nearest neighbour) and the caption bank."""

import torch
import torch.nn.functional as F

from reprlab.methods.otcclip.losses import OTConfig
from reprlab.methods.otcclip.matching import CaptionBank, nn_rematch, otc_rematch

E = torch.eye(4)
OT = OTConfig(eps=0.01, n_iters=200)


def _pool():
    """Candidate 0 ("B"): global cos 1 with the image but every token sits between the two patches;
    candidate 1 ("A"): slightly lower global cos, tokens equal to the patches (OT distance ~0)."""
    mid = F.normalize(E[0] + E[1], dim=0)
    tokens = torch.stack([torch.stack([mid, mid]), torch.stack([E[0], E[1]])])  # [P=2, m=2, d=4]
    glob = torch.stack([mid, F.normalize(E[0] + E[1] + 0.1 * E[2], dim=0)])
    return glob, tokens, torch.ones(2, 2, dtype=torch.bool)


def test_ot_reranking_prefers_the_caption_whose_tokens_match_the_patches():
    glob, tokens, mask = _pool()
    u = F.normalize(E[0] + E[1], dim=0)[None]
    patches = torch.stack([E[0], E[1]])[None]  # [1, n=2, d]
    cos = (u @ glob.T)[0]
    assert cos[0] > cos[1]  # the global-only rule (RoCLIP-like) picks candidate 0
    assert nn_rematch(u, glob).index.item() == 0
    assert otc_rematch(u, patches, glob, tokens, mask, top_k=2, alpha=1.0, ot=OT).index.item() == 0
    res = otc_rematch(u, patches, glob, tokens, mask, top_k=2, alpha=0.5, ot=OT)
    assert res.index.item() == 1  # OT distance 1 - cos(e1, mid) = 0.29 outweighs the cosine gap 0.005
    # known distances: ~0 for the matching tokens, 1 - 1/sqrt(2) for the midpoint tokens (entropic blur)
    assert abs(res.ot[0, 1].item()) < 0.01 and abs(res.ot[0, 0].item() - (1 - 2**-0.5)) < 0.01
    # the shortlist is applied before OT: with k = 1 only the top-cosine caption is considered
    assert otc_rematch(u, patches, glob, tokens, mask, top_k=1, alpha=0.5, ot=OT).index.item() == 0


def test_nn_rematch_equals_brute_force():
    torch.manual_seed(0)
    u, w = F.normalize(torch.randn(7, 5), dim=-1), F.normalize(torch.randn(11, 5), dim=-1)
    res = nn_rematch(u, w)
    brute = torch.tensor([max(range(11), key=lambda j: float(u[i] @ w[j])) for i in range(7)])
    assert torch.equal(res.index, brute)


def test_caption_bank_is_fifo_and_pads():
    bank = CaptionBank(capacity=3, max_len=4, dim=2)
    for start in (0, 2):
        ids = torch.tensor([[start + 1, 0], [start + 2, 0]])
        bank.enqueue(
            ids,
            ids != 0,
            torch.ones(2, 2),
            torch.ones(2, 2, 2),
            torch.tensor([start + 1, start + 2]),
            torch.tensor([False, True]),
        )
    got = bank.entries()
    assert len(bank) == 3 and sorted(got["sig"].tolist()) == [2, 3, 4]  # oldest (1) overwritten
    assert got["ids"].shape == (3, 4) and (got["ids"][:, 1:] == 0).all() and (got["tokens"][:, 2:] == 0).all()
    assert got["poison"].sum() == 2


def test_own_caption_is_kept_unless_beaten_by_the_margin():
    glob, tokens, mask = _pool()
    u = F.normalize(E[0] + E[1], dim=0)[None]
    patches = torch.stack([E[0], E[1]])[None]
    own = torch.tensor([0])  # the image currently holds candidate 0; candidate 1 scores ~0.14 higher
    assert otc_rematch(u, patches, glob, tokens, mask, 2, 0.5, OT, own_index=own).index.item() == 1
    assert (
        otc_rematch(u, patches, glob, tokens, mask, 2, 0.5, OT, own_index=own, margin=0.5).index.item() == 0
    )
    # the own caption is a candidate even when the shortlist (k = 1 -> candidate 0 only) would miss it
    assert (
        otc_rematch(u, patches, glob, tokens, mask, 1, 0.5, OT, own_index=torch.tensor([1])).index.item() == 1
    )
