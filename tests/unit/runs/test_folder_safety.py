"""Run folders never mix or lose results: lock, --resume/--out/--overwrite checks, corrupt checkpoints,
damaged metrics, file modes. Each test here fails on the run folder code before the single-writer lock and exact resume."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from reprlab.errors import CheckpointError, RunFolderError, RunLockedError
from reprlab.methods.smoke.recipe import Interrupted
from reprlab.runner import execute
from reprlab.runs.lock import RunLock

FAST = ["train.epochs=3", "train.checkpoint_every=10"]  # 66 steps; checkpoints at 10, 20, ... (last two kept)


def _metrics(run_dir):
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _summary(run_dir):
    s = json.loads((run_dir / "summary.json").read_text())
    s.pop("wall_time_s")
    return s


@pytest.fixture
def full_run(tmp_path):
    return execute("smoke-digits", FAST, tmp_path / "full", quiet=True)


def _interrupted(tmp_path, monkeypatch, name="cut", after=35):
    monkeypatch.setenv("REPRLAB_SMOKE_STOP_AFTER", str(after))  # dies 5 steps after the step-30 checkpoint
    with pytest.raises(Interrupted):
        execute("smoke-digits", FAST, tmp_path / name, quiet=True)
    monkeypatch.delenv("REPRLAB_SMOKE_STOP_AFTER")
    return tmp_path / name


def _hold_lock_in_other_process(folder):
    code = textwrap.dedent(f"""
        import sys, time
        from reprlab.runs.lock import RunLock
        lock = RunLock.acquire({str(folder)!r})
        print("locked", flush=True)
        sys.stdin.read()  # hold until the test closes our stdin
    """)
    proc = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout.readline().strip() == "locked"
    return proc


def test_second_writer_fails_at_once_naming_the_holder(tmp_path, monkeypatch):
    cut = _interrupted(tmp_path, monkeypatch)
    before = (cut / "metrics.jsonl").read_bytes()
    holder = _hold_lock_in_other_process(cut)
    try:
        with pytest.raises(RunLockedError, match=rf"pid {holder.pid} on .*started 20\d\d-"):
            execute("smoke-digits", FAST, cut, resume=True, quiet=True)
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)
    assert (cut / "metrics.jsonl").read_bytes() == before  # refused before touching anything
    execute("smoke-digits", FAST, cut, resume=True, quiet=True)  # the holder is gone: the lock is free again


def test_report_of_a_folder_being_written_is_refused(tmp_path, full_run):
    """`reprlab report` writes report.html/.md into the folder: while a live process holds the folder's lock it
    is refused, naming the holder, and the report is left as it was; once the holder is gone it rebuilds."""
    from typer.testing import CliRunner

    from reprlab.cli import app

    before = (full_run / "report.md").read_bytes()
    (full_run / "report.md").write_text("stale")
    holder = _hold_lock_in_other_process(full_run)
    try:
        result = CliRunner().invoke(app, ["report", str(full_run)])
        assert result.exit_code == 2 and f"pid {holder.pid}" in result.output, result.output
        assert (full_run / "report.md").read_text() == "stale"
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)
    result = CliRunner().invoke(app, ["report", str(full_run)])
    assert result.exit_code == 0, result.output
    assert (full_run / "report.md").read_bytes() == before


def test_sigterm_is_handled_as_ctrl_c_so_an_overwrite_puts_the_old_results_back(tmp_path, full_run):
    """Slurm, submitit and preemption stop a job with SIGTERM: the console entry turns it into the same clean-up
    as Ctrl-C (exit 143, one line, the old results of an --overwrite swapped back, the lock let go). Before, the
    process died at once and left the new, unfinished run in place of the finished one."""
    import signal
    import time

    before = (full_run / "summary.json").read_bytes()
    cmd = [sys.executable, "-m", "reprlab.cli", "run", "smoke-digits", "--out", str(full_run), "--overwrite",
           "-q", "train.epochs=400"]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 120

        def training() -> bool:  # the old run is set aside and the new one has written a metrics line
            aside = list(full_run.parent.glob(f".{full_run.name}.replaced-*"))
            return bool(aside) and (full_run / "metrics.jsonl").exists()

        while not training() and time.time() < deadline:
            time.sleep(0.2)
        assert training(), "the new run never started"
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 143, err
    assert "terminated (SIGTERM)" in err and "Traceback" not in err, err
    # the old run is back, so "--resume" would continue it rather than the interrupted one: not offered
    assert f"the --overwrite was undone: {full_run} holds its earlier results again" in err, err
    assert "--resume" not in err, err
    assert (full_run / "summary.json").read_bytes() == before
    assert RunLock.holder(full_run) is None


def test_resume_with_another_config_says_how_the_run_was_made(tmp_path, full_run):
    """--resume with other overrides names the differing key and gives the command that made the run; with
    another recipe it says so instead of listing whole config sections."""
    with pytest.raises(RunFolderError, match=r"train.epochs: 3 -> 4") as err:
        execute(
            "smoke-digits", ["train.epochs=4", "train.checkpoint_every=10"], full_run, resume=True, quiet=True
        )
    assert "reprlab run smoke-digits train.epochs=3 train.checkpoint_every=10" in err.value.hint
    with pytest.raises(RunFolderError, match=r"is a run of recipe smoke-digits, not normic-tiny"):
        execute("normic-tiny", [], full_run, resume=True, quiet=True)


def test_a_killed_overwrite_says_where_the_old_results_are(tmp_path, full_run):
    """SIGKILL during --overwrite leaves the new, unfinished run in place and the old one set aside: a plain run
    into the folder names the set-aside folder and how to go back, instead of only "an unfinished run"."""
    import shutil

    aside = tmp_path / f".{full_run.name}.replaced-12345"
    shutil.copytree(full_run, aside)
    (full_run / "summary.json").unlink()  # the new run, killed before it finished
    with pytest.raises(
        RunFolderError, match=rf"unfinished run; the results it replaced are kept in .*{aside.name}"
    ) as err:
        execute("smoke-digits", FAST, full_run, quiet=True)
    assert f"rename {aside.name}" in err.value.hint


def test_the_report_of_an_unfinished_run_says_so_first(tmp_path, monkeypatch):
    """An interrupted run's report opens with a section saying it did not finish (it was said only inside the
    folded summary section); a finished run's report has no such section."""
    from reprlab.report.build import build_report

    cut = _interrupted(tmp_path, monkeypatch)
    _, md = build_report(cut)
    text = md.read_text()
    assert "This run did not finish" in text and text.index("This run did not finish") < text.index("Config")
    done = execute("smoke-digits", ["train.epochs=1"], tmp_path / "done", quiet=True)
    assert "This run did not finish" not in (done / "report.md").read_text()


