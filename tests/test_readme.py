"""The README's commands and links work: a reader who copies a line gets a command that exists, a recipe that
exists, options the command takes and override keys the recipe's config has; every relative link in the README
and in docs/ points at a file that exists (and, for a ``#anchor`` into a markdown file, at one of its headings).
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
from typer.testing import CliRunner

from reprlab.cli import app
from reprlab.recipes import all_recipes, get_recipe

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")


def _code_blocks(text: str) -> list[str]:
    """Shell code blocks (fence language empty, bash or sh), paired fence by fence."""
    blocks, lang, lines = [], None, []
    for line in text.splitlines():
        if line.startswith("```"):
            if lang is None:
                lang, lines = line[3:].strip(), []
            else:
                if lang in ("", "bash", "sh"):
                    blocks.append("\n".join(lines) + "\n")
                lang = None
        elif lang is not None:
            lines.append(line)
    return blocks


def _commands(text: str) -> list[list[str]]:
    """Shell lines of the README's code blocks, comments stripped, as argument lists."""
    out = []
    for block in _code_blocks(text):
        for line in block.splitlines():
            line = re.sub(r"\s+#.*$", "", line).strip()
            if line and not line.startswith("#"):
                out.append(shlex.split(line))
    return out


def _reprlab_argv(argv: list[str]) -> list[str] | None:
    """The arguments after ``reprlab`` (also under ``torchrun ... -m reprlab.cli``); None for other tools."""
    if argv[0] == "reprlab":
        return argv[1:]
    if argv[0] == "torchrun" and "reprlab.cli" in argv:
        return argv[argv.index("reprlab.cli") + 1 :]
    return None


def _anchor(heading: str) -> str:
    # GitHub's slug: lower case, punctuation dropped, spaces to hyphens
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_readme_is_short():
    assert len(README.read_text(encoding="utf-8").splitlines()) <= 200


def test_quick_start_make_targets_exist():
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    targets = set(re.findall(r"^([A-Za-z][\w-]*):", makefile, flags=re.M))
    used = [argv[1] for argv in _commands(README.read_text(encoding="utf-8")) if argv[0] == "make"]
    assert {"demo", "test"} <= set(used), used
    assert set(used) <= targets, set(used) - targets


def test_readme_reprlab_commands_resolve():
    runner = CliRunner()
    recipes = all_recipes()
    checked = 0
    for argv in _commands(README.read_text(encoding="utf-8")):
        args = _reprlab_argv(argv)
        if args is None:
            continue
        command = args[0]
        result = runner.invoke(app, [command, "--help"])
        assert result.exit_code == 0, f"`reprlab {command}` does not exist: {result.output}"
        for opt in (a.split("=")[0] for a in args[1:] if a.startswith("--")):
            assert opt in result.output, f"`reprlab {command}` has no option {opt}"
        if command in ("run", "config"):
            name = args[1]
            assert name in recipes, f"README names recipe {name!r}, which does not exist"
            overrides = [a for a in args[2:] if "=" in a and not a.startswith("-")]
            get_recipe(name).build_config(overrides)  # unknown keys and bad values raise ConfigError
        checked += 1
    assert checked >= 5, "the README's command blocks were not found"


