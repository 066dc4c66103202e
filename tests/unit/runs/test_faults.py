"""Faults injected at every write step of a run (smoke-digits) and of a sweep's aggregate.

* kill: the run is SIGKILLed right after each file operation of a checkpoint write, of claims.json,
  summary.json and the report, and of a sweep's aggregate; ``--resume`` then ends with the same summary,
  weights, optimizer state and metrics as an uninterrupted run (the same code path from the same state, so
  bit for bit), with no temporary file left.
* a full disk (ENOSPC) or a read-only file system (EROFS) at each checkpoint operation, and at summary.json:
  a :class:`WriteError` naming the file (exit 2 at the CLI), the previous checkpoint intact, and a resume
  after the disk is freed ends like an uninterrupted run. A truly read-only run folder (chmod, as a
  non-root user) is refused the same way before anything is written.
* ``--overwrite`` holds the lock from the check to the clean-up: with the writer paused before the swap,
  after it, mid-run and before the clean-up, a second writer (plain, ``--overwrite``, ``--resume``) is refused
  by name and is never told the live writer's set-aside folder is an interrupted one.

The kills happen in a forked child (SIGKILL must not hit pytest); the operation lists are learned from an
uninterrupted run (``REPRLAB_FAULT_LOG``) and pinned below, so a new write step fails the test until it is
added here, and thereby covered.
"""

import json
import os
import shutil
import signal
import sys
import tempfile
import traceback
from pathlib import Path

import pytest
from typer.testing import CliRunner

import reprlab
from reprlab.cli import app
from reprlab.errors import ReprlabError, RunFolderError, WriteError
from reprlab.methods.smoke.recipe import Interrupted
from reprlab.runner import execute
from reprlab.runs import faults
from reprlab.runs.checkpoint import check_checkpoint, list_checkpoints
from reprlab.sweep import run_sweep

FAST = ["train.epochs=1", "train.checkpoint_every=10"]  # 22 steps; checkpoints at 10, 20 and 22 (keeps two)
CKPT_OPS = [  # the write of the last checkpoint, step 22, which also prunes step 10
    "checkpoint:mkdir:step_00000022",
    "checkpoint:write:model.safetensors",
    "checkpoint:write:optim_opt.safetensors",
    "checkpoint:write:optim_opt.json",
    "checkpoint:write:rng.safetensors",
    "checkpoint:write:rng.json",
    "checkpoint:write:meta.json",
    "checkpoint:commit:step_00000022",
    "checkpoint:discard:step_00000010",
    "checkpoint:remove:.trash-step_00000010",
]
ATOMIC = (
    "write",
    "replace",
    "syncdir",
)  # temporary file written and fsynced, renamed over, directory fsynced
END_OPS = [  # after training: claims, summary, then the report (the second figure is written like the first)
    *(f"file:{op}:claims.json" for op in ATOMIC),
    *(f"file:{op}:summary.json" for op in ATOMIC),
    *(f"report:{op}:test-confusion-matrix.svg" for op in ATOMIC),
    *(f"report:{op}:report.html" for op in ATOMIC),
    *(f"report:{op}:report.md" for op in ATOMIC),
]
AGG_OPS = [
    *(
        f"aggregate:{op}:{name}"
        for name in ("summary.json", "aggregate.json", "claims.json")
        for op in ATOMIC
    ),
    *(f"aggregate:{op}:report.html" for op in ATOMIC),
]


@pytest.fixture(autouse=True)
def _fresh_fault_counts(monkeypatch):
    monkeypatch.delenv(faults.FAULT_ENV, raising=False)
    faults.reset()
    yield
    faults.reset()


