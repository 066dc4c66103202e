"""The user-data interface (bad items counted and skipped) and the audit ranking."""

import csv
import io
import json
import tarfile

import numpy as np
import pytest
import torch
from PIL import Image

from reprlab.methods.otcclip.data.datasets import load_pairs
from reprlab.methods.otcclip.data.mosaic import class_prompts
from reprlab.methods.otcclip.data.pairs import PairSet
from reprlab.methods.otcclip.data.tokenizer import WordTokenizer
from reprlab.methods.otcclip.evaluation.audit import audit_pairs, precision_recall, write_outputs

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


def _two_images(tmp_path):
    (tmp_path / "a.png").write_bytes(_png(80))
    (tmp_path / "b.png").write_bytes(_png(160))


def test_csv_caption_over_128_kib_is_counted_and_skipped_not_a_crash(tmp_path):
    _two_images(tmp_path)
    huge = "word " * 30_000  # 150 KB: above the csv module's default field limit (131072)
    (tmp_path / "p.csv").write_text(f'image,caption\na.png,a dog\nb.png,"{huge}"\nb.png,a bag\n')
    limit = csv.field_size_limit()
    pairs, _, rep = load_pairs(tmp_path / "p.csv", image_size=28)
    assert pairs.captions == ["a dog", "a bag"] and dict(rep.skipped) == {"caption_too_long": 1}
    assert csv.field_size_limit() == limit  # the process-global csv limit is restored


def test_non_utf8_byte_in_the_header_keeps_every_row_parsed(tmp_path):
    _two_images(tmp_path)
    # a stray latin-1 byte in an unrelated third column name; before, the header line was dropped and
    # the first data row became the header
    lines = [b"image,caption,not\xe9s", b"a.png,a dog,x", b"b.png,a bag,y"]
    (tmp_path / "p.csv").write_bytes(b"\n".join(lines))
    pairs, _, rep = load_pairs(tmp_path / "p.csv", image_size=28)
    assert pairs.captions == ["a dog", "a bag"] and not rep.skipped
    assert len(rep.notes) == 1 and "p.csv:1" in rep.notes[0]


def test_missing_or_misnamed_columns_name_the_file_and_the_expected_columns(tmp_path):
    from reprlab.errors import ConfigError, DataError

    _two_images(tmp_path)
    (tmp_path / "nocap.csv").write_text("image,label\na.png,3\n")
    with pytest.raises(DataError, match=r"nocap.csv: no caption column.*'caption', 'text', 'title'"):
        load_pairs(tmp_path / "nocap.csv")
    (tmp_path / "wrong.csv").write_text("img,desc\na.png,a dog\n")
    with pytest.raises(
        DataError, match=r"wrong.csv: no image and caption column.*\['img', 'desc'\].*'image'"
    ):
        load_pairs(tmp_path / "wrong.csv")
    # JSONL rows are judged one by one: a row without a caption key is missing_caption, not empty_caption
    rows = [
        {"image": "a.png", "caption": "a dog"},
        {"image": "b.png"},
        {"image": "b.png", "caption": " "},
        {},
    ]
    (tmp_path / "p.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    _, _, rep = load_pairs(tmp_path / "p.jsonl", image_size=28)
    assert dict(rep.skipped) == {"missing_caption": 1, "empty_caption": 1, "missing_image_path": 1}
    (tmp_path / "short.csv").write_text("image,caption\na.png,a dog\nb.png\n")
    _, _, rep = load_pairs(tmp_path / "short.csv", image_size=28)
    assert dict(rep.skipped) == {"short_row": 1}
    with pytest.raises(ConfigError, match="max_items"):
        load_pairs(tmp_path / "short.csv", max_items=0)
    with pytest.raises(DataError, match="glob"):
        load_pairs(tmp_path / "none-*.tar")


def test_audit_options_are_validated_with_a_clear_error(tmp_path):
    from typer.testing import CliRunner

    from reprlab.cli import app  # through `reprlab otcclip audit`: an input error is one line and exit 2
    from reprlab.errors import ConfigError
    from reprlab.methods.otcclip.evaluation.audit import validate_options

    _two_images(tmp_path)
    (tmp_path / "p.csv").write_text("image,caption\na.png,a dog\n")
    res = CliRunner().invoke(
        app, ["otcclip", "audit", str(tmp_path / "p.csv"), "--top-k", "0", "--hf-model", "x"]
    )
    assert res.exit_code == 2 and "--top-k must be >= 1" in res.output and "Traceback" not in res.output
    for kw, opt in (
        (dict(alpha=1.5), "--alpha"),
        (dict(top=-1), "--top"),
        (dict(max_items=0), "--max-items"),
    ):
        with pytest.raises(ConfigError, match=opt):
            validate_options(**kw)


def test_audit_hf_model_maps_pixels_to_the_processors_mean_and_std(tmp_path):
    """The audit reads images into [-1, 1] like the trainer; a HF CLIP must then see its own processor's
    normalisation (read from the model folder's ``preprocessor_config.json``), not the raw [-1, 1] pixels."""
    import json

    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import CLIPConfig, CLIPModel, PreTrainedTokenizerFast

    from reprlab.methods.otcclip.models.hf import HFCLIPAdapter, load_hf_model

    torch.manual_seed(0)
    cfg = CLIPConfig(
        text_config=dict(vocab_size=8, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, max_position_embeddings=8),
        vision_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                           image_size=16, patch_size=8),
        projection_dim=8,
    )  # fmt: skip
    CLIPModel(cfg).save_pretrained(tmp_path)
    tk = Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1, "b": 2}, unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="[UNK]").save_pretrained(tmp_path)
    mean, std = [0.1, 0.2, 0.3], [0.5, 0.25, 0.125]
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({"image_mean": mean, "image_std": std}))
    model, _tok = load_hf_model(str(tmp_path), max_len=8)
    model.eval()
    x = torch.rand(2, 3, 16, 16) * 2 - 1
    raw = HFCLIPAdapter(model.clip, 8)  # no pixel_norm: expects model-normalised pixels
    m, s = torch.tensor(mean).view(1, 3, 1, 1), torch.tensor(std).view(1, 3, 1, 1)
    with torch.no_grad():
        want = raw.encode_image(((x + 1) / 2 - m) / s).global_
        got = model.encode_image(x).global_
        assert torch.allclose(got, want, atol=1e-6)
        assert not torch.allclose(got, raw.encode_image(x).global_, atol=1e-3)
