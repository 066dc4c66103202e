"""Webdataset shards: what is written is what streams back (each sample exactly once across DataLoader
workers and ranks), webdataset's own reader and the audit loader agree (reading itself: test_shard_reader.py)."""

import json

import pytest
import torch
from torch.utils.data import DataLoader

from reprlab.methods.otcclip.data import shards as sh
from reprlab.methods.otcclip.data.mosaic import make_mosaics
from reprlab.methods.otcclip.data.pairs import SignatureIndex
from reprlab.methods.otcclip.data.poison import add_backdoor
from reprlab.methods.otcclip.data.shard_reader import expand_shards


@pytest.fixture
def pairs(items):
    sigs = SignatureIndex()
    clean = make_mosaics(23, seed=0, source=items, signatures=sigs)
    return add_backdoor(clean, 3, target_class=8, trigger="sig", seed=1, signatures=sigs)


def _by_index(samples):
    return {int(s["index"]): s for s in samples}


def test_written_shards_stream_back_exactly_once_across_workers(pairs, tmp_path):
    paths = sh.write_shards(pairs, tmp_path, shard_size=5)
    assert [p.name for p in paths] == [f"mosaics-{i:06d}.tar" for i in range(5)]  # 23 = 4 x 5 + 3
    manifest = json.loads((tmp_path / sh.MANIFEST).read_text())
    assert manifest["n_samples"] == 23 and manifest["shards"] == [p.name for p in paths]
    loader = DataLoader(sh.ShardStream(tmp_path), batch_size=None, num_workers=2)
    got = list(loader)
    assert sorted(int(s["index"]) for s in got) == list(range(23))  # each sample once
    for i, s in _by_index(got).items():
        assert torch.equal(s["image"], pairs.images[i]) and s["caption"] == pairs.captions[i]
        assert s["kind"] == int(pairs.kind[i])
    assert sum(s["kind"] == 2 for s in got) == 3  # the backdoor rows and their provenance survive


def test_ranks_and_workers_partition_the_shards(pairs, tmp_path):
    sh.write_shards(pairs, tmp_path, shard_size=2)  # 12 shards
    seen = []
    for rank in range(2):
        stream = sh.ShardStream(tmp_path, rank=rank, world_size=2, shuffle_shards=True, seed=3)
        stream.set_epoch(1)
        seen += [int(s["index"]) for s in DataLoader(stream, batch_size=None, num_workers=2)]
    assert sorted(seen) == list(range(23))
    a, b = (sh.ShardStream(tmp_path, shuffle_shards=True, seed=3) for _ in range(2))
    b.set_epoch(1)
    assert a.my_shards() != b.my_shards() and sorted(a.my_shards()) == sorted(b.my_shards())
    with pytest.raises(ValueError, match="rank"):
        sh.ShardStream(tmp_path, rank=2, world_size=2)


def test_shuffle_buffer_permutes_and_keeps_every_sample(pairs, tmp_path):
    sh.write_shards(pairs, tmp_path, shard_size=100)
    plain = [int(s["index"]) for s in sh.ShardStream(tmp_path)]
    mixed = [int(s["index"]) for s in sh.ShardStream(tmp_path, shuffle_buffer=8, seed=1)]
    assert plain == list(range(23)) and sorted(mixed) == plain and mixed != plain


def test_shards_are_reproducible_and_read_by_webdataset_and_the_audit_loader(pairs, tmp_path):
    a = sh.write_shards(pairs, tmp_path / "a", shard_size=10)
    b = sh.write_shards(pairs, tmp_path / "b", shard_size=10)
    assert [p.read_bytes() for p in a] == [p.read_bytes() for p in b]  # byte-identical
    from reprlab.methods.otcclip.data.datasets import load_pairs

    loaded, names, report = load_pairs(tmp_path / "a", image_size=56, channels=1)
    assert len(names) == 23 and sorted(loaded.captions) == sorted(pairs.captions)
    order = [int(n.rsplit(":", 1)[1]) for n in names]  # "shard.tar:key"
    assert torch.equal(loaded.images, pairs.images[order])
    wds = pytest.importorskip("webdataset")  # the format's own reader as the oracle
    got = list(wds.WebDataset([str(p) for p in a], shardshuffle=False).decode("l8"))
    assert len(got) == 23
    for s in got:
        i = json.loads(s["json"])["index"] if isinstance(s["json"], bytes) else s["json"]["index"]
        assert s["__key__"] == f"{i:09d}" and s["txt"] == pairs.captions[i]
        assert torch.equal(torch.tensor(s["png"])[None], pairs.images[i])


def test_bad_sample_and_arguments_raise(tmp_path, pairs):
    with pytest.raises(ValueError, match="shard_size"):
        sh.write_shards(pairs, tmp_path, shard_size=0)
    import io
    import tarfile

    with tarfile.open(tmp_path / "bad.tar", "w") as tf:
        info = tarfile.TarInfo("000.txt")
        info.size = 2
        tf.addfile(info, io.BytesIO(b"hi"))
    with pytest.raises(ValueError, match="lacks"):
        list(sh.read_samples(tmp_path / "bad.tar"))
    with pytest.raises(FileNotFoundError):
        expand_shards(tmp_path / "empty_dir_that_is_missing")


def test_make_shards_cli_writes_the_poisoned_testbed(tmp_path):
    from typer.testing import CliRunner

    from reprlab.cli import app
    from reprlab.methods.otcclip.config import DataConfig
    from reprlab.methods.otcclip.data.testbed import build_testbed

    out = tmp_path / "shards"
    res = CliRunner().invoke(
        app, ["otcclip", "make-shards", str(out), "--n-pairs", "300", "--shard-size", "100", "--seed", "1"]
    )
    assert res.exit_code == 0, res.output
    got = _by_index(sh.ShardStream(out))
    ref = build_testbed(
        DataConfig(
            n_pairs=300, max_items=2, captions_per_target=30, backdoor_pairs=75, n_eval=1, n_probe_train=1
        ),
        seed=1,
    ).pairs
    assert len(got) == len(ref) == 300 + 4 * 30  # clean pairs + targeted poisons
    assert all(
        got[i]["caption"] == ref.captions[i] and torch.equal(got[i]["image"], ref.images[i]) for i in got
    )
    assert sum(s["kind"] == 2 for s in got.values()) == 75  # min(120, n_pairs // 4)
    bad = CliRunner().invoke(app, ["otcclip", "make-shards", str(out), "--trigger", "nope"])
    assert bad.exit_code == 2 and "nope" in bad.output


def test_shuffled_write_spreads_the_appended_poisons_over_the_shards(pairs, tmp_path):
    """The testbed appends its poisons last; written with a seed they land in every shard, each sample once."""
    sh.write_shards(pairs, tmp_path / "plain", shard_size=5)
    sh.write_shards(pairs, tmp_path / "mixed", shard_size=5, shuffle_seed=0)
    plain = [int(s["index"]) for s in sh.ShardStream(tmp_path / "plain")]
    mixed = [int(s["index"]) for s in sh.ShardStream(tmp_path / "mixed")]
    assert plain == list(range(23)) and sorted(mixed) == plain and mixed != plain
    got = _by_index(sh.ShardStream(tmp_path / "mixed"))
    assert all(
        got[i]["caption"] == pairs.captions[i] and torch.equal(got[i]["image"], pairs.images[i]) for i in got
    )
    backdoor_rows = [k for k, i in enumerate(mixed) if pairs.kind[i] == 2]
    assert len({k // 5 for k in backdoor_rows}) > 1  # not one block