def test_forked_pool_workers_stopped_by_sigterm_die_quietly():
    """A multiprocessing pool stops its forked workers with SIGTERM; they inherit the console's handler, which
    must let them die as before rather than print a Terminated traceback from each worker."""
    code = textwrap.dedent("""
        import multiprocessing as mp
        from reprlab.cli import _term_as_interrupt
        _term_as_interrupt()
        with mp.get_context("fork").Pool(2) as pool:
            print(sum(pool.map(abs, range(-5, 5))))
    """)  # the with-block's exit is pool.terminate(): SIGTERM to every worker
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "25", proc.stderr
    assert "Traceback" not in proc.stderr and "Terminated" not in proc.stderr, proc.stderr


def test_stale_lock_of_a_dead_process_is_taken_over(tmp_path, caplog):
    folder = tmp_path / "r"
    folder.mkdir()
    proc = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    dead = int(proc.stdout)
    (folder / ".reprlab.lock").write_text(json.dumps({"pid": dead, "started": "2026-01-01T00:00:00"}))
    with caplog.at_level("WARNING"):
        lock = RunLock.acquire(folder)
    assert lock.stale["pid"] == dead and f"stale lock of pid {dead}" in caplog.text
    lock.release()
    assert (folder / ".reprlab.lock").read_text() == ""  # a clean release leaves no stale record


