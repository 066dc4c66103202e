"""Claims as data: the statements a recipe exists to test, checked against its flat ``summary.json``.

A recipe declares claims in its YAML (or its entry module's ``CLAIMS`` list)::

    claims:
      - name: undefended_attacked
        text: "Without a defense the targeted attack succeeds (ASR >= 0.5)."
        check: "{none.asr_targeted} >= 0.5"
      - name: otcclip_accuracy
        text: "OTCCLIP's zero-shot accuracy reaches the best other defense's."
        check: "{otcclip.zero_shot} >= max({roclip.zero_shot}, {safeclip.zero_shot}) - 0.01"

``check`` is a small expression: ``{summary key}`` references, numbers, ``+ - * /``, comparisons,
``and/or/not``, and the functions ``min``, ``max``, ``abs``. It is parsed with :mod:`ast` against a whitelist,
never ``eval``-ed, so a recipe file cannot run code. A claim whose keys are missing (or not numbers) is
``n/a`` rather than false: "not measured" and "does not hold" are different findings.

In a sweep the aggregate summary has ``K``, ``K.ci_lo``, ``K.ci_hi``...; a claim may reference those, e.g.
``"{otcclip.zero_shot.ci_hi} >= {safeclip.zero_shot}"`` ("within the CI"), and is ``n/a`` on a single run.
"""

from __future__ import annotations

import ast
import math
import operator
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from reprlab.errors import ConfigError

_KEY = re.compile(r"\{([^{}]+)\}")
_NAME = re.compile(r"^[A-Za-z0-9_.\-]+$")

_BINOPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}
_CMPOPS = {
    ast.Lt: operator.lt, ast.LtE: operator.le, ast.Gt: operator.gt, ast.GtE: operator.ge,
    ast.Eq: operator.eq, ast.NotEq: operator.ne,
}  # fmt: skip
_FUNCS = {"min": min, "max": max, "abs": abs}


@dataclass(frozen=True)
class Claim:
    """One declared claim.

    Args:
        name: short identifier; ``summary.json`` gets ``claims.<name>``.
        text: the statement in words (say whose it is: the paper's, or our reading of it).
        check: the expression over summary keys, see the module docstring.
    """

    name: str
    text: str
    check: str
    keys: tuple[str, ...] = field(init=False)
    _tree: ast.Expression = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not _NAME.match(self.name):
            raise ConfigError(f"claim name {self.name!r} may hold only letters, digits, '_', '.', '-'")
        keys = tuple(dict.fromkeys(_KEY.findall(self.check)))
        if not keys:
            raise ConfigError(f"claim {self.name!r}: check {self.check!r} references no {{summary key}}")
        src = self.check
        for i, key in enumerate(keys):
            src = src.replace("{" + key + "}", f"__k{i}")
        try:
            tree = ast.parse(src, mode="eval")
        except SyntaxError as err:
            raise ConfigError(
                f"claim {self.name!r}: check {self.check!r} is not an expression: {err.msg}"
            ) from err
        _validate(tree.body, self.name, len(keys))
        object.__setattr__(self, "keys", keys)
        object.__setattr__(self, "_tree", tree)

    def evaluate(self, summary: Mapping[str, Any]) -> ClaimResult:
        """Check the claim on one flat summary."""
        values: dict[str, float] = {}
        missing = []
        for key in self.keys:
            v = summary.get(key)
            if (
                isinstance(v, bool)
                or not isinstance(v, int | float)
                or (isinstance(v, float) and math.isnan(v))
            ):
                missing.append(key)
            else:
                values[key] = float(v)
        if missing:
            return ClaimResult(self, None, values, f"not measured: {', '.join(missing)}")
        env = {f"__k{i}": values[k] for i, k in enumerate(self.keys)}
        try:
            holds = bool(_eval(self._tree.body, env))
        except ZeroDivisionError:
            return ClaimResult(self, None, values, "division by zero")
        evidence = self.check
        for key in self.keys:
            evidence = evidence.replace("{" + key + "}", f"{key}={_fmt(values[key])}")
        return ClaimResult(self, holds, values, evidence)


@dataclass(frozen=True)
class ClaimResult:
    """The outcome of one claim on one summary: ``holds`` is ``None`` when it could not be evaluated."""

    claim: Claim
    holds: bool | None
    values: dict[str, float]
    evidence: str

    @property
    def verdict(self) -> str:
        return "n/a" if self.holds is None else ("holds" if self.holds else "does not hold")


def _fmt(v: float) -> str:
    return f"{v:.4g}"