def _in_child(fn, env):
    """Run ``fn`` in a forked child with ``env`` set; returns its wait status (the child never returns)."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 0
        try:
            faults.reset()
            os.environ.update(env)
            fn()
        except ReprlabError as err:
            print(f"error: {err}", flush=True)
            code = 2
        except BaseException:
            traceback.print_exc()
            code = 3
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    return status


def _killed(status):
    return os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL


def _summary(run_dir):
    s = json.loads((run_dir / "summary.json").read_text())
    s.pop("wall_time_s")  # the only value that depends on the clock
    return s


def _last_checkpoint(run_dir):
    return list_checkpoints(run_dir / "checkpoints" / "train")[-1]


def _assert_same_result(run_dir, full):
    assert _summary(run_dir) == _summary(full)
    got, want = _last_checkpoint(run_dir), _last_checkpoint(full)
    assert got.name == want.name
    for name in ("model.safetensors", "optim_opt.safetensors", "optim_opt.json"):
        assert (got / name).read_bytes() == (want / name).read_bytes(), name
    assert (run_dir / "metrics.jsonl").read_bytes() == (full / "metrics.jsonl").read_bytes()
    left = [p for p in run_dir.rglob(".*") if p.name != ".reprlab.lock"]
    assert not left, left  # no temporary file, half-made or half-pruned checkpoint


@pytest.fixture(scope="module")
def reference(tmp_path_factory, one_thread):
    """An uninterrupted run and the labels of every file operation it made."""
    root = tmp_path_factory.mktemp("faults")
    log = root / "ops.log"
    mp = pytest.MonkeyPatch()
    mp.setenv(faults.LOG_ENV, str(log))
    full = execute("smoke-digits", FAST, root / "full", quiet=True)
    mp.undo()
    ops = [op for op in log.read_text().splitlines() if not op.endswith(":metrics.jsonl")]
    return full, ops


def test_the_pinned_operation_lists_are_the_writers_operations(reference):
    _, ops = reference
    start = ops.index(CKPT_OPS[0])
    assert ops[start : start + len(CKPT_OPS)] == CKPT_OPS
    end = ops.index(END_OPS[0])
    assert [op for op in ops[end:] if "training-curves" not in op] == END_OPS


@pytest.fixture(scope="module")
def stopped(tmp_path_factory, one_thread):
    """Runs stopped after step 21 (newest checkpoint 20) and after step 22 (checkpoint 22, no summary).

    Each case below resumes a copy, so the operation under test is the first of its kind in the child.
    """
    root = tmp_path_factory.mktemp("stopped")
    mp = pytest.MonkeyPatch()
    out = {}
    for step in (21, 22):
        mp.setenv("REPRLAB_SMOKE_STOP_AFTER", str(step))
        with pytest.raises(Interrupted):
            execute("smoke-digits", FAST, root / f"at{step}", quiet=True)
        out[step] = root / f"at{step}"
    mp.undo()
    return out


@pytest.fixture
def no_report(monkeypatch):
    """Cases whose fault hits before the report skip building it (matplotlib: ~1 s a run, most of a case);
    the report's own write steps are cases of their own, with the real report."""
    import reprlab.report.build

    monkeypatch.setattr(reprlab.report.build, "build_report", lambda run_dir: None)


def _copy(src, tmp_path):
    shutil.copytree(src, tmp_path / "run")
    return tmp_path / "run"


def _kill_then_resume(reference, run_dir, label):
    full, _ = reference
    status = _in_child(lambda: execute("smoke-digits", FAST, run_dir, resume=True, quiet=True),
                       {faults.FAULT_ENV: f"kill:{label}:1"})  # fmt: skip
    assert _killed(status), f"the fault at {label} never fired (status {status})"
    execute("smoke-digits", FAST, run_dir, resume=True, quiet=True)
    _assert_same_result(run_dir, full)


@pytest.mark.parametrize("op", CKPT_OPS)
def test_kill_after_each_checkpoint_operation_resumes_to_the_same_bytes(
    reference, stopped, tmp_path, no_report, op
):
    _kill_then_resume(reference, _copy(stopped[21], tmp_path), op)


@pytest.mark.parametrize("op", END_OPS)
def test_kill_after_each_claims_summary_and_report_operation_resumes_to_the_same_bytes(
    reference, stopped, tmp_path, request, op
):
    if not op.startswith("report:"):
        request.getfixturevalue("no_report")
    run_dir = _copy(stopped[22], tmp_path)
    _kill_then_resume(reference, run_dir, op)
    if op.startswith("report:"):  # the report is whole again (its wall time differs, so not the bytes)
        assert (run_dir / "report.html").read_text().endswith("</html>")
        assert "test_acc" in (run_dir / "report.md").read_text()
        assert (run_dir / "figures" / "test-confusion-matrix.svg").read_text().rstrip().endswith("</svg>")