def test_resume_needs_an_existing_run_folder(tmp_path):
    with pytest.raises(RunFolderError, match="does not exist"):
        execute("smoke-digits", FAST, tmp_path / "missing", resume=True, quiet=True)
    assert not (tmp_path / "missing").exists()
    (tmp_path / "notarun").mkdir()
    (tmp_path / "notarun" / "notes.txt").write_text("mine")
    with pytest.raises(RunFolderError, match="not a reprlab run folder"):
        execute("smoke-digits", FAST, tmp_path / "notarun", resume=True, quiet=True)


def test_out_into_a_non_run_folder_never_touches_the_users_files(tmp_path):
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "metrics.jsonl").write_text("my own file\n")
    for overwrite in (False, True):
        with pytest.raises(RunFolderError, match="not a reprlab run"):
            execute("smoke-digits", FAST, folder, overwrite=overwrite, quiet=True)
    assert sorted(p.name for p in folder.iterdir()) == ["metrics.jsonl"]
    assert (folder / "metrics.jsonl").read_text() == "my own file\n"


def test_overwrite_never_leaves_files_of_two_runs_side_by_side(tmp_path, full_run):
    (full_run / "analysis").mkdir()
    (full_run / "analysis" / "old.json").write_text("{}")
    (full_run / "figures" / "old.png").parent.mkdir(exist_ok=True)
    (full_run / "figures" / "old.png").write_bytes(b"png")
    execute("smoke-digits", [*FAST, "hidden=32"], full_run, overwrite=True, quiet=True)
    assert not (full_run / "analysis").exists() and not (full_run / "figures" / "old.png").exists()
    assert "hidden: 32" in (full_run / "config.yaml").read_text()
    assert not list(tmp_path.glob(".full.replaced-*"))  # the old results are gone once the new run finished


def test_failed_overwrite_restores_the_old_results(tmp_path, monkeypatch, full_run):
    old = {p.relative_to(full_run): p.read_bytes() for p in full_run.rglob("*") if p.is_file()}
    monkeypatch.setenv("REPRLAB_SMOKE_STOP_AFTER", "15")
    with pytest.raises(Interrupted):
        execute("smoke-digits", FAST, full_run, overwrite=True, quiet=True)
    now = {p.relative_to(full_run): p.read_bytes() for p in full_run.rglob("*") if p.is_file()}
    assert now == old  # byte for byte, nothing of the failed run mixed in
    assert not list(tmp_path.glob(".full.replaced-*"))


def test_bad_config_fails_before_the_old_results_are_moved(tmp_path, full_run):
    before = sorted(p.name for p in full_run.iterdir())
    with pytest.raises(Exception, match="batch_size: must be >= 1"):
        execute("smoke-digits", [*FAST, "train.batch_size=0"], full_run, overwrite=True, quiet=True)
    assert sorted(p.name for p in full_run.iterdir()) == before


def test_corrupt_latest_checkpoint_stops_the_resume_and_resume_from_the_previous_ends_like_an_uninterrupted_run(
    tmp_path, monkeypatch, full_run
):
    cut = _interrupted(tmp_path, monkeypatch)
    latest = cut / "checkpoints" / "train" / "step_00000030"
    weights = latest / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-5] ^= 0xFF  # one flipped byte: same size, wrong checksum
    weights.write_bytes(bytes(data))
    before = _tree(cut)
    with pytest.raises(
        CheckpointError, match=r"step_00000030/model.safetensors does not match its SHA-256"
    ) as err:
        execute("smoke-digits", FAST, cut, resume=True, quiet=True)
    assert "--resume --resume-from train/step_00000020" in err.value.hint
    assert _tree(cut) == before  # no fallback, no metrics cut, no fresh start: nothing changed
    execute("smoke-digits", FAST, cut, resume=True, resume_from="train/step_00000020", quiet=True)
    assert (cut / "checkpoints" / "train" / ".superseded-step_00000030").is_dir()  # kept for inspection
    assert _metrics(cut) == _metrics(full_run)
    assert _summary(cut) == _summary(full_run)


