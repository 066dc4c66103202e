"""CleanCLIP's clean fine-tuning source on the streamed path (``stream.clean_source``): with one window covering
the data the streaming trainer equals the in-memory trainer with the same clean set bit for bit (cycling
included); on a planted problem the fine-tuning epochs' loss is the clean set's, never the poisoned stream's;
other defenses are bit-identical with and without a clean source; resuming across the phase switch is bitwise;
``make-shards --clean-finetune-pairs`` and the shards recipe write the in-memory clean set; wrong sources are
named.

Checked by breaking it on purpose (then restoring it):

* ``StreamTrainer.global_batches`` streaming ``self.stream`` in clean phases too (clean source ignored) ->
  ``..._planted_...`` fails (loss is the poisoned set's) and ``..._equals_the_in_memory_trainer...`` fails;
* a later pass re-seeding the window generator (``gens`` not kept across passes) -> ``..._in_memory_trainer...``
  fails (the second permutation differs from the in-memory trainer's);
* the clean source opened for every defense (``clean_phases`` not consulted) -> ``..._other_defenses_...``
  fails.
"""

import json
from collections import Counter
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from reprlab.errors import ConfigError, DataError, DataFileMissingError
from reprlab.methods.otcclip.config import DefenseConfig, OTConfig, StreamConfig
from reprlab.methods.otcclip.data import shards as sh
from reprlab.methods.otcclip.data.shard_reader import iter_shard
from reprlab.methods.otcclip.data.sources import ShardSource
from reprlab.methods.otcclip.data.testbed import build_testbed
from reprlab.methods.otcclip.data.tokenizer import WordTokenizer
from reprlab.methods.otcclip.data.transforms import ImageTransform
from reprlab.methods.otcclip.training import stream as st
from reprlab.methods.otcclip.training.slots import SlotStream

from .planted import TRAIN, PlantedCLIP, planted_pairs
from .test_cleanclip_clean_set import _clean_mosaics, _expected, _mosaic_trainer, clean_planted
from .test_stream import _stream_trainer
from .test_trainer import DCFG, _data, checkpoint, restore

CLEAN_DCFG = replace(DCFG, cleanclip_start_epoch=1)  # epoch 0 pre-trains (phase clip), later epochs fine-tune


def _write(pairs, path, shard_size=8):
    sh.write_shards(pairs, path, shard_size=shard_size)
    return path


def _weights_equal(a, b) -> None:
    for (name, p), q in zip(a.model.state_dict().items(), b.model.state_dict().values()):
        assert torch.equal(p, q), name


def test_one_window_with_a_clean_source_equals_the_in_memory_trainer_with_that_clean_set_bitwise(
    items, tmp_path
):
    """32 poisoned pairs, 16 clean ones, batch 8, one slot, windows covering each set: epoch 0 pre-trains on the
    poisoned stream, epochs 1-2 fine-tune on the clean stream in 2 passes of 2 steps (the in-memory trainer's 2
    permutations of its clean set), so the same batches, views and weights bit for bit."""
    clean = _clean_mosaics(items)
    mem = _mosaic_trainer(items, "cleanclip", clean)
    pairs = mem.data  # the poisoned pairs (before run_epoch points data at the clean set)
    cfg = StreamConfig(slots=1, num_workers=1, window_batches=4, shuffle_shards=False)
    stream = _stream_trainer(
        pairs, _write(pairs, tmp_path / "train"), "cleanclip", cfg, epochs=3, tok=mem.tokenizer, dcfg=CLEAN_DCFG,
        clean=ShardSource(_write(clean, tmp_path / "clean")),
    )  # fmt: skip
    for e in range(3):
        a, b = mem.run_epoch(e), stream.run_epoch(e)
        assert a["phase"] == b["phase"] == ("clip" if e == 0 else "cleanclip")
        assert a["loss"] == b["loss"], (e, a, b)
        assert a.get("loss_inmodal") == b.get("loss_inmodal")
        if e == 0:
            assert (b["data_windows"], b["data_steps"]) == (1, 4) and "data_clean_passes" not in b
        else:  # the schedule's 4 steps from a 2-batch set: 2 passes of one window each
            assert (b["data_windows"], b["data_steps"], b["data_clean_passes"]) == (2, 4, 2)
    _weights_equal(mem, stream)


