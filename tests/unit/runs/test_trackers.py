"""TensorBoard and W&B trackers, checked by reading back what each wrote with an independent reader."""

import json
import socket
import struct
import sys
import threading
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch

from reprlab.errors import ConfigError
from reprlab.runs import trackers
from reprlab.runs.trackers import (
    TRACKERS,
    MultiTracker,
    check_trackers_available,
    flatten_record,
    open_trackers,
    parse_trackers,
)

CONFIG = {"seed": 0, "train": {"lr": 0.1, "steps": 5}, "out": Path("/tmp/x")}


# ---------------------------------------------------------------------------------------------- names and records
def test_parse_trackers_accepts_specs_and_names_the_valid_ones_on_error():
    assert TRACKERS == ("tensorboard", "wandb")
    assert parse_trackers("tensorboard,wandb") == ("tensorboard", "wandb")
    assert parse_trackers(" WandB , tensorboard,,wandb ") == ("wandb", "tensorboard")  # case, blanks, repeats
    assert parse_trackers(["tensorboard"]) == ("tensorboard",)
    assert parse_trackers(None) == parse_trackers("") == parse_trackers([]) == ()
    with pytest.raises(ConfigError, match=r"unknown tracker 'mlflow'; valid trackers: tensorboard, wandb"):
        parse_trackers("tensorboard,mlflow")
    with pytest.raises(ValueError, match="valid trackers"):  # ConfigError is a ValueError for library callers
        parse_trackers([3])


def test_check_trackers_available_gives_the_pip_command(monkeypatch):
    check_trackers_available([])  # nothing asked, nothing checked
    real = trackers.importlib.util.find_spec
    monkeypatch.setattr(
        trackers.importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a)
    )
    with pytest.raises(ConfigError, match=r"wandb.*pip install 'reprlab\[track\]'") as err:
        check_trackers_available("wandb")
    assert err.value.hint == "pip install 'reprlab[track]'"
    with pytest.raises(ConfigError, match="unknown tracker"):
        check_trackers_available(["tensorbored"])


def test_flatten_record_prefixes_string_keys_and_keeps_only_numbers():
    record = {
        "defense": "otcclip",
        "loss": 0.25,
        "epoch": 3,
        "t": torch.tensor(1.5),
        "n": np.float32(2.0),
        "i": np.int64(7),
        "stopped": True,
        "flag": np.bool_(False),
        "hist": [1, 2],
        "none": None,
    }
    assert flatten_record(record) == {
        "otcclip/loss": 0.25,
        "otcclip/epoch": 3,
        "otcclip/t": 1.5,
        "otcclip/n": 2.0,
        "otcclip/i": 7,
    }
    assert flatten_record({"loss": 1.0, "lr": 0.1}) == {"loss": 1.0, "lr": 0.1}  # no string key: no prefix