# ENOSPC at every step; EROFS (the same error path) at the first, a data and the commit step
@pytest.mark.parametrize(
    ("code", "op"), [("enospc", op) for op in CKPT_OPS] + [("erofs", CKPT_OPS[i]) for i in (0, 1, 7)]
)
def test_full_disk_or_read_only_at_each_checkpoint_operation(
    reference, stopped, tmp_path, monkeypatch, no_report, code, op
):
    full, _ = reference
    run_dir = _copy(stopped[21], tmp_path)
    monkeypatch.setenv(faults.FAULT_ENV, f"{code}:{op}:1")
    if op.startswith(("checkpoint:discard", "checkpoint:remove")):
        execute("smoke-digits", FAST, run_dir, resume=True, quiet=True)  # pruning is clean-up: a warning
        assert _summary(run_dir) == _summary(full)
        assert check_checkpoint(_last_checkpoint(run_dir), parse=True) is None
        return
    with pytest.raises(WriteError) as err:
        execute("smoke-digits", FAST, run_dir, resume=True, quiet=True)
    reason = "No space left on device" if code == "enospc" else "Read-only file system"
    assert f"cannot write checkpoint {run_dir}/checkpoints/train/step_00000022: {reason}" in str(err.value)
    assert str(err.value).endswith(
        f"the previous checkpoint {run_dir}/checkpoints/train/step_00000020 is intact"
    )
    assert ("disk is full" if code == "enospc" else "read-only") in err.value.hint
    assert _last_checkpoint(run_dir).name == "step_00000020"
    assert check_checkpoint(_last_checkpoint(run_dir), parse=True) is None
    assert not list((run_dir / "checkpoints" / "train").glob(".*"))  # no half-made folder left
    if op == "checkpoint:commit:step_00000022":  # once: freeing the disk and resuming ends where it should
        monkeypatch.delenv(faults.FAULT_ENV)
        execute("smoke-digits", FAST, run_dir, resume=True, quiet=True)
        _assert_same_result(run_dir, full)


def test_full_disk_at_summary_is_exit_2_naming_the_file_then_resumes(
    reference, stopped, tmp_path, monkeypatch, no_report
):
    full, _ = reference
    run_dir = _copy(stopped[22], tmp_path)
    monkeypatch.setenv(faults.FAULT_ENV, "enospc:file:write:summary.json:1")
    result = CliRunner().invoke(app, ["run", "smoke-digits", "--out", str(run_dir), "--resume", *FAST])
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    assert f"error: cannot write {run_dir}/summary.json: No space left on device" in result.output
    assert "hint: the disk is full" in result.output
    assert not (run_dir / "summary.json").exists()
    monkeypatch.delenv(faults.FAULT_ENV)
    execute("smoke-digits", FAST, run_dir, resume=True, quiet=True)
    _assert_same_result(run_dir, full)


def test_a_read_only_run_folder_is_refused_before_anything_is_written(reference, tmp_path):
    """chmod a-w, resumed as a user the permissions bind (root ignores them: the child drops to nobody)."""
    full, _ = reference
    root = Path(tempfile.mkdtemp(prefix="reprlab-ro-"))  # outside pytest's 0700 tmp, so nobody can read it
    try:
        os.chmod(root, 0o755)
        run_dir = root / "run"
        shutil.copytree(full, run_dir)
        before = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
        for p in [run_dir, *run_dir.rglob("*")]:
            os.chmod(p, 0o555 if p.is_dir() else 0o444)
        out = tmp_path / "out.txt"
        fd = os.open(out, os.O_WRONLY | os.O_CREAT)

        def resume():
            if os.geteuid() == 0:
                os.setgid(65534)
                os.setuid(65534)
                if not all(
                    os.access(d, os.R_OK | os.X_OK) for d in (Path(reprlab.__file__).parent, sys.prefix)
                ):
                    os.write(fd, b"skip\n")  # a checkout only root can read (e.g. under /root)
                    return
            result = CliRunner().invoke(
                app, ["run", "smoke-digits", "--out", str(run_dir), "--resume", *FAST]
            )
            os.write(fd, f"{result.exit_code}\n{result.output}".encode())

        assert _in_child(resume, {}) == 0
        code, output = out.read_text().split("\n", 1)
        if code == "skip":
            pytest.skip("the checkout is not readable by an unprivileged user, which this test runs as")
        assert code == "2" and "Traceback" not in output, output
        assert f"cannot write the lock file {run_dir}/.reprlab.lock: Permission denied" in output
        assert "read-only or not writable" in output
        assert {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()} == before
    finally:
        for p in [root, *root.rglob("*")]:
            os.chmod(p, 0o755)
        shutil.rmtree(root)