def _tree(folder):
    return {p.relative_to(folder): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def test_garbage_after_the_last_checkpoint_in_metrics_is_dropped_on_resume(tmp_path, monkeypatch, full_run):
    cut = _interrupted(tmp_path, monkeypatch)
    with open(cut / "metrics.jsonl", "ab") as fh:
        fh.write(
            b'\xff\xfe\x00 not utf-8\n{"step": 99, "loss": 1.0}\n{"step": 100, "lo'
        )  # junk + a torn line
    execute("smoke-digits", FAST, cut, resume=True, quiet=True)
    assert _metrics(cut) == _metrics(full_run)


def test_damage_before_the_last_checkpoint_is_an_error_naming_the_line(tmp_path, monkeypatch):
    cut = _interrupted(tmp_path, monkeypatch)
    lines = (cut / "metrics.jsonl").read_bytes().splitlines(keepends=True)
    lines[2] = b"\xff\xff\n"
    (cut / "metrics.jsonl").write_bytes(b"".join(lines))
    with pytest.raises(RunFolderError, match=r"metrics.jsonl:3 is corrupt"):
        execute("smoke-digits", FAST, cut, resume=True, quiet=True)


def test_files_follow_the_users_umask(tmp_path):
    old = os.umask(0o002)
    try:
        run_dir = execute(
            "smoke-digits", ["train.epochs=1", "train.checkpoint_every=5"], tmp_path / "r", quiet=True
        )
    finally:
        os.umask(old)
    for name in ("summary.json", "config.yaml", "env.json", "report.html", "claims.json"):
        assert (run_dir / name).stat().st_mode & 0o777 == 0o664, name
    ckpt = next((run_dir / "checkpoints" / "train").iterdir())
    assert ckpt.stat().st_mode & 0o777 == 0o775
    assert all(f.stat().st_mode & 0o777 == 0o664 for f in ckpt.iterdir())


def test_env_records_cpu_and_threads(tmp_path):
    run_dir = execute("smoke-digits", ["train.epochs=1"], tmp_path / "r", quiet=True)
    env = json.loads((run_dir / "env.json").read_text())
    for key in (
        "cpu_model",
        "isa_flags",
        "torch_threads",
        "torch_interop_threads",
        "cpu_count",
        "git_commit",
    ):
        assert key in env, key
    assert env["torch_threads"] >= 1
    # the resolved command re-runs the recipe; the invocation is what was typed (here pytest's)
    assert env["command"] == ["reprlab", "run", "smoke-digits", "train.epochs=1"]
    assert env["invocation"] == sys.argv


def test_same_seed_same_summary(tmp_path):
    """Determinism on one machine with the same threads: the whole summary, bit for bit."""
    a = execute("smoke-digits", ["train.epochs=2"], tmp_path / "a", quiet=True)
    b = execute("smoke-digits", ["train.epochs=2"], tmp_path / "b", quiet=True)
    assert _summary(a) == _summary(b) and _metrics(a) == _metrics(b)


def test_tensorboard_after_kill_and_resume_holds_exactly_the_metrics_jsonl_losses(tmp_path, monkeypatch):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.setenv("REPRLAB_SMOKE_STOP_AFTER", "35")
    with pytest.raises(Interrupted):
        execute("smoke-digits", FAST, tmp_path / "r", quiet=True, track="tensorboard")
    monkeypatch.delenv("REPRLAB_SMOKE_STOP_AFTER")
    execute("smoke-digits", FAST, tmp_path / "r", resume=True, quiet=True, track="tensorboard")
    acc = EventAccumulator(str(tmp_path / "r" / "tensorboard"))
    acc.Reload()
    tb = {e.step: e.value for e in acc.Scalars("loss")}
    jsonl = {m["step"]: m["loss"] for m in _metrics(tmp_path / "r") if "loss" in m}
    assert sorted(tb) == sorted(jsonl)  # steps 31-35 of the killed run were purged, not doubled
    assert all(tb[s] == pytest.approx(jsonl[s], rel=1e-6) for s in jsonl)  # TB stores float32