def test_no_trackers_is_a_no_op_that_imports_nothing(monkeypatch, tmp_path):
    # A None entry in sys.modules makes `import x` raise, so any import attempt would fail this test.
    for name in ("wandb", "tensorboard", "torch.utils.tensorboard"):
        monkeypatch.setitem(sys.modules, name, None)
    with open_trackers("", tmp_path, "run", CONFIG, None) as multi:
        assert isinstance(multi, MultiTracker) and multi.trackers == ()
        multi.log(0, {"loss": 1.0})
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------------------------------------- TensorBoard
def _tb_scalars(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tensorboard"))  # purges orphaned data (purge_step) by default
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_tensorboard_scalars_match_records_and_resume_purges_later_steps(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    records = [(s, {"loss": 1.0 / (s + 1), "lr": 0.1 * s, "stopped": False}) for s in range(5)]
    # A second loop in the same run restarts its steps; the string key keeps its curves apart.
    records += [(s, {"defense": "otcclip", "loss": 2.0 + s}) for s in range(2)]
    multi = open_trackers(["tensorboard"], tmp_path, "run", CONFIG, None)
    for step, metrics in records:
        multi.log(step, metrics)
    multi.close()

    scalars = _tb_scalars(tmp_path)
    assert sorted(scalars) == ["loss", "lr", "otcclip/loss"]  # the bool is not a scalar
    assert scalars["loss"] == [(s, pytest.approx(1.0 / (s + 1), rel=1e-6)) for s in range(5)]
    assert scalars["lr"] == [(s, pytest.approx(0.1 * s, rel=1e-6)) for s in range(5)]
    assert scalars["otcclip/loss"] == [(0, 2.0), (1, 3.0)]
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    (text,) = acc.Tensors("config/text_summary")
    assert '"lr": 0.1' in text.tensor_proto.string_val[0].decode()

    # Resume from the checkpoint at step 3: steps 3 and 4 of the first start are dropped, like in
    # metrics.jsonl, and the re-logged ones replace them.
    multi = open_trackers(["tensorboard"], tmp_path, "run", CONFIG, resume_step=3)
    multi.log(3, {"loss": -3.0})
    multi.close()
    assert _tb_scalars(tmp_path)["loss"] == [
        (0, 1.0),
        (1, 0.5),
        (2, pytest.approx(1 / 3, rel=1e-6)),
        (3, -3.0),
    ]


# ---------------------------------------------------------------------------------------------- Weights & Biases
def _wandb_records(path: Path) -> list:
    """Records of an offline ``.wandb`` file, parsed with wandb's own protobuf schema.

    wandb >= 0.2x writes the file from its Go core and no longer ships a Python reader (the old
    ``wandb.sdk.internal.datastore``), so the framing is read here: a 7-byte header ``:W&B`` + magic + version,
    then LevelDB-log records in 32 KiB blocks (crc32 of type+data, length, type FULL/FIRST/MIDDLE/LAST).
    """
    from wandb.proto import wandb_internal_pb2

    data, block = path.read_bytes(), 32768
    assert data[:4] == b":W&B"
    pos, pending, out = 7, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is zero padding
            pos += block - pos % block
            continue
        crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk = data[pos + 7 : pos + 7 + length]
        assert zlib.crc32(chunk, zlib.crc32(bytes([kind]))) == crc, f"bad checksum at byte {pos}"
        pos += 7 + length
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            out.append(record)
    return out


def _items(items) -> dict:
    # wandb 0.31 fills nested_key (one part per level) and leaves key empty; older versions filled key.
    return {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in items}


def _wandb_history(path: Path) -> list[dict]:
    rows = [r.history for r in _wandb_records(path) if r.WhichOneof("record_type") == "history"]
    return [_items(row.item) for row in rows]


@pytest.fixture
def wandb_env(monkeypatch, tmp_path):
    """Offline W&B confined to tmp_path, with WANDB_BASE_URL on a local socket that counts connections.

    wandb reads its WANDB_* variables once per process, when its service starts (``wandb.setup``), so the
    service is torn down around each test: otherwise this test's base URL and timeouts would be ignored.
    """
    wandb = pytest.importorskip("wandb")
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.1)
    hits: list[tuple] = []
    stop = threading.Event()

    def accept():
        while not stop.is_set():
            try:
                conn, addr = server.accept()
            except OSError:
                continue
            hits.append(addr)
            conn.close()

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    env = {
        "WANDB_MODE": "offline",
        "WANDB_SILENT": "true",
        "WANDB_DIR": str(tmp_path / "wandb-dir"),
        "WANDB_CONFIG_DIR": str(tmp_path / "wandb-config"),
        "WANDB_CACHE_DIR": str(tmp_path / "wandb-cache"),
        "WANDB_DATA_DIR": str(tmp_path / "wandb-data"),
        "WANDB_BASE_URL": f"http://127.0.0.1:{server.getsockname()[1]}",
        "WANDB_API_KEY": "x"
        * 40,  # so an online attempt would go straight to the server, not ask for a login
        "WANDB_ERROR_REPORTING": "false",  # Sentry would be network too
    }
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("WANDB_PROJECT", raising=False)
    wandb.teardown()
    yield hits
    wandb.teardown()
    stop.set()
    thread.join()
    server.close()


def test_wandb_offline_history_matches_records_and_resume_continues_the_run(wandb_env, tmp_path):
    run_dir = tmp_path / "run"
    records = [(s, {"loss": 1.0 / (s + 1), "lr": 0.1 * s, "stopped": s == 2}) for s in range(3)]
    records += [(s, {"defense": "otcclip", "loss": 2.0 + s}) for s in range(2)]  # steps go back to 0
    multi = open_trackers(["wandb"], run_dir, "my-run", CONFIG, None)
    for step, metrics in records:
        multi.log(step, metrics)
        # A killed run's successor must start past every W&B step this one wrote: a block is reserved first.
        assert int((run_dir / "wandb_step.txt").read_text()) >= len(records)
    multi.close()

    run_id = (run_dir / "wandb_id.txt").read_text().strip()
    (first,) = (run_dir / "wandb").glob(f"offline-run-*-{run_id}/run-{run_id}.wandb")
    history = _wandb_history(first)
    assert [row["_step"] for row in history] == list(range(5))  # nothing dropped although the step went back
    # Each row is the record's numbers (the bool left out) plus the reprlab step; the prefixed loop's too.
    expected = [{"_reprlab_step": s, "loss": 1.0 / (s + 1), "lr": 0.1 * s} for s in range(3)]
    expected += [{"_reprlab_step": s, "otcclip/loss": 2.0 + s} for s in range(2)]
    ours = [{k: v for k, v in row.items() if k not in ("_step", "_runtime", "_timestamp")} for row in history]
    assert ours == [{k: pytest.approx(v, rel=1e-12) for k, v in row.items()} for row in expected]
    (run_record,) = [r.run for r in _wandb_records(first) if r.WhichOneof("record_type") == "run"]
    assert (run_record.run_id, run_record.display_name, run_record.project) == (run_id, "my-run", "reprlab")
    config = _items(run_record.config.update)
    assert config["train"] == {"lr": 0.1, "steps": 5} and config["out"] == "/tmp/x"
    assert (run_dir / "wandb_step.txt").read_text().strip() == "5"

    # Resume: the same W&B run id, a new offline folder (W&B cannot resume offline), and _step continuing
    # after the first start's so `wandb sync --append` can join the two.
    multi = open_trackers(["wandb"], run_dir, "my-run", CONFIG, resume_step=2)
    multi.log(2, {"loss": 9.0})
    multi.close()
    assert (run_dir / "wandb_id.txt").read_text().strip() == run_id
    files = sorted((run_dir / "wandb").glob(f"offline-run-*-{run_id}*/run-{run_id}.wandb"))
    assert len(files) == 2
    (second,) = [f for f in files if f != first]
    (row,) = _wandb_history(second)
    assert (row["_step"], row["_reprlab_step"], row["loss"]) == (5, 2, 9.0)
    assert wandb_env == []  # no connection to WANDB_BASE_URL


def test_wandb_defaults_to_offline_and_never_connects(wandb_env, tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_MODE")  # not set by the user: reprlab's default must be offline
    run_dir = tmp_path / "run"
    with open_trackers("wandb", run_dir, "r", {}, None) as multi:
        multi.log(0, {"loss": 1.0})
    assert list((run_dir / "wandb").glob("offline-run-*"))
    assert wandb_env == []  # the API key and base URL were there; an online attempt would have connected


def test_the_connection_counter_does_see_an_online_attempt(wandb_env, tmp_path, monkeypatch):
    """Control for the two tests above: online, wandb does reach WANDB_BASE_URL, so an empty count means none."""
    wandb = pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "online")
    monkeypatch.setenv("WANDB_INIT_TIMEOUT", "1")  # the socket answers nothing useful; give up fast
    with pytest.raises(wandb.Error):
        open_trackers("wandb", tmp_path / "run", "r", {}, None)
    assert wandb_env
