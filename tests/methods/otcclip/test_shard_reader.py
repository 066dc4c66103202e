"""Shards read with webdataset's semantics through webdataset: keys and bytes equal ``webdataset.WebDataset``'s
(fast ustar reader and ``tar_file_iterator`` alike, on plain, pax, GNU, prefixed, compressed and foldered tars);
same base name in two folders stays two samples; unsafe member names are refused with the shard's name; a
truncated shard or a corrupt image is skipped and counted (or stops the run, ``stream.on_bad_sample=error``),
never a crash inside a DataLoader worker; brace patterns and webdataset's node/worker splits."""

from __future__ import annotations

import gzip
import io
import shutil
import tarfile
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
import webdataset as wds
from torch.utils.data import DataLoader

from reprlab.errors import DataError, DataFileMissingError
from reprlab.methods.otcclip.config import StreamConfig
from reprlab.methods.otcclip.data import shard_reader as rd
from reprlab.methods.otcclip.data import shards as sh
from reprlab.methods.otcclip.data.datasets import load_pairs
from reprlab.methods.otcclip.data.sources import ShardSource, open_source
from tests.methods.otcclip.test_stream import _png, _stream_trainer
from tests.methods.otcclip.test_trainer import _data


def _tar(path: Path, members, fmt=tarfile.USTAR_FORMAT) -> Path:
    """A tar of ``(name, bytes)`` members (``bytes`` None: a directory)."""
    with tarfile.open(path, "w", format=fmt) as tf:
        for name, data in members:
            info = tarfile.TarInfo(name)
            if data is None:
                info.type = tarfile.DIRTYPE
                tf.addfile(info)
                continue
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    return path


def _wds_samples(path: Path) -> list[dict]:
    """The oracle: webdataset's own pipeline, without decoding, as ``{"__key__", ext: bytes}``."""
    ds = wds.WebDataset(str(path), shardshuffle=False, empty_check=False)
    return [{k: v for k, v in s.items() if k == "__key__" or not k.startswith("__")} for s in ds]


def _ours(path: Path, fast: bool) -> list[dict]:
    return [{k: v for k, v in s.items() if k != "__url__"} for s in rd.iter_shard(path, fast=fast)]


def _cases(tmp_path: Path) -> dict[str, Path]:
    long_dir = "d" * 90 + "/" + "e" * 40  # > 100 chars: ustar stores it in the prefix field
    pair = [("a/0001.jpg", b"A1"), ("a/0001.txt", b"a one"), ("b/0001.jpg", b"B1"), ("b/0001.txt", b"b one")]
    cases = {
        "folders": _tar(tmp_path / "folders.tar", [("a", None), *pair, ("__index__", b"meta")]),
        "dots_and_case": _tar(
            tmp_path / "dots.tar",
            [("x.y/001.seg.PNG", b"p"), ("x.y/001.txt", b"t"), ("noext", b"n"), ("002.JSON", b"{}")],
        ),
        "ustar_prefix": _tar(
            tmp_path / "prefix.tar", [(f"{long_dir}/k1.jpg", b"1"), (f"{long_dir}/k1.txt", b"c")]
        ),
        "pax_long": _tar(
            tmp_path / "pax.tar",
            [("s0.jpg", b"0"), ("k" * 120 + ".jpg", b"1"), ("z.txt", b"z")],
            tarfile.PAX_FORMAT,
        ),
        "gnu_long": _tar(
            tmp_path / "gnu.tar",
            [("s0.jpg", b"0"), ("g" * 120 + ".jpg", b"1"), ("z.txt", b"z")],
            tarfile.GNU_FORMAT,
        ),
    }
    gz = tmp_path / "folders.tar.gz"
    gz.write_bytes(gzip.compress(cases["folders"].read_bytes(), mtime=0))
    cases["gzip"] = gz
    return cases


def test_fast_reader_and_tar_file_iterator_yield_webdatasets_keys_and_bytes(items, tmp_path, monkeypatch):
    """The oracle is ``webdataset.WebDataset`` on the same files; the fast reader must really serve the plain
    ustar tars (counted) and hand the rest to ``tar_file_iterator``."""
    cases = _cases(tmp_path)
    cases["ours"] = sh.write_shards(_data(items, 12), tmp_path / "ours", shard_size=12)[0]
    served = Counter()
    real = rd._ustar_members

    def counting(path):
        for m in real(path):
            served[Path(path).name] += 1
            yield m

    monkeypatch.setattr(rd, "_ustar_members", counting)
    for name, path in cases.items():
        want = _wds_samples(path)
        assert want, name
        assert _ours(path, fast=True) == want, name
        assert _ours(path, fast=False) == want, name
    assert [s["__key__"] for s in _wds_samples(cases["folders"])] == ["a/0001", "b/0001"]
    assert served["folders.tar"] == 4 and served["prefix.tar"] == 2 and served[cases["ours"].name] == 36
    assert served["pax.tar"] == 1 and served["gnu.tar"] == 1  # the first member, then tar_file_iterator
    assert served["folders.tar.gz"] == 0


