"""Shard reading: webdataset's tar iteration vs our plain-ustar member reader, both grouped by webdataset.

The streamed trainer reads shards through :func:`reprlab.methods.otcclip.data.shard_reader.iter_shard`: samples
are grouped by ``webdataset.tariterators.group_by_keys``; the members come from our ``_ustar_members`` for plain
ustar tars (``fast=True``, the default) or from webdataset's ``tar_file_iterator`` (``fast=False``; always for
pax, GNU or compressed tars). The fast reader is kept only because this benchmark shows it matters at the
stream's real cost, so both are timed on JPEG shards at 224 px (smooth random images, quality 90, about the size
of web images after img2dataset's resize):

1. ``read``: tar -> samples (bytes grouped by key), no decode;
2. ``read_decode``: the same plus what a DataLoader worker does per sample: JPEG decode, resize and centre crop
   to 224 (:class:`~reprlab.methods.otcclip.data.transforms.ImageTransform`).

Each is the best of ``--repeats`` passes (process CPU time) over all shards, interleaved. Ratio = webdataset
time / fast-reader time (> 1: the fast reader is faster). Both yield the same keys and bytes (checked here and
in tests/methods/otcclip/test_shard_reader.py against ``webdataset.WebDataset``).

Run: ``python benchmarks/bench_shards.py`` (about 1 minute on 2 loaded CPU cores). The last line is JSON.
"""

from __future__ import annotations

import argparse
import io
import json
import tarfile
import tempfile
import time
from pathlib import Path

import numpy as np
from PIL import Image

from reprlab.methods.otcclip.data.shard_reader import iter_shard
from reprlab.methods.otcclip.data.transforms import ImageTransform


def make_shards(out: Path, n: int, per_shard: int, size: int = 224, seed: int = 0) -> list[Path]:
    rng = np.random.default_rng(seed)
    paths = []
    for s in range(0, n, per_shard):
        path = out / f"bench-{s // per_shard:06d}.tar"
        with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tf:
            for i in range(s, min(n, s + per_shard)):
                low = rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)  # smooth: a web photo's JPEG size
                im = Image.fromarray(low).resize((size + 32, size), Image.Resampling.BICUBIC)
                buf = io.BytesIO()
                im.save(buf, format="JPEG", quality=90)
                for ext, data in (("jpg", buf.getvalue()), ("txt", f"a photo number {i}".encode())):
                    info = tarfile.TarInfo(f"{i:09d}.{ext}")
                    info.size = len(data)
                    tf.addfile(info, io.BytesIO(data))
        paths.append(path)
    return paths


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=2000)
    ap.add_argument("--per-shard", type=int, default=500)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    transform = ImageTransform(224, 3)
    with tempfile.TemporaryDirectory() as tmp:
        paths = make_shards(Path(tmp), args.n, args.per_shard)
        mb = sum(p.stat().st_size for p in paths) / 2**20

        def read(fast: bool, decode: bool) -> int:
            n = 0
            for p in paths:
                for s in iter_shard(p, fast=fast):
                    n += 1
                    if decode:
                        transform(s["jpg"])
            return n

        # same keys and bytes before timing anything (the test suite checks it too)
        for p in paths:
            assert list(iter_shard(p, fast=True)) == list(iter_shard(p, fast=False)), p
        out = {"n_samples": args.n, "shard_mb": round(mb, 1)}
        for decode in (False, True):
            best = {"webdataset": float("inf"), "fast": float("inf")}
            for _ in range(args.repeats):
                for name, fast in (("webdataset", False), ("fast", True)):
                    t = time.process_time()
                    assert read(fast, decode) == args.n
                    best[name] = min(best[name], time.process_time() - t)
            tag = "read_decode" if decode else "read"
            out[f"{tag}_webdataset_s"] = round(best["webdataset"], 4)
            out[f"{tag}_fast_s"] = round(best["fast"], 4)
            out[f"{tag}_ratio_webdataset_over_fast"] = round(best["webdataset"] / best["fast"], 3)
            print(
                f"{tag:12s} webdataset {best['webdataset']:.3f}s  fast reader {best['fast']:.3f}s  "
                f"ratio {best['webdataset'] / best['fast']:.2f}x  ({args.n / best['fast']:.0f} samples/s fast)"
            )
    print(json.dumps(out))


if __name__ == "__main__":
    main()