def _markdown_files() -> list[Path]:
    return [README, ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md"))]


@pytest.mark.parametrize("path", _markdown_files(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_resolve(path: Path):
    text = path.read_text(encoding="utf-8")
    text = re.sub(r"```.*?```", "", text, flags=re.S)  # links inside code are not links
    bad = []
    for m in LINK.finditer(text):
        target = m.group(1) or m.group(2)
        if re.match(r"^[a-z]+:", target) or target.startswith("#") and path != README:
            continue
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        if not dest.exists():
            bad.append(f"{target} (no such file)")
            continue
        if anchor and dest.suffix == ".md":
            headings = re.findall(r"^#+ (.+)$", dest.read_text(encoding="utf-8"), flags=re.M)
            if anchor not in {_anchor(h) for h in headings}:
                bad.append(f"{target} (no heading with that anchor)")
    assert not bad, f"{path.relative_to(ROOT)}: " + "; ".join(bad)


def test_citation_file_lists_the_four_papers():
    import yaml

    cff = yaml.safe_load((ROOT / "CITATION.cff").read_text(encoding="utf-8"))
    urls = {r["url"] for r in cff["references"]}
    for anthology_id in (
        "2025.emnlp-main.497",
        "2025.emnlp-main.437",
        "2025.emnlp-main.1430",
        "2025.findings-emnlp.734",
    ):
        assert any(anthology_id in u for u in urls), anthology_id
        assert anthology_id in README.read_text(encoding="utf-8"), anthology_id


@pytest.mark.parametrize("path", _markdown_files()[1:], ids=lambda p: p.relative_to(ROOT).as_posix())
def test_docs_commands_name_existing_commands_and_recipes(path: Path):
    """Every ``reprlab ...`` line in a docs code block names a command that exists and, for run/config, a recipe
    that exists (a renamed recipe or command fails here instead of in a reader's terminal)."""
    recipes = all_recipes()
    commands = {c.name for c in app.registered_commands} | {g.name for g in app.registered_groups}
    bad = []
    for block in _code_blocks(path.read_text(encoding="utf-8")):
        lines = [re.sub(r"\s+#.*$", "", x).strip() for x in block.splitlines()]
        argvs = [x.split() for x in lines if x.startswith(("reprlab ", "torchrun "))]  # shell lines only
        for argv in argvs:
            args = _reprlab_argv(argv)
            if not args or args[0].startswith("-"):
                continue
            if args[0] not in commands:
                bad.append(f"reprlab {args[0]} (no such command)")
            elif args[0] in ("run", "config") and len(args) > 1 and args[1] not in recipes:
                bad.append(f"reprlab {args[0]} {args[1]} (no such recipe)")
    assert not bad, bad


_INLINE_RUN = re.compile(r"`((?:reprlab|torchrun) [^`]*reprlab[^`]*|reprlab (?:run|config) [^`]+)`")


def _override_keys(args: list[str]) -> list[str]:
    """The dotted keys of a run/config line's ``key=value`` overrides (``--launcher-opt`` values are submitit's;
    a ``[key=value]`` is an optional override written in brackets)."""
    keys, skip = [], False
    for a in args:
        if skip:
            skip = False
        elif a in ("--launcher-opt", "--out", "-o", "--seeds", "--track", "--resume-from"):
            skip = True
        elif "=" in a and not a.startswith("-"):
            keys.append(a.strip("\"'[").split("=", 1)[0])
    return keys


def _has_key(tree: dict, key: str) -> bool:
    for part in key.split("."):
        if not isinstance(tree, dict) or part not in tree:
            return False
        tree = tree[part]
    return True


@pytest.mark.parametrize("path", _markdown_files()[1:], ids=lambda p: p.relative_to(ROOT).as_posix())
def test_docs_override_keys_exist(path: Path):
    """The override keys of every ``reprlab run``/``config`` line in docs, in code blocks and inline, are keys of
    the recipe's config: a renamed option fails here instead of in a reader's terminal. Values are not checked
    (the docs write placeholders: seed=S, DIR)."""
    from reprlab.config import config_to_dict

    text = path.read_text(encoding="utf-8")
    lines = [x for b in _code_blocks(text) for x in b.replace("\\\n", " ").splitlines()]
    lines += [m.group(1) for m in _INLINE_RUN.finditer(text.replace("\n", " "))]
    recipes, trees, bad = all_recipes(), {}, []
    for line in lines:
        line = re.sub(r"\s+#.*$", "", line).strip()
        try:
            argv = shlex.split(line)
        except ValueError:  # an apostrophe in prose after the command
            argv = line.split()
        args = _reprlab_argv(argv) if argv else None
        if not args or args[0] not in ("run", "config") or len(args) < 2 or args[1] not in recipes:
            continue
        if args[1] not in trees:
            trees[args[1]] = config_to_dict(get_recipe(args[1]).build_config([]))
        bad += [f"{args[1]}: {k}" for k in _override_keys(args[2:]) if not _has_key(trees[args[1]], k)]
    assert not bad, bad