class _StreamedPlanted(PlantedCLIP):
    """The planted oracle with an input size, so the stream decodes the shards' 8x8 images unchanged (as RGB:
    the oracle reads the mean grey level)."""

    image_size = 8


def test_planted_fine_tuning_epochs_train_on_the_clean_stream_not_the_poisoned_one(tmp_path):
    """Planted oracle (tests/methods/otcclip/planted.py), 2 slots x 2 DataLoader workers, one global batch of
    16: epoch 0's loss is CLIP on the poisoned pairs, epoch 1's the CleanCLIP objective on the clean set (the two
    hypotheses differ by > 0.1), and a plain-CLIP phase afterwards is back on the poisoned stream."""
    pairs, clean = planted_pairs(), clean_planted()
    tok = WordTokenizer.from_texts(pairs.captions)
    dcfg = DefenseConfig(
        bank_size=64, top_k=4, lambda_inter=0.0, lambda_intra=0.0, ot=OTConfig(n_iters=20),
        cleanclip_start_epoch=1, cleanclip_inmodal_weight=0.5,
    )  # fmt: skip
    tr = st.StreamTrainer(
        _StreamedPlanted(tok), ShardSource(_write(pairs, tmp_path / "train")), tok, "cleanclip", TRAIN, dcfg, 0,
        StreamConfig(slots=2, num_workers=2, window_batches=1), n_samples=16,
        clean=ShardSource(_write(clean, tmp_path / "clean")),
    )  # fmt: skip
    scale = float(tr.model.scale().detach())
    s0 = tr.run_epoch(0)
    assert s0["phase"] == "clip" and s0["loss"] == pytest.approx(_expected(pairs, scale, 0.5)[0], abs=1e-5)
    scale = float(tr.model.scale().detach())
    s1 = tr.run_epoch(1)
    clip_clean, inmodal_clean = _expected(clean, scale, 0.5)
    clip_poisoned, _ = _expected(pairs, scale, 0.5)
    assert abs(clip_clean - clip_poisoned) > 0.1  # the two hypotheses are distinguishable
    assert s1["phase"] == "cleanclip" and s1["data_steps"] == 1
    assert s1["loss_clip"] == pytest.approx(clip_clean, abs=1e-5)
    assert s1["loss_inmodal"] == pytest.approx(inmodal_clean, abs=1e-5)
    scale = float(tr.model.scale().detach())
    assert tr.run_epoch(0)["loss"] == pytest.approx(_expected(pairs, scale, 0.5)[0], abs=1e-5)


@pytest.mark.parametrize("defense", ["none", "roclip", "safeclip", "otcclip"])
def test_other_defenses_ignore_the_clean_source_bit_for_bit(items, tmp_path, defense):
    """2 slots, windows of 2 batches, a shuffle buffer: the same stats and weights with and without a clean
    source, and the clean source is never opened."""
    pairs = _data(items, 32)
    train = _write(pairs, tmp_path / "train", shard_size=4)
    clean = ShardSource(_write(_clean_mosaics(items), tmp_path / "clean", shard_size=4))
    cfg = StreamConfig(slots=2, num_workers=0, window_batches=2, shuffle_buffer=3)
    a = _stream_trainer(pairs, train, defense, cfg, dcfg=CLEAN_DCFG)
    b = _stream_trainer(pairs, train, defense, cfg, dcfg=CLEAN_DCFG, clean=clean)
    assert b.clean_stream is None
    for epoch in range(2):
        assert a.run_epoch(epoch) == b.run_epoch(epoch)
    _weights_equal(a, b)


