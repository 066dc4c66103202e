"""Training from streamed data: the streaming trainer over shards equals the in-memory trainer when one window
covers the data; the data order does not depend on DataLoader workers; tables stream with bad rows counted;
two torchrun ranks on the shard path train like one process; the GPU recipe's preflight names a missing path."""

import io
import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

from reprlab.methods.otcclip.config import DEFAULT_DEFENSES, StreamConfig, TrainConfig
from reprlab.methods.otcclip.data import shards as sh
from reprlab.methods.otcclip.data.sources import ShardSource, open_source
from reprlab.methods.otcclip.data.tokenizer import WordTokenizer
from reprlab.methods.otcclip.data.transforms import ImageTransform, model_transform
from reprlab.methods.otcclip.models.tiny import TinyCLIP
from reprlab.methods.otcclip.training import stream as st
from reprlab.methods.otcclip.training.slots import SlotStream
from reprlab.methods.otcclip.training.trainer import Trainer
from tests.methods.otcclip.test_trainer import CFG, DCFG, _data, checkpoint, restore
from tests.methods.otcclip.torchrun_compare import one_vs_two_ranks

HERE = Path(__file__).parent


def _stream_trainer(pairs, path, defense, stream_cfg, epochs=2, batch=8, tok=None, dcfg=DCFG, clean=None):
    """A StreamTrainer over the shards at ``path`` (``clean``: a clean fine-tuning source, test_stream_clean_set)."""
    tok = tok or WordTokenizer.from_texts(pairs.captions)
    torch.manual_seed(0)
    model = TinyCLIP(CFG, len(tok))
    return st.StreamTrainer(
        model, ShardSource(path), tok, defense, TrainConfig(epochs=epochs, batch_size=batch, warmup_steps=2),
        dcfg, 0, stream_cfg, n_samples=len(pairs), clean=clean,
    )  # fmt: skip


@pytest.mark.parametrize("defense", ["otcclip", "safeclip", "roclip"])
def test_one_window_over_shards_equals_the_in_memory_trainer_bitwise(items, tmp_path, defense):
    """Shards of the pairs in file order, one slot, one window covering all 32 pairs: the same batches, views and
    defense decisions as the in-memory trainer, so equal losses and weights bit for bit (epochs 0-2 cover OTCCLIP's
    plain and matching phases, SafeCLIP's unimodal, low-lr and split phases, RoCLIP's bank matching)."""
    pairs = _data(items, 32)
    sh.write_shards(pairs, tmp_path, shard_size=8)
    tok = WordTokenizer.from_texts(pairs.captions)
    torch.manual_seed(0)
    mem = Trainer(TinyCLIP(CFG, len(tok)), pairs, tok, defense,
                  TrainConfig(epochs=3, batch_size=8, warmup_steps=2), DCFG, seed=0)  # fmt: skip
    cfg = StreamConfig(slots=1, num_workers=1, window_batches=4, shuffle_shards=False)
    stream = _stream_trainer(pairs, tmp_path, defense, cfg, epochs=3, tok=tok)
    for e in range(3):
        a, b = mem.run_epoch(e), stream.run_epoch(e)
        assert b["data_windows"] == 1 and b["data_steps"] == 4
        assert a["loss"] == b["loss"], (e, a, b)
        for k in ("rematch_poison_moved", "rematch_clean_kept", "safe_share", "poison_in_risky"):
            assert (k in a) == (k in b) and a.get(k) == pytest.approx(b.get(k), nan_ok=True), k
    for (name, p), q in zip(mem.model.state_dict().items(), stream.model.state_dict().values()):
        assert torch.equal(p, q), name


def _rounds(trainer, epoch=0):
    """The windows' sample indices in training order, and the skip counts."""
    out = []
    orig = trainer._set_window

    def spy(window):
        out.append(window["index"].tolist())
        orig(window)

    trainer._set_window = spy
    list(trainer.global_batches(epoch, "clip", stats := {}))
    return out, stats