@pytest.fixture(scope="module")
def sweep(tmp_path_factory, one_thread):
    """A finished two-seed sweep, the bytes of its aggregate, and the labels of the aggregate's operations."""
    root = tmp_path_factory.mktemp("sweep")
    out = run_sweep("smoke-digits", [0, 1], FAST, root / "sweep", quiet=True)
    want = {n: (out / n).read_bytes() for n in ("summary.json", "aggregate.json", "claims.json")}
    log = root / "ops.log"
    mp = pytest.MonkeyPatch()
    mp.setenv(faults.LOG_ENV, str(log))
    run_sweep("smoke-digits", [0, 1], FAST, out, resume=True, quiet=True)  # both seeds done: aggregate only
    mp.undo()
    return out, want, log.read_text().splitlines()


def test_the_aggregate_operations_are_pinned(sweep):
    _, _, ops = sweep
    assert [op for op in ops if op in AGG_OPS] == AGG_OPS


@pytest.mark.parametrize("i", range(len(AGG_OPS)), ids=AGG_OPS)
def test_kill_after_each_aggregate_operation_resumes_to_the_same_bytes(sweep, i):
    out, want, ops = sweep
    for name in (*want, "report.html", "report.md"):
        (out / name).unlink(missing_ok=True)
    env = {faults.FAULT_ENV: f"kill:{AGG_OPS[i]}:1"}
    status = _in_child(lambda: run_sweep("smoke-digits", [0, 1], FAST, out, resume=True, quiet=True), env)
    assert _killed(status), f"the fault at {AGG_OPS[i]} never fired (status {status})"
    run_sweep("smoke-digits", [0, 1], FAST, out, resume=True, quiet=True)
    assert {n: (out / n).read_bytes() for n in want} == want
    assert not [p for p in out.glob(".*") if p.name != ".reprlab.lock"]


# ------------------------------------------------------------------------------------------ --overwrite
PAUSES = [
    "overwrite:swap:run",
    "overwrite:swapped:run",
    "checkpoint:mkdir:step_00000010",
    "overwrite:commit:run",
]


def _wait_for(path, status_of):
    import time

    deadline = time.monotonic() + 120
    while not path.exists():
        assert time.monotonic() < deadline and status_of() is None, "the writer never reached its pause"
        time.sleep(0.01)


def test_overwrite_holds_the_lock_from_check_to_clean_up(reference, tmp_path, caplog):
    full, _ = reference
    run_dir = tmp_path / "run"
    shutil.copytree(full, run_dir)
    gate = tmp_path / "gate"
    for k in range(1, len(PAUSES) + 1):
        Path(f"{gate}.{k}").touch()
    env = {faults.FAULT_ENV: ",".join(f"pause:{p}:1" for p in PAUSES), faults.GATE_ENV: str(gate)}
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the first writer: replaces the run with hidden=32
        os.environ.update(env)
        faults.reset()
        try:
            execute("smoke-digits", [*FAST, "hidden=32"], run_dir, overwrite=True, quiet=True)
            os._exit(0)
        except BaseException:
            traceback.print_exc()
            os._exit(3)
    status = []

    def status_of():
        done, st = os.waitpid(pid, os.WNOHANG)
        if done:
            status.append(st)
        return status[0] if status else None

    refusals = []
    try:
        for k, where in enumerate(PAUSES, 1):
            _wait_for(Path(f"{gate}.{k}.reached"), status_of)
            for kind in ("plain", "overwrite", "resume"):
                with caplog.at_level("WARNING"), pytest.raises(RunFolderError) as err:
                    execute("smoke-digits", FAST, run_dir, quiet=True,
                            overwrite=kind == "overwrite", resume=kind == "resume")  # fmt: skip
                refusals.append((where, kind, str(err.value)))
            Path(f"{gate}.{k}").unlink()
    finally:
        for k in range(1, len(PAUSES) + 1):
            Path(f"{gate}.{k}").unlink(missing_ok=True)
        if status_of() is None:
            _, st = os.waitpid(pid, 0)
            status.append(st)
    assert os.WIFEXITED(status[0]) and os.WEXITSTATUS(status[0]) == 0
    for where, kind, msg in refusals:
        assert f"(pid {pid} on " in msg, (where, kind, msg)  # named: the live writer, nobody else
        assert "being written" in msg or "being replaced" in msg, (where, kind, msg)
    assert "interrupted --overwrite" not in caplog.text  # a live writer's folder is never called interrupted
    assert "hidden: 32" in (run_dir / "config.yaml").read_text()
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == len((full / "metrics.jsonl").read_text().splitlines())  # one run's lines, not two
    assert not list(tmp_path.glob(".run.*"))  # the old results went once the new run finished