def test_cleanclip_resumes_bitwise_across_the_switch_to_the_clean_stream(items, tmp_path):
    """Modules + optimiser saved after the pre-training epoch, reloaded into a fresh stream trainer: the clean
    fine-tuning epochs (2 slots, 2 passes over the clean shards) give the uninterrupted run's weights; and they
    really trained on the clean stream (weights differ from a run without it)."""
    pairs = _data(items, 32)
    train = _write(pairs, tmp_path / "train", shard_size=4)
    clean = ShardSource(_write(_clean_mosaics(items), tmp_path / "clean", shard_size=4))
    cfg = StreamConfig(slots=2, num_workers=0, window_batches=2, shuffle_buffer=3)

    def trainer(with_clean=True):
        return _stream_trainer(
            pairs, train, "cleanclip", cfg, epochs=3, dcfg=CLEAN_DCFG, clean=clean if with_clean else None
        )

    straight = trainer()
    straight.run_epoch(0)
    saved = checkpoint(straight)
    for e in (1, 2):
        assert straight.run_epoch(e)["data_clean_passes"] == 2
    resumed = trainer()
    restore(resumed, saved)
    for e in (1, 2):
        resumed.run_epoch(e)
    _weights_equal(straight, resumed)
    without = trainer(with_clean=False)
    for e in range(3):
        without.run_epoch(e)
    assert not torch.equal(
        without.model.state_dict()["logit_scale"], straight.model.state_dict()["logit_scale"]
    )


