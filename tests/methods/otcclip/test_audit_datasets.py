"""The user-data interface (bad items counted and skipped) and the audit ranking."""

import csv
import io
import json
import tarfile

import numpy as np
import pytest
import torch
from PIL import Image

from reprlab.methods.otcclip.audit import audit_pairs, precision_recall, write_outputs
from reprlab.methods.otcclip.datasets import load_pairs
from reprlab.methods.otcclip.mosaic import PairSet, class_prompts
from reprlab.methods.otcclip.tokenizer import WordTokenizer

from .otcclip_oracle import CLASSES, OracleCLIP


def _png(value: int, size: int = 40) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.full((size, size), value, np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def test_csv_and_jsonl_count_and_skip_bad_items(tmp_path):
    (tmp_path / "a.png").write_bytes(_png(80))
    (tmp_path / "b.png").write_bytes(_png(160))
    (tmp_path / "corrupt.png").write_bytes(b"not a png")
    lines = [
        b"image,caption",
        b"a.png,a dog",
        b"b.png,a bag",
        b"corrupt.png,a cat",
        b"missing.png,a cat",
        b"a.png,",
        "a.png,caf\xe9".encode("latin-1"),
    ]
    (tmp_path / "pairs.csv").write_bytes(b"\n".join(lines))
    pairs, names, rep = load_pairs(tmp_path / "pairs.csv", image_size=28)
    assert names == ["a.png", "b.png"] and pairs.captions == ["a dog", "a bag"]
    assert pairs.images.shape == (2, 1, 28, 28) and int(pairs.images[1].float().mean()) == 160
    assert dict(rep.skipped) == {"unreadable_image": 1, "missing_image": 1, "empty_caption": 1, "non_utf8": 1}
    assert rep.as_summary()["data.n_ok"] == 2
    rows = [{"image": "a.png", "caption": "a dog"}, {"path": "b.png", "text": "a bag"}]
    (tmp_path / "p.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n[1, 2]\n")
    pairs, _, rep = load_pairs(tmp_path / "p.jsonl", image_size=28, channels=3)
    assert len(pairs) == 2 and pairs.images.shape[1] == 3 and rep.skipped["bad_row"] == 1


def test_webdataset_shard_and_nothing_valid_errors(tmp_path):
    shard = tmp_path / "s-000.tar"
    with tarfile.open(shard, "w") as tf:
        for name, data in [
            ("k1.png", _png(80)),
            ("k1.txt", b"a dog"),
            ("k2.png", _png(160)),
            ("k2.json", json.dumps({"caption": "a bag"}).encode()),
            ("k3.png", b"junk"),
            ("k3.txt", b"a cat"),
            ("k4.png", _png(0)),
            ("k4.txt", b"\xff\xfe"),
        ]:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    pairs, names, rep = load_pairs(tmp_path, image_size=28)  # a folder of shards
    assert pairs.captions == ["a dog", "a bag"] and names == ["s-000.tar:k1", "s-000.tar:k2"]
    assert rep.skipped == {"unreadable_image": 1, "non_utf8": 1}
    (tmp_path / "bad.csv").write_text("image,caption\nnope.png,a cat\n")
    with pytest.raises(ValueError, match="bad.csv: no valid"):
        load_pairs(tmp_path / "bad.csv")
    with pytest.raises(FileNotFoundError, match="missing.csv"):
        load_pairs(tmp_path / "missing.csv")


def test_audit_ranks_the_swapped_pairs_first_and_writes_reports(tmp_path):
    prompts = class_prompts(CLASSES)
    tok = WordTokenizer.from_texts([p for row in prompts for p in row])
    labels = torch.tensor([0, 1, 2] * 4)
    images = (labels * 80).to(torch.uint8)[:, None, None, None].expand(-1, 1, 56, 56).clone()
    captions = [f"a photo of a {CLASSES[k]}" for k in labels.tolist()]
    captions[4], captions[8] = captions[8], captions[4]  # a dog image says bag and vice versa
    n = len(captions)
    pairs = PairSet(images, captions, torch.zeros(n, dtype=torch.long), torch.arange(n), torch.arange(n))
    res = audit_pairs(OracleCLIP(tok), tok, pairs, top_k=4)
    assert set(np.argsort(-res.score)[:2]) == {4, 8} and res.flagged.tolist() == [
        i in (4, 8) for i in range(n)
    ]
    assert CLASSES[1] in captions[res.suggested[4]]  # suggested caption names what the image shows
    poison = np.zeros(n, bool)
    poison[[4, 8]] = True
    assert precision_recall(res, poison) == {"precision": 1.0, "recall": 1.0, "n_flagged": 2}
    assert precision_recall(res, poison, top=4)["precision"] == 0.5
    write_outputs(tmp_path / "out", pairs, [f"img{i}" for i in range(n)], res, top=5)
    rows = list(csv.DictReader(open(tmp_path / "out" / "flagged.csv")))
    assert {rows[0]["index"], rows[1]["index"]} == {"4", "8"} and rows[0]["flagged"] == "1"
    assert "data:image/png;base64" in (tmp_path / "out" / "audit.html").read_text()
