"""The import graph of ``src/reprlab`` has no circle, and no OTCCLIP module outgrows a reader's screenful.

The graph is read from the source (``ast``), not from ``sys.modules``: every ``import`` and ``from ... import``
statement counts wherever it stands (module level, inside a function, under ``if TYPE_CHECKING:``), because a
function-local import or a typing-only import hides a circle without removing it. Relative imports are
resolved against the importing module's package. ``from package import name`` is an edge to
``package.name`` when that is a module of the tree, else to ``package`` (its ``__init__``). Importing a
module does not add edges to its parent packages (they run first, but they do not depend on it).
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = "reprlab"
OTCCLIP = SRC / PACKAGE / "methods" / "otcclip"

# [ours] 400 lines is about what a reader takes in at one sitting: a module over it has, in this package's
# history, always mixed concerns (the recipe and the stream each held orchestration, data, evaluation and
# reporting at ~750 lines). A module that needs more is a sign to split it by concern, not to raise this.
MAX_LINES = 400


def module_name(path: Path, root: Path = SRC) -> str:
    """Dotted module name of ``path`` under ``root`` (``pkg/__init__.py`` is ``pkg``)."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules(root: Path = SRC, package: str = PACKAGE) -> dict[str, Path]:
    """Every module of ``package`` under ``root``: dotted name -> file."""
    return {module_name(p, root): p for p in sorted((root / package).rglob("*.py"))}


def imports_of(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The modules of ``known`` that the module ``name`` (file ``path``) imports anywhere in its source."""
    is_package = path.name == "__init__.py"
    package = name if is_package else name.rpartition(".")[0]
    out: set[str] = set()

    def add(target: str) -> None:
        # ``import a.b.c`` of a name that is not a module (rare): keep the longest prefix that is one
        while target and target not in known:
            target = target.rpartition(".")[0]
        if target and target != name:
            out.add(target)

    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: level 1 = this package, 2 = its parent, ...
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                source = ".".join([*base, node.module] if node.module else base)
            else:
                source = node.module or ""
            for alias in node.names:
                sub = f"{source}.{alias.name}"
                add(sub if sub in known else source)
    return out


def import_graph(root: Path = SRC, package: str = PACKAGE) -> dict[str, set[str]]:
    known = modules(root, package)
    return {name: imports_of(name, path, known) for name, path in known.items()}


def strongly_connected(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of ``graph`` with more than one module (Tarjan): each holds circles."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while not comp or w != v:
                w = stack.pop()
                comp.add(w)
            if len(comp) > 1:
                out.append(comp)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def find_cycle(graph: dict[str, set[str]], within: set[str] | None = None) -> list[str] | None:
    """One circle ``[a, b, ..., a]`` of ``graph`` (restricted to the modules ``within``), or ``None``."""
    nodes = set(graph) if within is None else within
    for start in sorted(nodes):
        path, seen = [start], {start}
        stack = [iter(sorted(graph[start] & nodes))]
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                stack.pop()
                path.pop()
            elif nxt == start:
                return [*path, start]
            elif nxt not in seen:
                seen.add(nxt)
                path.append(nxt)
                stack.append(iter(sorted(graph[nxt] & nodes)))
    return None


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One concrete circle per strongly connected component of ``graph``."""
    return [find_cycle(graph, comp) for comp in strongly_connected(graph)]


def test_reader_finds_circles_it_is_shown(tmp_path):
    """The reader itself: a planted circle through a relative, a function-local and a typing-only import is
    found, and removing one edge removes it (so the real test below can fail)."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from .b import B\n")
    (pkg / "a.py").write_text("def f():\n    from pkg.sub import B\n")  # -> pkg.sub (the name B is no module)
    (pkg / "sub" / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .. import a\nclass B: ...\n"
    )
    graph = import_graph(tmp_path, "pkg")
    assert (
        graph["pkg.a"] == {"pkg.sub"}
        and graph["pkg.sub"] == {"pkg.sub.b"}
        and graph["pkg.sub.b"] == {"pkg.a"}
    )
    assert circles(graph) == [["pkg.a", "pkg.sub", "pkg.sub.b", "pkg.a"]]
    (pkg / "sub" / "b.py").write_text("class B: ...\n")
    assert circles(import_graph(tmp_path, "pkg")) == []


def test_no_import_circle():
    graph = import_graph()
    assert len(graph) > 50, f"found only {len(graph)} modules under {SRC / PACKAGE}"
    found = circles(graph)
    assert not found, "import circles:\n" + "\n".join(" -> ".join(c) for c in found)


def test_otcclip_subpackages_form_layers():
    """OTCCLIP's parts (``config``, ``data``, ``models``, ``defenses``, ``training``, ``evaluation``, ``pipeline``,
    the entry modules) import each other without a circle: each part imports only parts below it, so a
    newcomer can read the package bottom-up (``reprlab.methods.otcclip``'s docstring lists the order)."""
    prefix = f"{PACKAGE}.methods.otcclip."

    def part(module: str) -> str:
        return module[len(prefix) :].split(".")[0]

    parts: dict[str, set[str]] = {}
    for module, targets in import_graph().items():
        if module.startswith(prefix):
            parts.setdefault(part(module), set()).update(
                part(t) for t in targets if t.startswith(prefix) and part(t) != part(module)
            )
    assert {"config", "data", "models", "defenses", "training", "evaluation", "pipeline"} <= set(parts)
    found = circles(parts)
    assert not found, "circles between otcclip's sub-packages:\n" + "\n".join(" -> ".join(c) for c in found)


def test_no_otcclip_module_over_max_lines():
    sizes = {
        p.relative_to(SRC).as_posix(): len(p.read_text(encoding="utf-8").splitlines())
        for p in OTCCLIP.rglob("*.py")
    }
    assert sizes, f"no modules under {OTCCLIP}"
    over = {p: n for p, n in sorted(sizes.items()) if n > MAX_LINES}
    assert not over, f"modules over {MAX_LINES} lines (split them by concern): {over}"