def test_same_base_name_in_two_folders_stays_two_samples(tmp_path):
    png = _png(10)
    _tar(
        tmp_path / "s.tar",
        [("a/0001.png", png), ("a/0001.txt", b"a bag"), ("b/0001.png", png), ("b/0001.txt", b"a coat")],
    )
    got = list(ShardSource(tmp_path).items(0, 1, 0, 0, False, Counter()))
    assert [(n, c) for n, _, c, _ in got] == [("s.tar:a/0001", "a bag"), ("s.tar:b/0001", "a coat")]
    pairs, names, _ = load_pairs(tmp_path, image_size=8, channels=1)  # the audit loader agrees
    assert names == ["s.tar:a/0001", "s.tar:b/0001"] and pairs.captions == ["a bag", "a coat"]


@pytest.mark.parametrize("bad", ["/etc/0001.txt", "../0001.txt", "a/../../0001.txt"])
def test_absolute_or_dotdot_member_names_refuse_the_shard(tmp_path, bad):
    path = _tar(tmp_path / "evil.tar", [("0000.txt", b"ok"), (bad, b"x")])
    for fast in (True, False):
        with pytest.raises(rd.UnsafeShardError, match=r"evil\.tar.*refusing the shard"):
            list(rd.iter_shard(path, fast=fast))
    with pytest.raises(rd.UnsafeShardError, match="evil.tar"):  # whatever the bad-sample policy
        list(ShardSource(path).items(0, 1, 0, 0, False, Counter()))


def test_truncated_and_unreadable_shards_are_counted_or_stop_by_policy(items, tmp_path):
    (full,) = sh.write_shards(_data(items, 10), tmp_path / "full", shard_size=10)
    data = full.read_bytes()
    cut = tmp_path / "cut.tar"
    cut.write_bytes(data[: 512 * 40 + 100])  # inside a member's data, samples before it complete
    junk = tmp_path / "junk.tar"
    junk.write_bytes(b"this is not a tar file" * 40)
    for fast in (True, False):
        skip = Counter()
        got = list(rd.iter_shard(cut, skip, fast=fast))
        assert 0 < len(got) < 10 and dict(skip) == {"truncated_shard": 1}, fast
        assert [s["__key__"] for s in got] == [s["__key__"] for s in rd.iter_shard(full)][: len(got)]
        skip = Counter()
        assert list(rd.iter_shard(junk, skip, fast=fast)) == [] and dict(skip) == {"unreadable_shard": 1}
        with pytest.raises(rd.BadSampleError, match=r"cut\.tar: shard breaks off"):
            list(rd.iter_shard(cut, on_bad="error", fast=fast))
        with pytest.raises(rd.BadSampleError, match=r"junk\.tar"):
            list(rd.iter_shard(junk, on_bad="error", fast=fast))
    dup = _tar(tmp_path / "dup.tar", [("k.txt", b"1"), ("k.txt", b"2"), ("k.png", b"p")])
    skip = Counter()
    assert _ours(dup, True)[0]["txt"] == b"1"
    assert [s["txt"] for s in rd.iter_shard(dup, skip)] == [b"1"] and skip == {"duplicate_member": 1}
    with pytest.raises(rd.BadSampleError, match="dup.tar.*duplicate"):
        list(rd.iter_shard(dup, on_bad="error"))


def _corrupt_set(items, tmp_path: Path, member=None) -> Path:
    """16 good pairs in 2 shards, and a third shard holding one corrupt PNG (or the given bad member)."""
    pairs = _data(items, 16)
    out = tmp_path / "data"
    sh.write_shards(pairs, out, shard_size=8)
    good = _png(20, (28, 28))
    members = []
    for i in range(8):
        img = b"\x89PNG not really" if i == 3 else good
        members += [(f"z{i:03d}.png", img), (f"z{i:03d}.txt", b"a bag")]
    if member is not None:
        members.insert(0, (member, b"x"))
    _tar(out / "zz-000000.tar", members)
    (out / sh.MANIFEST).unlink()
    return out


@pytest.mark.parametrize("workers", [0, 1])
def test_a_corrupt_image_is_counted_or_stops_the_run_never_a_worker_crash(items, tmp_path, workers):
    out = _corrupt_set(items, tmp_path)
    pairs = _data(items, 16)
    cfg = StreamConfig(slots=1, num_workers=workers, window_batches=2, shuffle_shards=False)
    stats = _stream_trainer(pairs, out, "none", cfg, epochs=1).run_epoch(0)
    # once, though the count travels through the DataLoader (whose default_convert re-adds a Counter's counts);
    # 16 + 7 valid pairs in batches of 8
    assert stats["data_skipped_unreadable_image"] == 1 and stats["data_steps"] == 2
    strict = StreamConfig(
        slots=1, num_workers=workers, window_batches=2, shuffle_shards=False, on_bad_sample="error"
    )
    trainer = _stream_trainer(pairs, out, "none", strict, epochs=1)
    with pytest.raises(DataError, match=r"zz-000000\.tar:z003: unreadable image") as err:
        trainer.run_epoch(0)
    assert "DataLoader worker" not in str(err.value)  # raised in the main process from the worker's item
    shutil.rmtree(out)
    out = _corrupt_set(items, tmp_path, member="../escape.txt")
    with pytest.raises(DataError, match=r"zz-000000\.tar: member '\.\./escape\.txt'"):
        _stream_trainer(pairs, out, "none", cfg, epochs=1).run_epoch(0)