def test_order_depends_on_slots_not_on_workers_and_windows_partition_the_stream(items, tmp_path):
    pairs = _data(items, 32)
    sh.write_shards(pairs, tmp_path, shard_size=4)  # 8 shards, 2 per slot
    seen = {}
    for workers in (0, 1, 2, 4):
        cfg = StreamConfig(slots=4, num_workers=workers, window_batches=2, shuffle_buffer=3)
        seen[workers], stats = _rounds(_stream_trainer(pairs, tmp_path, "none", cfg))
    assert seen[0] == seen[1] == seen[2] == seen[4]
    three = _stream_trainer(pairs, tmp_path, "none", StreamConfig(slots=4, num_workers=3))
    assert three.num_workers == 2  # lowered to split the 4 slots evenly
    windows = seen[0]
    assert [len(w) for w in windows] == [16, 16] and stats["data_windows"] == 2
    assert sorted(i for w in windows for i in w) == list(range(32))  # every sample once per epoch
    # round-major, slot-minor: the first 2 samples of a window come from slot 0's shards, the next 2 from slot 1's
    order = np.random.default_rng([0, 0]).permutation(8).tolist()
    slot_of_shard = {s: k % 4 for k, s in enumerate(order)}
    assert [slot_of_shard[i // 4] for i in windows[0][:8]] == [0, 0, 1, 1, 2, 2, 3, 3]
    # another epoch, another order; same samples
    tr = _stream_trainer(pairs, tmp_path, "none", StreamConfig(slots=4, num_workers=0, window_batches=2))
    e1, _ = _rounds(tr, epoch=1)
    assert e1 != windows and sorted(sum(e1, [])) == list(range(32))


def test_persistent_workers_serve_every_epoch_with_that_epochs_order(items, tmp_path):
    """stream.persistent_workers: the same 2 worker processes serve epochs 0-2, and each epoch's windows are the ones
    a fresh in-process stream gives for that epoch (the epoch reaches the workers through shared memory)."""
    pairs = _data(items, 32)
    sh.write_shards(pairs, tmp_path, shard_size=4)
    base = dict(slots=4, window_batches=2, shuffle_buffer=3)
    tr = _stream_trainer(pairs, tmp_path, "none", StreamConfig(num_workers=2, **base))
    ref = _stream_trainer(pairs, tmp_path, "none", StreamConfig(num_workers=0, **base))
    pids, orders = [], []
    for epoch in range(3):
        got, _ = _rounds(tr, epoch)
        want, _ = _rounds(ref, epoch)
        assert got == want, epoch
        orders.append([list(w) for w in got])  # a copy: the next _rounds' spy chains to this one's list
        pids.append([w.pid for w in tr._loader._iterator._workers])
    assert orders[0] != orders[1] != orders[2]  # the workers did not replay epoch 0
    assert len(pids[0]) == 2 and pids[0] == pids[1] == pids[2]  # the same processes
    fresh = _stream_trainer(
        pairs, tmp_path, "none", StreamConfig(num_workers=2, persistent_workers=False, **base)
    )
    assert _rounds(fresh, 1)[0] == orders[1] and fresh._loader is None


def _png(value: int, size=(40, 30)) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.full(size[::-1], value, np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


@pytest.mark.parametrize("fmt", ["csv", "jsonl"])
def test_a_table_streams_with_bad_rows_counted_and_images_at_the_models_size(tmp_path, fmt):
    for i in range(6):
        (tmp_path / f"{i}.png").write_bytes(_png(40 * i))
    (tmp_path / "bad.png").write_bytes(b"not a png")
    rows = [(f"{i}.png", f"a bag number {i}") for i in range(6)]
    rows += [("missing.png", "a bag"), ("bad.png", "a shirt"), ("0.png", ""), ("", "a coat")]
    if fmt == "csv":
        text = "image,caption\n" + "".join(f"{p},{c}\n" for p, c in rows)
        data = text.encode() + b"1.png,caf\xe9 au lait\n"  # one non-UTF-8 line
    else:
        data = "".join(json.dumps({"image": p, "caption": c}) + "\n" for p, c in rows).encode() + b"{oops\n"
    path = tmp_path / f"pairs.{fmt}"
    path.write_bytes(data)
    src = open_source(path)
    tok = WordTokenizer.from_texts(src.captions(100))
    skip = Counter()
    # each slot on its own, so each is read to its end (together, the epoch would end with the first to run out)
    got = [g for s in (0, 1) for g in SlotStream(src, [s], 2, 3, ImageTransform(28, 1), tok, 8, 0, False, 0)]
    batches = [g for g in got if not g.get("end")]
    for g in got:
        skip.update(g["skipped"])
    assert [g["slot"] for g in batches] == [0, 1]  # 3 valid rows per slot (rows 0,2,4 and 1,3,5), one round
    assert all(g["images"].shape == (3, 1, 28, 28) and g["images"].dtype == torch.uint8 for g in batches)
    # a uniform 40x30 image resized and cropped keeps its grey value: row i has value 40 i
    assert sorted(int(g["images"][r].float().mean()) for g in batches for r in range(3)) == [
        0,
        40,
        80,
        120,
        160,
        200,
    ]
    assert tok.decode(batches[0]["ids"])[0].startswith("a bag number")
    want = {"missing_image": 1, "unreadable_image": 1, "empty_caption": 1, "missing_image_path": 1}
    want["non_utf8" if fmt == "csv" else "bad_row"] = 1
    assert dict(skip) == want


def test_missing_or_wrong_sources_are_named(tmp_path):
    from reprlab.errors import ConfigError, DataError, DataFileMissingError

    with pytest.raises(DataFileMissingError, match="stream.source.*nowhere"):
        open_source(tmp_path / "nowhere")
    with pytest.raises(ConfigError, match="stream.source is empty"):
        open_source("")
    (tmp_path / "x.txt").write_text("hi")
    with pytest.raises(DataError, match="x.txt"):
        open_source(tmp_path / "x.txt")
    (tmp_path / "t.csv").write_text("file,label\na.png,1\n")
    with pytest.raises(DataError, match="caption"):
        open_source(tmp_path / "t.csv")
    # a table without one data row is refused when opened (preflight), with what its lines were
    for name, text, found in (
        ("header.csv", "image,caption\n", "no line"),
        ("empty.jsonl", "\n\n", "no line"),
        ("bad.jsonl", "{oops\n[1, 2]\n", "2 bad row"),
    ):
        (tmp_path / name).write_text(text)
        with pytest.raises(DataError, match=rf"stream.source: .*{name} holds no data row \({found}\)"):
            open_source(tmp_path / name)


def test_a_source_with_no_valid_item_stops_the_run_naming_it(tmp_path):
    """Rows whose images are all missing pass the open (they are rows) but give no batch: the first epoch stops
    with a DataError naming the table and the skip counts, not a finished run with a NaN loss."""
    from reprlab.errors import DataError
    from reprlab.methods.otcclip import recipe as R
    from reprlab.recipes import get_recipe
    from reprlab.runs import Run
    from tests.methods.otcclip.test_recipe import MINI

    table = tmp_path / "pairs.csv"
    table.write_text("image,caption\n" + "".join(f"gone{i}.png,a bag\n" for i in range(30)))
    cfg = get_recipe("otcclip-shards-tiny").build_config(
        [*MINI, "stream.write_shards=false", f"stream.source={table}", "defenses=[none]", "audit_defense="]
    )
    with pytest.raises(
        DataError,
        match=r"pairs.csv gives no full global batch .*skipped before the epoch ended: \d+ missing image",
    ):
        R.run(cfg, Run.create(tmp_path / "r", cfg, "otcclip-shards-tiny", quiet=True))


def test_gpu_recipe_preflight_names_the_missing_shard_path(tmp_path):
    from reprlab.errors import ConfigError, DataFileMissingError
    from reprlab.methods.otcclip import recipe as R
    from reprlab.recipes import get_recipe

    recipe = get_recipe("otcclip-cc3m")
    with pytest.raises(ConfigError, match="stream.source is empty"):
        R.preflight(recipe.build_config())  # the recipe ships without a path: the user must give one
    missing = tmp_path / "cc3m-shards"
    with pytest.raises(DataFileMissingError, match=f"stream.source: {missing}"):
        R.preflight(recipe.build_config([f"stream.source={missing}"]))
    cfg = recipe.build_config([f"stream.source={missing}"])
    assert (cfg.model.arch, cfg.model.image_size, cfg.model.patch_size, cfg.model.width) == (
        "hf_clip",
        224,
        32,
        768,
    )


@pytest.mark.slow  # two torchrun ranks and one process, each importing torch: ~1-2 min on the loaded 2-core machine
def test_two_torchrun_ranks_on_the_shard_path_train_like_one_process(items, tmp_path):
    """OTCCLIP over shards, 2 epochs (plain + OT losses, then re-matching over the caption bank gathered from all
    ranks), 4 slots: one process with 2 DataLoader workers against torchrun with 2 gloo ranks x 1 worker, each
    reading half of the shards."""
    pairs = _data(items, 32)
    sh.write_shards(pairs, tmp_path / "shards", shard_size=4)
    one, two = one_vs_two_ranks(HERE / "stream_worker.py", tmp_path / "shards", tmp_path)
    moved = 0.0
    for name, w in one["state"].items():
        # 8 SGD steps at lr 0.5 amplify float32 sums taken in another order (gathers, gradient all-reduce):
        # measured max difference 2.5e-5 against weight moves of up to 0.2
        assert torch.allclose(two["state"][name], w, atol=1e-4, rtol=0), name
        moved += float((w - one["init"][name]).abs().sum())
    assert moved > 1e-2  # training changed the weights: the comparison is not vacuous


def test_hf_clip_from_scratch_takes_the_processors_normalisation_and_trains_from_shards(items, tmp_path):
    """model.arch hf_clip: inputs in [-1, 1] are mapped to CLIP's processor mean/std (oracle: the adapter without
    pixel_norm fed hand-normalised pixels), and the streaming trainer runs a re-matching epoch on it."""
    from dataclasses import replace

    from reprlab.methods.otcclip.models.build import build_model
    from reprlab.methods.otcclip.models.hf import HFCLIPAdapter, processor_stats

    cfg = replace(CFG, arch="hf_clip", image_size=32, patch_size=8)
    torch.manual_seed(0)
    model = build_model(cfg, 50).eval()
    mean, std = (torch.tensor(v).view(1, 3, 1, 1) for v in processor_stats())
    assert float(mean[0, 0, 0, 0]) == pytest.approx(0.48145466)  # CLIP's image processor default
    raw = HFCLIPAdapter(model.clip, cfg.max_len)  # no pixel_norm: expects model-normalised pixels
    x = torch.rand(2, 3, 32, 32) * 2 - 1
    a = model.encode_image(x).global_
    b = raw.encode_image(((x + 1) / 2 - mean) / std).global_
    assert torch.allclose(a, b, atol=1e-6) and not torch.allclose(a, raw.encode_image(x).global_, atol=1e-3)
    assert model_transform(model) == ImageTransform(32, 3)
    # text: mean-pooled projected tokens (our word tokenizer has no EOS)
    ids = torch.tensor([[5, 6, 7, 0]])
    t = model.encode_text(ids, ids != 0)
    with torch.no_grad():
        hidden = model.clip.text_model(input_ids=ids, attention_mask=(ids != 0).long()).last_hidden_state
        want = torch.nn.functional.normalize(model.clip.text_projection(hidden)[:, :3].mean(1), dim=-1)
    assert torch.allclose(t.global_, want, atol=1e-6)
    pairs = _data(items, 16)
    sh.write_shards(pairs, tmp_path, shard_size=4)
    tok = WordTokenizer.from_texts(pairs.captions)
    torch.manual_seed(0)
    model = build_model(cfg, len(tok))
    tr = st.StreamTrainer(
        model, ShardSource(tmp_path), tok, "otcclip", TrainConfig(epochs=2, batch_size=8, warmup_steps=1),
        DCFG, 0, StreamConfig(slots=2, num_workers=0, window_batches=1), n_samples=16,
    )  # fmt: skip
    before = [p.detach().clone() for p in model.parameters()]
    stats = [tr.run_epoch(e) for e in range(2)]
    assert stats[1]["phase"] == "otc_match" and stats[1]["n_poison_seen"] + stats[1]["n_clean_seen"] == 16
    assert np.isfinite(stats[1]["loss"]) and any((p != q).any() for p, q in zip(model.parameters(), before))


def test_open_clip_arch_says_why_it_is_not_available():
    from reprlab.errors import ModelNotAvailableError
    from reprlab.methods.otcclip import recipe as R
    from reprlab.methods.otcclip.config import ModelConfig
    from reprlab.methods.otcclip.models.build import build_model

    try:
        import open_clip  # noqa: F401
    except Exception:
        pass
    else:
        pytest.skip("open_clip imports here: the missing-package path cannot be tested")
    with pytest.raises(ModelNotAvailableError, match="open_clip:ViT-B-32.*open-clip-torch") as err:
        build_model(ModelConfig(arch="open_clip:ViT-B-32"), 10)
    assert "scripts/openclip_env.sh" in (err.value.hint or "")  # where the open_clip path does run
    from reprlab.recipes import get_recipe

    cfg = get_recipe("otcclip-shards-tiny").build_config(["model.arch=open_clip:ViT-B-32"])
    with pytest.raises(ModelNotAvailableError):
        R.preflight(cfg)


def test_a_resumed_stream_trainer_continues_bitwise(items, tmp_path):
    """What a checkpoint holds (modules, optimiser) is enough: epoch 1 after a restart equals epoch 1 straight on
    (the stream restarts each epoch from (seed, epoch); the bank carries the re-matching pool over)."""
    pairs = _data(items, 32)
    sh.write_shards(pairs, tmp_path, shard_size=4)
    cfg = StreamConfig(slots=2, num_workers=0, window_batches=2, shuffle_buffer=3)
    straight = _stream_trainer(pairs, tmp_path, "otcclip", cfg)
    straight.run_epoch(0)
    saved = checkpoint(straight)
    a = straight.run_epoch(1)
    resumed = _stream_trainer(pairs, tmp_path, "otcclip", cfg)
    assert set(saved[0]) == set(resumed.modules()) == {"model", "bank"}
    restore(resumed, saved)
    b = resumed.run_epoch(1)
    assert a["phase"] == "otc_match" and a["loss"] == b["loss"]
    for (name, p), q in zip(straight.model.state_dict().items(), resumed.model.state_dict().values()):
        assert torch.equal(p, q), name


def test_shards_recipe_end_to_end_then_streams_a_user_folder_and_resumes(tmp_path):
    """otcclip-shards-tiny on otcclip-mosaic-tiny's miniature config: the shards stage writes the testbed, every defense
    trains from the stream and is evaluated; a second run streams the first run's shards as a user folder
    (stream.source), and a run killed in otcclip's last epoch resumes to the same summary."""
    import shutil

    from reprlab.methods.otcclip import recipe as R
    from reprlab.recipes import get_recipe
    from reprlab.runs import Run
    from tests.methods.otcclip.test_recipe import MINI

    mini = [*MINI, "stream.shard_size=42", "stream.window_batches=4", "audit_defense=", "threads=1"]
    cfg = get_recipe("otcclip-shards-tiny").build_config(mini)  # with its base (otcclip-mosaic-tiny) resolved
    run = Run.create(tmp_path / "r", cfg, "otcclip-shards-tiny", quiet=True)
    summary = R.run(cfg, run)
    manifest = json.loads((run.dir / "shards" / sh.MANIFEST).read_text())
    assert manifest["n_samples"] == 160 + 2 * 4 and len(manifest["shards"]) == 4
    for d in DEFAULT_DEFENSES:
        assert {
            f"{d}.{m}" for m in ("zeroshot_acc", "linear_probe_acc", "asr_targeted", "asr_backdoor")
        } <= set(summary)
    log = [json.loads(line) for line in (run.dir / "metrics.jsonl").read_text().splitlines()]
    # 2 slots x 84 pairs, 10 a minibatch: 8 rounds of 20 in windows of 4 batches
    assert {(r["data_steps"], r["data_windows"]) for r in log} == {(8, 2)}
    matching = [r for r in log if r.get("phase") == "otc_match"]
    assert matching and all(r["n_poison_seen"] + r["n_clean_seen"] == 160 for r in matching)  # 8 x 20 pairs
    assert R.report_sections(run.dir)[0].table
    # the first run's shards as a user folder: vocabulary from their captions + the prompts, testbed evaluation
    user = get_recipe("otcclip-shards-tiny").build_config(
        [*mini, "stream.write_shards=false", f"stream.source={run.dir / 'shards'}", "defenses=[none]"]
    )
    other = R.run(user, Run.create(tmp_path / "u", user, "otcclip-shards-tiny", quiet=True))
    assert 0 <= other["none.zeroshot_acc"] <= 1 and other["n_pairs"] == 168
    # killed during otcclip's last epoch: resume from the epoch-1 checkpoint (weights, optimiser, bank, RNG)
    (run.dir / "stages" / "otcclip.json").unlink()
    shutil.rmtree(run.checkpoints("otcclip")[-1])
    resumed = R.run(cfg, Run.create(tmp_path / "r", cfg, "otcclip-shards-tiny", resume=True, quiet=True))
    for k, v in summary.items():
        if k.startswith("otcclip."):
            assert resumed[k] == pytest.approx(v, abs=1e-6), k


def test_more_slots_than_shards_stops_at_preflight(tmp_path):
    """One shard and stream.slots=2 would leave a slot empty: refused before a run folder exists (it was refused
    only when the trainer was built, after the folder), with the fix."""
    from reprlab.errors import ConfigError
    from reprlab.methods.otcclip import recipe as R
    from reprlab.recipes import get_recipe

    shard = tmp_path / "one.tar"
    shard.write_bytes(b"not read by preflight" * 10)
    cfg = get_recipe("otcclip-shards-tiny").build_config(
        ["stream.write_shards=false", f"stream.source={shard}", "stream.slots=2"]
    )
    with pytest.raises(ConfigError, match=r"stream.slots 2 exceeds the 1 shards of stream.source") as err:
        R.preflight(cfg)
    assert "at most 1" in err.value.hint


def test_shards_that_are_not_tars_are_named_at_preflight(items, tmp_path):
    """A shard whose first header is not a tar's is named before the run folder exists: every shard bad is an
    error; some bad is an error with stream.on_bad_sample=error and a warning (they are skipped) with skip. A
    good shard passes. Before, the first was found only through the zero-batch error's skip counts and the
    second after the run folder existed."""
    import warnings

    from reprlab.errors import DataError
    from reprlab.methods.otcclip import recipe as R
    from reprlab.recipes import get_recipe

    sh.write_shards(_data(items, 16), tmp_path, shard_size=8)  # two good shards
    good = sorted(tmp_path.glob("*.tar"))
    assert len(good) == 2

    def cfg(source, *more):
        return get_recipe("otcclip-shards-tiny").build_config(
            ["stream.write_shards=false", f"stream.source={source}", "stream.slots=1", *more]
        )

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        R.preflight(cfg(tmp_path))  # good shards: no error, no warning
    (tmp_path / "manifest.json").unlink(missing_ok=True)  # the folder is a plain list of shards from here on
    (tmp_path / "zz-bad.tar").write_bytes(b"not a tar archive at all" * 40)
    with pytest.raises(DataError, match=r"1 of the 3 shards .* zz-bad.tar") as err:
        R.preflight(cfg(tmp_path, "stream.on_bad_sample=error"))
    assert "on_bad_sample=skip" in err.value.hint
    with pytest.warns(UserWarning, match=r"zz-bad.tar .*they will be skipped"):
        R.preflight(cfg(tmp_path))
    for path in good:
        path.unlink()
    with pytest.raises(DataError, match=r"1 of the 1 shards .* zz-bad.tar"):
        R.preflight(cfg(tmp_path))  # none opens: refused whatever on_bad_sample says
