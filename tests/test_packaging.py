"""The built wheel's metadata: dependency ranges that keep a user's torch, and every import declared.

The wheel is built from this checkout (``pip wheel --no-deps --no-build-isolation``: offline, a few seconds)
and its ``METADATA`` read back, so the test checks what ``pip install reprlab`` would see, not pyproject.toml.
"""

from __future__ import annotations

import ast
import functools
import re
import shutil
import subprocess
import sys
import zipfile
from email.parser import Parser
from importlib.metadata import packages_distributions
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "reprlab"
# import names of extras that are not installed in the test venv, so packages_distributions() cannot map them
NOT_INSTALLED = {"open_clip": "open-clip-torch"}


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


@pytest.fixture(scope="module")
def metadata(tmp_path_factory):
    out = tmp_path_factory.mktemp("wheel")
    src = (
        out / "src-copy"
    )  # setuptools writes build/ and *.egg-info beside the sources: keep them out of the checkout
    shutil.copytree(ROOT / "src", src / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                           "-w", str(out), str(src)], capture_output=True, text=True)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    (wheel,) = out.glob("reprlab-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        name = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        files = zf.namelist()
        meta = Parser().parsestr(zf.read(name).decode())
    return meta, files


def _requirements(meta) -> tuple[dict[str, Requirement], dict[str, set[str]]]:
    """``(core, extras)``: core requirements by distribution, and the extras each distribution is in."""
    core, extras = {}, {}
    for line in meta.get_all("Requires-Dist") or []:
        req = Requirement(line)
        marker = str(req.marker) if req.marker else ""
        m = re.search(r'extra == "([^"]+)"', marker)
        if m:
            extras.setdefault(_norm(req.name), set()).add(m.group(1))
        else:
            core[_norm(req.name)] = req
    return core, extras


@functools.cache
def _imports() -> list[tuple[str, str, bool]]:
    """``(top-level module, file:line, lazy)`` for every absolute third-party import in ``src/reprlab``.

    Lazy = inside a function body: it runs only when that feature is used, so an extra may provide it.
    """
    std = set(sys.stdlib_module_names)
    out = []
    for path in sorted(SRC.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        lazy_lines = set()
        for fn in ast.walk(tree):
            if isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
                lazy_lines |= {id(n) for n in ast.walk(fn)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top not in std and top not in ("reprlab", "__future__"):
                    out.append((top, f"{path.relative_to(ROOT)}:{node.lineno}", id(node) in lazy_lines))
    return out


def test_wheel_has_no_exact_torch_pin(metadata):
    meta, _ = metadata
    core, _ = _requirements(meta)
    assert "torch" in core
    spec = core["torch"].specifier
    assert not any(s.operator in ("==", "===") for s in spec), f"torch is pinned in the wheel: {spec}"
    # a range that holds the version this repository is tested with and the CUDA builds of other 2.x releases
    assert spec.contains("2.13.0") and spec.contains("2.13.0+cu128") and spec.contains("2.9.1")
    assert "gguf" not in core  # only GGUF checkpoints need it: the gguf extra
    assert "transformers" in core and not core["transformers"].specifier.contains("6.0.0")


def test_every_third_party_import_is_a_declared_dependency(metadata):
    """Module-level imports need a core dependency; imports inside functions a core or extra one."""
    meta, _ = metadata
    core, extras = _requirements(meta)
    dists = packages_distributions()
    problems = []
    for module, where, lazy in _imports():
        names = [_norm(d) for d in dists.get(module, [])] or [_norm(NOT_INSTALLED.get(module, ""))]
        if not any(names):
            problems.append(
                f"{where}: import {module} maps to no installed distribution (add it to NOT_INSTALLED)"
            )
        elif any(n in core for n in names):
            continue
        elif lazy and any(n in extras for n in names):
            continue
        else:
            need = "a core dependency" if not lazy else "a core or extra dependency"
            problems.append(f"{where}: import {module} ({', '.join(names)}) is not {need}")
    assert not problems, "\n".join(problems)


def test_the_import_scan_sees_lazy_and_module_level_imports():
    """The scan itself: a known module-level import and a known lazy one are classified as such."""
    seen = {(m, w.split(":")[0], lazy) for m, w, lazy in _imports()}
    assert ("safetensors", "src/reprlab/runs/checkpoint.py", False) in seen
    assert ("gensim", "src/reprlab/methods/norm_ic/static.py", True) in seen


def test_wheel_ships_recipes_and_constraints_stay_out(metadata):
    _, files = metadata
    assert any(f.endswith("methods/crl_safety/recipes/crl-tiny.yaml") for f in files)
    assert not any(f.startswith("constraints/") for f in files)


def test_constraints_pin_the_tested_torch():
    """The repository's install pins torch exactly, in the constraints file the Makefile passes with -c."""
    lines = [ln.strip() for ln in (ROOT / "constraints" / "cpu.txt").read_text().splitlines()]
    pins = dict(ln.split("==", 1) for ln in lines if ln and not ln.startswith("#"))
    assert pins["torch"] == "2.13.0"
    make = (ROOT / "Makefile").read_text()
    assert "CONSTRAINTS ?= constraints/cpu.txt" in make and "-c $(CONSTRAINTS)" in make
    stamp = next(ln for ln in make.splitlines() if ln.startswith("STAMP :="))
    assert "$(CONSTRAINTS)" in stamp  # a changed constraints file reinstalls


def test_a_gguf_model_without_gguf_names_the_extra(monkeypatch):
    import importlib.util

    from reprlab.errors import ModelNotAvailableError
    from reprlab.models import hf

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else real(name, *a)
    )
    with pytest.raises(ModelNotAvailableError, match="GGUF") as err:
        hf.load_causal_lm("smollm2-135m-instruct")
    assert "reprlab[gguf]" in err.value.hint