def _validate(node: ast.AST, name: str, n_keys: int) -> None:
    ok = (
        isinstance(node, ast.Constant)
        and isinstance(node.value, int | float)
        and not isinstance(node.value, bool)
    ) or (isinstance(node, ast.Name) and re.fullmatch(r"__k\d+", node.id) and int(node.id[3:]) < n_keys)
    if ok:
        return
    if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        _validate(node.left, name, n_keys)
        _validate(node.right, name, n_keys)
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd | ast.Not):
        _validate(node.operand, name, n_keys)
    elif isinstance(node, ast.BoolOp):
        for v in node.values:
            _validate(v, name, n_keys)
    elif isinstance(node, ast.Compare) and all(type(op) in _CMPOPS for op in node.ops):
        for v in (node.left, *node.comparators):
            _validate(v, name, n_keys)
    elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _FUNCS:
        if node.keywords or not node.args:
            raise ConfigError(f"claim {name!r}: {node.func.id}() takes positional arguments only")
        for a in node.args:
            _validate(a, name, n_keys)
    else:
        raise ConfigError(
            f"claim {name!r}: {ast.unparse(node)!r} is not allowed; use {{keys}}, numbers, + - * /, comparisons, "
            "and/or/not, min/max/abs"
        )


def _eval(node: ast.AST, env: dict[str, float]) -> Any:
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.Name):
        return env[node.id]
    if isinstance(node, ast.BinOp):
        return _BINOPS[type(node.op)](_eval(node.left, env), _eval(node.right, env))
    if isinstance(node, ast.UnaryOp):
        v = _eval(node.operand, env)
        return -v if isinstance(node.op, ast.USub) else (+v if isinstance(node.op, ast.UAdd) else not v)
    if isinstance(node, ast.BoolOp):
        vals = [_eval(v, env) for v in node.values]
        return all(vals) if isinstance(node.op, ast.And) else any(vals)
    if isinstance(node, ast.Compare):
        left = _eval(node.left, env)
        for op, comp in zip(node.ops, node.comparators):
            right = _eval(comp, env)
            if not _CMPOPS[type(op)](left, right):
                return False
            left = right
        return True
    if isinstance(node, ast.Call):
        return _FUNCS[node.func.id](*[_eval(a, env) for a in node.args])
    raise AssertionError(f"unvalidated node {ast.dump(node)}")  # _validate admits nothing else


def parse_claims(raw: Sequence[Mapping[str, Any]] | None, where: str) -> tuple[Claim, ...]:
    """Claims from a recipe's ``claims:`` list; errors name ``where`` (the recipe file)."""
    if raw is None:
        return ()
    if not isinstance(raw, list | tuple):
        raise ConfigError(f"{where}: 'claims' must be a list of {{name, text, check}} mappings")
    out, seen = [], set()
    for i, item in enumerate(raw):
        if not isinstance(item, Mapping) or set(item) - {"name", "text", "check"} or "check" not in item:
            raise ConfigError(
                f"{where}: claims[{i}] must be a mapping with keys name, text, check; got {item!r}"
            )
        name = str(item.get("name") or f"claim{i}")
        if name in seen:
            raise ConfigError(f"{where}: claim name {name!r} is used twice")
        seen.add(name)
        try:
            out.append(Claim(name=name, text=str(item.get("text", "")), check=str(item["check"])))
        except ConfigError as err:
            raise ConfigError(f"{where}: {err}") from err
    return tuple(out)


def evaluate_claims(claims: Sequence[Claim], summary: Mapping[str, Any]) -> list[ClaimResult]:
    return [c.evaluate(summary) for c in claims]


def claim_summary_keys(results: Sequence[ClaimResult], prefix: str = "claims.") -> dict[str, int]:
    """``{"claims.<name>": 1 | 0}`` for every evaluated claim (``n/a`` claims get no key)."""
    return {f"{prefix}{r.claim.name}": int(r.holds) for r in results if r.holds is not None}


def claims_table(
    results: Sequence[ClaimResult], seed_fraction: Mapping[str, float] | None = None
) -> list[dict]:
    """Rows for a report table; with ``seed_fraction`` (sweeps) a column of the share of seeds where it holds."""
    rows = []
    for r in results:
        row = {"claim": r.claim.name, "statement": r.claim.text, "verdict": r.verdict, "evidence": r.evidence}
        if seed_fraction is not None:
            frac = seed_fraction.get(r.claim.name)
            row["holds on seeds"] = "n/a" if frac is None else f"{frac:.2f}"
        rows.append(row)
    return rows


def record_claims(run_dir: Path, claims: Sequence[Claim], summary: Mapping[str, Any]) -> dict[str, int]:
    """Evaluate ``claims`` on ``summary``, write ``claims.json`` into ``run_dir``; returns the summary keys."""
    from reprlab.runs.atomic import atomic_write_json

    results = evaluate_claims(claims, summary)
    atomic_write_json(Path(run_dir) / "claims.json", {"claims": claims_table(results)})
    return claim_summary_keys(results)