def test_the_summary_sums_the_skip_counts_of_every_epoch(tmp_path):
    """fit() puts ``data_skipped_<reason>`` summed over epochs into the defense's final metrics (the summary)."""
    from reprlab.methods.otcclip.config import Config
    from reprlab.methods.otcclip.pipeline.fit import fit
    from reprlab.runs import Run

    class Fake:
        examples: list = []

        def run_epoch(self, epoch):
            return {
                "loss": 1.0,
                "data_skipped_unreadable_image": epoch + 1,
                **({"data_skipped_x": 5} if epoch else {}),
            }

        def modules(self):
            return {"m": torch.nn.Linear(1, 1)}

        def optimizers(self):
            return {}

    cfg = Config()
    cfg = type(cfg)(**{**cfg.__dict__, "train": type(cfg.train)(**{**cfg.train.__dict__, "epochs": 3})})
    run = Run.create(tmp_path / "r", cfg, "t", quiet=True)
    final = fit("none", cfg, run, Fake(), None, None, None, final_loss=True)
    assert final["data_skipped_unreadable_image"] == 1 + 2 + 3 and final["data_skipped_x"] == 10


def test_brace_patterns_expand_and_name_missing_shards(items, tmp_path):
    sh.write_shards(_data(items, 12), tmp_path, shard_size=4)  # mosaics-000000..000002
    pattern = str(tmp_path / "mosaics-{000000..000002}.tar")
    assert rd.expand_shards(pattern) == sorted(tmp_path.glob("*.tar"))
    src = open_source(pattern)
    assert isinstance(src, ShardSource) and len(src) == 3 and src.count() == 12
    two = str(tmp_path / "mosaics-{000000..000001}.tar") + "::" + str(tmp_path / "mosaics-00000{2,9}.tar")
    (tmp_path / "mosaics-000009.tar").write_bytes((tmp_path / "mosaics-000002.tar").read_bytes())
    assert rd.expand_shards(two) == [*rd.expand_shards(pattern), tmp_path / "mosaics-000009.tar"]
    (tmp_path / "mosaics-000009.tar").unlink()
    with pytest.raises(
        DataFileMissingError, match=r"stream.source: .*2 of its 5 shards do not exist.*000003"
    ):
        open_source(str(tmp_path / "mosaics-{000000..000004}.tar"))
    pairs, names, _ = load_pairs(pattern, image_size=56, channels=1)
    assert len(names) == 12


def test_shard_stream_splits_by_node_and_worker_as_webdataset(items, tmp_path, monkeypatch):
    """Without explicit ranks ShardStream uses webdataset's split_by_node (RANK / WORLD_SIZE) and
    split_by_worker: the same partition as the explicit ``rank::world_size`` one."""
    sh.write_shards(_data(items, 20), tmp_path, shard_size=2)  # 10 shards
    explicit = [
        sh.ShardStream(tmp_path, rank=r, world_size=3, shuffle_shards=True).my_shards() for r in range(3)
    ]
    from_env = []
    for r in range(3):
        monkeypatch.setenv("RANK", str(r))
        monkeypatch.setenv("WORLD_SIZE", "3")
        from_env.append(sh.ShardStream(tmp_path, shuffle_shards=True).my_shards())
    assert from_env == explicit and sorted(p for ps in from_env for p in ps) == sorted(tmp_path.glob("*.tar"))
    monkeypatch.setenv("RANK", "1")
    got = [int(s["index"]) for s in DataLoader(sh.ShardStream(tmp_path), batch_size=None, num_workers=2)]
    want = [int(s["index"]) for p in explicit_order(tmp_path, 1) for s in sh.read_samples(p)]
    assert sorted(got) == sorted(want) and len(got) == 6  # shards 1, 4, 7
    with pytest.raises(ValueError, match="both"):
        sh.ShardStream(tmp_path, rank=0)


def explicit_order(path: Path, rank: int) -> list[Path]:
    return sorted(path.glob("*.tar"))[rank::3]


def test_stream_reads_lazily(items, tmp_path, monkeypatch):
    """The first sample arrives after opening one shard: nothing is preloaded."""
    sh.write_shards(_data(items, 6), tmp_path, shard_size=2)  # 3 shards
    opened = []
    real = rd._ustar_members
    monkeypatch.setattr(rd, "_ustar_members", lambda p: opened.append(p) or real(p))
    it = iter(sh.ShardStream(tmp_path))
    first = next(it)
    assert first["index"] == 0 and len(opened) == 1
    assert len(list(it)) == 5 and len(opened) == 3
    assert np.isfinite(first["image"].float().mean())