def test_a_later_pass_reshuffles_the_clean_shards_and_buffer(items, tmp_path):
    """Pass 0 keeps the epoch's usual order; pass 1 draws its own shard order and its own shuffle buffer (a
    multi-window clean set is not replayed in the same windows), same samples."""
    src = ShardSource(_write(_clean_mosaics(items), tmp_path / "clean", shard_size=2))  # 8 shards
    tok = WordTokenizer.from_texts(["a"])

    def indices(cycle, buffer):
        stream = SlotStream(src, [0], 1, 4, ImageTransform(56, 1), tok, 8, 0, True, buffer)
        stream.set_epoch(1, cycle)
        return [i for g in stream if not g.get("end") for i in g["index"].tolist()]

    usual = [int(m["index"]) for *_, m in src.items(0, 1, 0, 1, True, Counter())]
    assert indices(0, 0) == usual  # pass 0: the pre-training rule's (seed, epoch) shard order
    assert sorted(indices(1, 0)) == sorted(usual) == list(range(16))
    # shard order: pairs of consecutive indices are one shard
    assert [i // 2 for i in indices(1, 0)[::2]] != [i // 2 for i in usual[::2]]
    assert sorted(indices(1, 3)) == list(range(16)) and indices(1, 3) != indices(1, 0)
    # the buffer's draws depend on the pass too: the same shard order read through pass 1's buffer differs
    # from pass 0's buffer over that order
    one = ShardSource([src.shards[i // 2] for i in indices(1, 0)[::2]])
    again = SlotStream(one, [0], 1, 4, ImageTransform(56, 1), tok, 8, 0, False, 3)
    again.set_epoch(1, 0)
    assert [i for g in again if not g.get("end") for i in g["index"].tolist()] != indices(1, 3)


# ---------------------------------------------------------------------- errors
def test_a_poisoned_or_too_small_clean_source_stops_training_with_its_name(items, tmp_path):
    pairs = _data(items, 32)
    train = _write(pairs, tmp_path / "train")
    cfg = StreamConfig(slots=2, num_workers=0, window_batches=2)
    # library callers skip preflight: the poisoned window itself stops the fine-tuning epoch
    poisoned = _stream_trainer(pairs, train, "cleanclip", cfg, dcfg=CLEAN_DCFG, clean=ShardSource(train))
    poisoned.run_epoch(0)
    with pytest.raises(DataError, match=f"clean fine-tuning source {train} holds poisoned items"):
        poisoned.run_epoch(1)
    # 4 clean pairs in 2 slots: no global batch of 8, so cycling would never reach the schedule's steps
    tiny = ShardSource(_write(_clean_mosaics(items, 4), tmp_path / "tiny", shard_size=2))
    small = _stream_trainer(pairs, train, "cleanclip", cfg, dcfg=CLEAN_DCFG, clean=tiny)
    with pytest.raises(DataError, match="tiny gives no full global batch of 8"):
        _within(30, lambda: list(small.global_batches(1, "cleanclip", {})))
    one_shard = ShardSource(_write(_clean_mosaics(items), tmp_path / "one", shard_size=16))
    with pytest.raises(ConfigError, match="exceeds the 1 shards of stream.clean_source"):
        _stream_trainer(pairs, train, "cleanclip", cfg, dcfg=CLEAN_DCFG, clean=one_shard)
    _stream_trainer(pairs, train, "none", cfg, clean=one_shard)  # ignored: no error


def _within(seconds: int, fn):
    """``fn()``, failing after ``seconds`` instead of hanging (an unguarded cycle over an empty pass never ends)."""
    import signal

    def stop(*_):
        raise TimeoutError(f"still running after {seconds} s")

    old = signal.signal(signal.SIGALRM, stop)
    signal.alarm(seconds)
    try:
        return fn()
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def _shards_cfg(extra):
    from reprlab.recipes import get_recipe

    return get_recipe("otcclip-shards-tiny").build_config(extra)


def test_preflight_names_a_missing_or_poisoned_clean_source_and_a_clean_source_without_a_stream(
    items, tmp_path
):
    from reprlab.methods.otcclip import recipe as R

    missing = tmp_path / "nowhere"
    with pytest.raises(DataFileMissingError, match=f"stream.clean_source: {missing} does not exist"):
        R.preflight(_shards_cfg([f"stream.clean_source={missing}"]))
    poisoned = _write(_data(items, 32), tmp_path / "poisoned")
    with_cleanclip = [f"stream.clean_source={poisoned}", "defenses=[none,cleanclip]"]
    with pytest.raises(DataError, match=f"stream.clean_source: {poisoned} holds 4 poisoned items"):
        R.preflight(_shards_cfg(with_cleanclip))  # manifest.json's n_poisoned
    (poisoned / sh.MANIFEST).unlink()
    with pytest.raises(DataError, match="holds 4 poisoned items"):
        R.preflight(_shards_cfg(with_cleanclip))  # one pass over the members' provenance
    R.preflight(_shards_cfg([f"stream.clean_source={poisoned}"]))  # no defense trains on it: not read
    clean = _write(_clean_mosaics(items), tmp_path / "clean")
    R.preflight(_shards_cfg([f"stream.clean_source={clean}", "defenses=[cleanclip]"]))
    R.preflight(
        _shards_cfg([f"stream.clean_source={clean}", "data.clean_finetune_pairs=40"])
    )  # it replaces it
    user = ["stream.write_shards=false", f"stream.source={clean}"]
    R.preflight(
        _shards_cfg([*user, "data.clean_finetune_pairs=40", "defenses=[cleanclip]"])
    )  # written by a stage
    R.preflight(_shards_cfg([*user, f"stream.clean_source={clean}"]))
    with pytest.raises(ConfigError, match="stream.clean_source needs a stream"):
        R.preflight(_shards_cfg(["stream.write_shards=false", f"stream.clean_source={clean}"]))


# ---------------------------------------------------------------------- writing the clean set
def test_make_shards_writes_the_in_memory_clean_set_into_its_own_folder(tmp_path):
    from typer.testing import CliRunner

    from reprlab.cli import app
    from reprlab.methods.otcclip.config import DataConfig
    from reprlab.methods.otcclip.data.testbed import build_testbed

    out = tmp_path / "shards"
    args = ["otcclip", "make-shards", str(out), "--n-pairs", "300", "--shard-size", "20", "--seed", "1"]
    res = CliRunner().invoke(app, [*args, "--clean-finetune-pairs", "30"])
    assert res.exit_code == 0, res.output
    ref = build_testbed(
        DataConfig(
            n_pairs=300, max_items=2, captions_per_target=30, backdoor_pairs=75, n_eval=1, n_probe_train=1,
            clean_finetune_pairs=30,
        ),
        seed=1,
    )  # fmt: skip
    got = {int(s["index"]): s for s in sh.ShardStream(tmp_path / "shards-clean")}
    assert len(got) == len(ref.clean) == 30 and all(s["kind"] == 0 for s in got.values())
    assert all(
        got[i]["caption"] == ref.clean.captions[i] and torch.equal(got[i]["image"], ref.clean.images[i])
        for i in got
    )
    manifest = json.loads((tmp_path / "shards-clean" / sh.MANIFEST).read_text())
    assert manifest["n_poisoned"] == 0 and len(manifest["shards"]) == 2  # 2 slots: 15 + 15, not 20 + 10
    assert json.loads((out / sh.MANIFEST).read_text())["n_poisoned"] == 4 * 30 + 75
    # the poisoned shards are byte-identical to a run without the option
    plain = tmp_path / "plain"
    assert CliRunner().invoke(app, [*args[:2], str(plain), *args[3:]]).exit_code == 0
    assert [p.read_bytes() for p in sorted(out.glob("*.tar"))] == [
        p.read_bytes() for p in sorted(plain.glob("*.tar"))
    ]
    assert manifest["shard_size"] == 15
    three = CliRunner().invoke(app, [*args, "--clean-finetune-pairs", "30", "--clean-slots", "3"])
    assert (
        three.exit_code == 0
        and len(json.loads((tmp_path / "shards-clean" / sh.MANIFEST).read_text())["shards"]) == 3
    )
    bad = CliRunner().invoke(app, [*args, "--clean-finetune-pairs", "4", "--clean-out", str(out)])
    assert bad.exit_code == 2 and "another folder" in bad.output


def test_clean_shard_size_gives_every_slot_shards():
    assert [sh.clean_shard_size(n, 265, 2) for n in (40, 200, 265, 600)] == [20, 100, 133, 150]
    assert sh.clean_shard_size(100, 10, 4) == 9  # 10 shards -> 12 (a multiple of 4) of at most 9
    assert -(-100 // sh.clean_shard_size(100, 10, 4)) == 12


def test_small_clean_sets_are_cut_into_a_multiple_of_the_slots(items, tmp_path):
    """Sets that one shard size cannot cut into a multiple of the slots (9 samples for 4 slots gave 3 shards of 3)
    are written as exactly clean_shard_count near-equal shards; fewer samples than slots is refused."""
    for n, size, slots in ((9, 265, 4), (20, 265, 8), (9, 2, 2), (24, 10, 4)):
        k = sh.clean_shard_count(n, size, slots)
        paths = sh.write_clean_shards(_clean_mosaics(items, n), tmp_path / f"{n}-{size}-{slots}", size, slots)
        counts = [sum(1 for _ in iter_shard(p)) for p in paths]
        assert len(paths) == k and k % slots == 0, (n, size, slots, counts)
        assert sum(counts) == n and max(counts) - min(counts) <= 1 and max(counts) <= size
    with pytest.raises(ValueError, match="cannot give each of 4 stream slots"):
        sh.clean_shard_count(3, 265, 4)


def test_shards_recipe_streams_cleanclip_fine_tuning_from_the_written_clean_set(tmp_path):
    """otcclip-shards-tiny on the miniature config with data.clean_finetune_pairs: the shards stage writes the
    testbed's clean set as 2 clean shards (one per slot), CleanCLIP's fine-tuning epoch streams them in passes
    to the pre-training step count, and the report's data fields name it."""
    import yaml

    from reprlab.config import load_config
    from reprlab.methods.otcclip import recipe as R
    from reprlab.runs import Run

    from .test_recipe import MINI

    spec = yaml.safe_load((Path(R.__file__).parent / "recipes" / "otcclip-shards-tiny.yaml").read_text())
    extra = ["stream.shard_size=42", "stream.window_batches=4", "audit_defense=", "threads=1",
             "defenses=[cleanclip]", "data.clean_finetune_pairs=40", "defense.cleanclip_start_epoch=1"]  # fmt: skip
    cfg = load_config(R.Config, spec["config"], [*MINI, *extra])
    R.preflight(cfg)
    run = Run.create(tmp_path / "r", cfg, "otcclip-shards-tiny", quiet=True)
    summary = R.run(cfg, run)
    manifest = json.loads((run.dir / "clean_shards" / sh.MANIFEST).read_text())
    assert (manifest["n_samples"], manifest["n_poisoned"], len(manifest["shards"])) == (40, 0, 2)
    bed = build_testbed(cfg.data, cfg.seed)
    got = {int(s["index"]): s for s in sh.ShardStream(run.dir / "clean_shards")}
    assert all(got[i]["caption"] == bed.clean.captions[i] for i in range(40))
    log = [json.loads(line) for line in (run.dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["phase"] for r in log] == ["clip", "cleanclip"] and "loss_inmodal" in log[1]
    # 168 pairs / batch 20 = the schedule's 8 steps; 40 clean pairs give 2 per pass
    assert (log[0]["data_steps"], log[1]["data_steps"], log[1]["data_clean_passes"]) == (8, 8, 4)
    data = json.loads((run.dir / "analysis" / "data.json").read_text())
    assert data["n_clean_finetune"] == 40 and data["clean_source"].endswith("clean_shards")
    assert 0 <= summary["cleanclip.zeroshot_acc"] <= 1
    # the user's way: both shard sets as folders (stream.source, stream.clean_source)
    user = [*MINI, *extra, "stream.write_shards=false", f"stream.source={run.dir / 'shards'}",
            f"stream.clean_source={run.dir / 'clean_shards'}"]  # fmt: skip
    cfg = load_config(R.Config, spec["config"], user)
    R.preflight(cfg)
    run = Run.create(tmp_path / "u", cfg, "otcclip-shards-tiny", quiet=True)
    R.run(cfg, run)
    assert not (run.dir / "clean_shards").exists()  # stream.clean_source replaces the testbed's set
    log = [json.loads(line) for line in (run.dir / "metrics.jsonl").read_text().splitlines()]
    assert (log[1]["phase"], log[1]["data_steps"], log[1]["data_clean_passes"]) == ("cleanclip", 8, 4)
    data = json.loads((run.dir / "analysis" / "data.json").read_text())
    assert data["clean_source"] == str(tmp_path / "r" / "clean_shards") and "n_clean_finetune" not in data


@pytest.mark.slow  # two torchrun ranks and one process, each importing torch: ~1-2 min on the loaded 2-core machine
def test_two_torchrun_ranks_fine_tune_on_the_clean_stream_like_one_process(items, tmp_path):
    """CleanCLIP over shards with a clean source, 4 slots: epoch 0 pre-trains on the poisoned shards, epochs 1-2
    fine-tune on the clean shards (cycled to the schedule's steps); one process with 2 DataLoader workers against
    torchrun with 2 gloo ranks x 1 worker, each reading half of each set."""
    from .torchrun_compare import one_vs_two_ranks

    shards = _write(_data(items, 32), tmp_path / "shards", shard_size=4)
    clean = _write(_clean_mosaics(items, 24), tmp_path / "clean", shard_size=3)  # 8 shards: 2 per slot
    worker = Path(__file__).parent / "stream_worker.py"
    one, two = one_vs_two_ranks(worker, shards, tmp_path, extra=("tiny", str(clean)), defense="cleanclip")
    assert [s["phase"] for s in one["stats"]] == ["clip", "cleanclip", "cleanclip"]
    for a, b in zip(one["stats"][1:], two["stats"][1:]):
        assert a["data_clean_passes"] == b["data_clean_passes"] >= 1
        assert b["loss_inmodal"] == pytest.approx(a["loss_inmodal"], rel=1e-4)
    moved = 0.0
    for name, w in one["state"].items():
        assert torch.allclose(two["state"][name], w, atol=1e-4, rtol=0), name  # as the OTCCLIP DDP test
        moved += float((w - one["init"][name]).abs().sum())
    assert moved > 1e-2  # training changed the weights: the comparison is not vacuous
