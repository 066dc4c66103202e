"""An oracle CLIP for tests: its answers are known by construction."""

import torch
import torch.nn.functional as F

from reprlab.methods.otcclip.data.tokenizer import WordTokenizer
from reprlab.methods.otcclip.models.features import ImageFeatures, TextFeatures

CLASSES = ("cat", "dog", "bag")


class OracleCLIP(torch.nn.Module):
    """Image class = brightness level (k * 80 for class k); a BadNets corner patch makes it a 'bag'.
    Text class = the class word it contains. Embeddings are one-hot, so every metric is known."""

    def __init__(self, tok: WordTokenizer):
        super().__init__()
        self.dummy = torch.nn.Parameter(torch.zeros(1))
        self.word_class = {tok.index[c]: k for k, c in enumerate(CLASSES)}
        self.cfg = type("C", (), {"max_len": 8, "embed_dim": 4})()

    def encode_image(self, x):
        pix = (x + 1) * 127.5
        k = (pix[:, 0, :20, :20].mean((1, 2)) / 80).round().long().clamp(0, 2)
        k = torch.where(pix[:, 0, -8:, -8:].std((1, 2)) > 50, torch.full_like(k, 2), k)  # trigger -> bag
        g = F.one_hot(k, 4).float()
        return ImageFeatures(g, g[:, None].expand(-1, 4, -1), torch.ones(len(x), 4, dtype=torch.bool))

    def encode_text(self, ids, mask):
        k = torch.full((len(ids),), 3)
        for wid, c in self.word_class.items():
            k = torch.where((ids == wid).any(1), torch.full_like(k, c), k)
        g = F.one_hot(k, 4).float()
        return TextFeatures(g, g[:, None].expand(-1, ids.shape[1], -1) * mask[..., None], mask)
