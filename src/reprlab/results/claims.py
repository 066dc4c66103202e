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
``n/a`` rather than false: "not measured" and "does not hold" are different findings. The exception is a claim
the measured keys decide alone (``a and b`` with ``a`` false, ``a or b`` with ``a`` true): it gets that verdict,
with the missing keys named in its evidence.

``requires`` (optional, the same grammar) is the claim's precondition: when it is false the claim is
``n/a`` with that reason, not "does not hold". A claim about how a model memorised noisy labels says
nothing about a model that memorised none::

      - name: shared_circuit
        requires: "{noisy_memorized} >= 0.5"
        check: "{circuit_iou} > {circuit_iou_null_unrelated} + 0.05"

Every verdict comes with its evidence as readable lines, one per comparison, each with the values it read
and whether it held (``ClaimResult.lines``), and an ``n/a`` with its reason.

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
from reprlab.jsonfile import NULL_REASON

_KEY = re.compile(r"\{([^{}]+)\}")
_NAME = re.compile(r"^[A-Za-z0-9_.\-]+$")

_BINOPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}
_CMPOPS = {
    ast.Lt: operator.lt, ast.LtE: operator.le, ast.Gt: operator.gt, ast.GtE: operator.ge,
    ast.Eq: operator.eq, ast.NotEq: operator.ne,
}  # fmt: skip
_FUNCS = {"min": min, "max": max, "abs": abs}


class _Expr:
    """One parsed claim expression (``check`` or ``requires``): its keys and its whitelisted AST."""

    def __init__(self, text: str, claim: str, field_name: str) -> None:
        keys = tuple(dict.fromkeys(_KEY.findall(text)))
        if not keys:
            raise ConfigError(f"claim {claim!r}: {field_name} {text!r} references no {{summary key}}")
        src = text
        for i, key in enumerate(keys):
            src = src.replace("{" + key + "}", f"__k{i}")
        try:
            tree = ast.parse(src, mode="eval")
        except SyntaxError as err:
            raise ConfigError(
                f"claim {claim!r}: {field_name} {text!r} is not an expression: {err.msg}"
            ) from err
        _validate(tree.body, claim, len(keys))
        self.text, self.keys, self.tree = text, keys, tree

    def missing(self, summary: Mapping[str, Any]) -> tuple[dict[str, float], list[str]]:
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
        return values, missing

    def env(self, values: Mapping[str, float]) -> dict[str, float]:
        return {f"__k{i}": values[k] for i, k in enumerate(self.keys)}


@dataclass(frozen=True)
class Claim:
    """One declared claim.

    Args:
        name: short identifier; ``summary.json`` gets ``claims.<name>``.
        text: the statement in words (say whose it is: the paper's, or our reading with our threshold).
        check: the expression over summary keys, see the module docstring.
        requires: an optional precondition in the same grammar; when false the claim is ``n/a``.
    """

    name: str
    text: str
    check: str
    requires: str | None = None
    keys: tuple[str, ...] = field(init=False)
    _check: _Expr = field(init=False, repr=False, compare=False)
    _requires: _Expr | None = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not _NAME.match(self.name):
            raise ConfigError(f"claim name {self.name!r} may hold only letters, digits, '_', '.', '-'")
        check = _Expr(self.check, self.name, "check")
        requires = _Expr(self.requires, self.name, "requires") if self.requires else None
        object.__setattr__(self, "keys", check.keys)
        object.__setattr__(self, "_check", check)
        object.__setattr__(self, "_requires", requires)

    def evaluate(self, summary: Mapping[str, Any]) -> ClaimResult:
        """Check the claim on one flat summary: its precondition first, then the check."""
        if self._requires is not None:
            values, missing = self._requires.missing(summary)
            if missing:
                return ClaimResult(
                    self,
                    None,
                    values,
                    _not_measured(missing, summary),
                    reason=_not_measured(missing, summary),
                )
            try:
                ok = bool(_eval(self._requires.tree.body, self._requires.env(values)))
            except ZeroDivisionError:
                return ClaimResult(
                    self, None, values, "division by zero", reason="precondition: division by zero"
                )
            if not ok:
                lines = _explain(self._requires.tree.body, self._requires.env(values), self._requires.keys)
                reason = "precondition not met: " + "; ".join(lines)
                return ClaimResult(self, None, values, reason, lines=tuple(lines), reason=reason)
        values, missing = self._check.missing(summary)
        if missing:
            why = _not_measured(missing, summary)
            sweep_only = any(
                k.endswith((".ci_lo", ".ci_hi")) for k in missing
            )  # a sweep's claim: n/a on one run
            decided = None if sweep_only else self._decided_without(values, missing, why)
            return decided or ClaimResult(self, None, values, why, reason=why)
        env = self._check.env(values)
        try:
            holds = bool(_eval(self._check.tree.body, env))
        except ZeroDivisionError:
            return ClaimResult(self, None, values, "division by zero", reason="division by zero")
        evidence = self.check
        for key in self.keys:
            evidence = evidence.replace("{" + key + "}", f"{key}={_fmt(values[key])}")
        lines = tuple(_explain(self._check.tree.body, env, self._check.keys))
        return ClaimResult(self, holds, values, evidence, lines=lines)

    def _decided_without(
        self, values: dict[str, float], missing: Sequence[str], why: str
    ) -> ClaimResult | None:
        """The verdict when the keys that were measured decide it whatever the missing ones are (``a and b`` with
        ``a`` false: memorisation that never reached 0.9 fails the claim, though the step it reached 0.5 at does
        not exist); ``None`` when they do not (three-valued logic)."""
        env = {f"__k{i}": values[k] for i, k in enumerate(self._check.keys) if k in values}
        verdict = _eval3(self._check.tree.body, env)
        if verdict is None:
            return None
        body = self._check.tree.body
        parts = body.values if isinstance(body, ast.BoolOp) else [body]
        lines = [x for v in parts if _eval3(v, env) is verdict for x in _explain3(v, env, self._check.keys)]
        lines.append(f"decided without the keys it could not read ({why})")
        return ClaimResult(self, verdict, values, "; ".join(lines), lines=tuple(lines))


def _eval3(node: ast.AST, env: dict[str, float]) -> Any:
    """:func:`_eval` where a key absent from ``env`` is unknown (``None``): ``and`` is false once one part is
    false, ``or`` true once one part is true; anything else that reads an unknown is unknown."""
    if isinstance(node, ast.BoolOp):
        vals = [_eval3(v, env) for v in node.values]
        decisive = isinstance(node.op, ast.Or)  # the value that decides: True for or, False for and
        if any(v is not None and bool(v) is decisive for v in vals):
            return decisive
        return None if any(v is None for v in vals) else not decisive
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
        v = _eval3(node.operand, env)
        return None if v is None else not v
    names = [n.id for n in ast.walk(node) if isinstance(n, ast.Name)]
    if any(n not in env for n in names):
        return None
    try:
        return _eval(node, env)
    except ZeroDivisionError:  # undefined: it decides nothing (the claim is n/a, "division by zero")
        return None


def _explain3(node: ast.AST, env: dict[str, float], keys: Sequence[str]) -> list[str]:
    """:func:`_explain` of the parts of ``node`` whose keys were all read."""
    try:
        return _explain(node, env, keys)
    except KeyError:
        if isinstance(node, ast.BoolOp):
            return [x for v in node.values if _eval3(v, env) is not None for x in _explain3(v, env, keys)]
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
            return ["not:", *("  " + x for x in _explain3(node.operand, env, keys))]
        return []


def _not_measured(missing: Sequence[str], summary: Mapping[str, Any]) -> str:
    """Why keys are missing: a sweep-only key, a value that is not a finite number, or not measured."""
    sweep = [k for k in missing if k.endswith((".ci_lo", ".ci_hi"))]
    if sweep and len(sweep) == len(missing):
        return "sweep only: needs the interval over seeds (`reprlab run RECIPE --seeds 0,1,2`)"
    undefined = [f"{k} ({summary[k + NULL_REASON]})" for k in missing if k + NULL_REASON in summary]
    if undefined:
        return "undefined on this run: " + ", ".join(undefined)
    if summary and all(k not in summary for k in missing):
        # a key the run never wrote: often a model, layer or analysis of the recipe's that this run did not have
        return (f"not measured: {', '.join(missing)} (not in this run's summary: the model, layer or analysis it "
                "names did not run here)")  # fmt: skip
    return f"not measured: {', '.join(missing)}"


@dataclass(frozen=True)
class ClaimResult:
    """The outcome of one claim on one summary: ``holds`` is ``None`` when it could not be evaluated.

    ``lines`` are the evidence in words (one comparison per line, with its values and ✓/✗); ``reason`` says
    why a claim is ``n/a`` (precondition not met, a sweep-only key, a key not measured).
    """

    claim: Claim
    holds: bool | None
    values: dict[str, float]
    evidence: str
    lines: tuple[str, ...] = ()
    reason: str = ""

    @property
    def verdict(self) -> str:
        return "n/a" if self.holds is None else ("holds" if self.holds else "does not hold")


def _fmt(v: float) -> str:
    return f"{v:.4g}"


_OP_TEXT = {ast.Lt: "<", ast.LtE: "≤", ast.Gt: ">", ast.GtE: "≥", ast.Eq: "=", ast.NotEq: "≠",
            ast.Add: "+", ast.Sub: "−", ast.Mult: "×", ast.Div: "/"}  # fmt: skip


def _words(node: ast.AST, env: dict[str, float], keys: Sequence[str]) -> str:
    """An operand in words: ``key (value)`` for a summary key, the expression with its keys' values."""
    if isinstance(node, ast.Name):
        return f"{keys[int(node.id[3:])]} ({_fmt(env[node.id])})"
    if isinstance(node, ast.Constant):
        return _fmt(float(node.value))
    if isinstance(node, ast.BinOp):
        return f"{_words(node.left, env, keys)} {_OP_TEXT[type(node.op)]} {_words(node.right, env, keys)}"
    if isinstance(node, ast.UnaryOp):
        inner = _words(node.operand, env, keys)
        return (
            f"−{inner}"
            if isinstance(node.op, ast.USub)
            else (f"not {inner}" if isinstance(node.op, ast.Not) else inner)
        )
    if isinstance(node, ast.Call):
        return f"{node.func.id}({', '.join(_words(a, env, keys) for a in node.args)})"
    return ast.unparse(node)


def _side(node: ast.AST, env: dict[str, float], keys: Sequence[str]) -> str:
    text = _words(node, env, keys)
    if isinstance(node, ast.Name | ast.Constant):
        return text
    return f"{text} = {_fmt(float(_eval(node, env)))}"


def _explain(node: ast.AST, env: dict[str, float], keys: Sequence[str], depth: int = 0) -> list[str]:
    """The expression as readable lines: one per comparison with ✓/✗; ``and``/``or`` of them as lists."""
    pad = "  " * depth
    if isinstance(node, ast.BoolOp):
        word = "all of" if isinstance(node.op, ast.And) else "any of"
        mark = "✓" if _eval(node, env) else "✗"
        lines = [] if depth == 0 and isinstance(node.op, ast.And) else [f"{pad}{word}: {mark}"]
        inner = depth if depth == 0 and isinstance(node.op, ast.And) else depth + 1
        for v in node.values:
            lines += _explain(v, env, keys, inner)
        return lines
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
        mark = "✓" if _eval(node, env) else "✗"
        return [f"{pad}not: {mark}"] + _explain(node.operand, env, keys, depth + 1)
    mark = "✓" if _eval(node, env) else "✗"
    if isinstance(node, ast.Compare):
        parts = [_side(node.left, env, keys)]
        for op, comp in zip(node.ops, node.comparators):
            parts += [_OP_TEXT[type(op)], _side(comp, env, keys)]
        return [f"{pad}{' '.join(parts)} {mark}"]
    return [f"{pad}{_side(node, env, keys)} {mark}"]


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
        if (
            not isinstance(item, Mapping)
            or set(item) - {"name", "text", "check", "requires"}
            or "check" not in item
        ):
            raise ConfigError(
                f"{where}: claims[{i}] must be a mapping with keys name, text, check (and optional requires); "
                f"got {item!r}"
            )
        name = str(item.get("name") or f"claim{i}")
        if name in seen:
            raise ConfigError(f"{where}: claim name {name!r} is used twice")
        seen.add(name)
        try:
            req = item.get("requires")
            out.append(Claim(name=name, text=str(item.get("text", "")), check=str(item["check"]),
                             requires=str(req) if req else None))  # fmt: skip
        except ConfigError as err:
            raise ConfigError(f"{where}: {err}") from err
    return tuple(out)


def evaluate_claims(claims: Sequence[Claim], summary: Mapping[str, Any]) -> list[ClaimResult]:
    return [c.evaluate(summary) for c in claims]


def claim_summary_keys(results: Sequence[ClaimResult], prefix: str = "claims.") -> dict[str, int]:
    """``{"claims.<name>": 1 | 0}`` for every evaluated claim (``n/a`` claims get no key)."""
    return {f"{prefix}{r.claim.name}": int(r.holds) for r in results if r.holds is not None}


def claims_table(
    results: Sequence[ClaimResult], seed_share: Mapping[str, Mapping[str, Any]] | None = None
) -> list[dict]:
    """Rows of ``claims.json``: name, statement, verdict, evidence (as one string and as ``lines``), the
    reason of an ``n/a`` and the precondition. With ``seed_share`` (sweeps: ``{name: {"mean", "ci_lo",
    "ci_hi", "n", "ci_method"}}``) the share of seeds on which each claim holds, with its interval."""
    rows = []
    for r in results:
        row: dict[str, Any] = {"claim": r.claim.name, "statement": r.claim.text, "verdict": r.verdict,
                               "evidence": r.evidence, "lines": list(r.lines), "reason": r.reason}  # fmt: skip
        if r.claim.requires:
            row["requires"] = r.claim.requires
        if seed_share is not None:
            info = seed_share.get(r.claim.name)
            row["holds on seeds"] = None if info is None else {k: info.get(k) for k in
                                                               ("mean", "ci_lo", "ci_hi", "n", "ci_method")}  # fmt: skip
        rows.append(row)
    return rows


def record_claims(run_dir: Path, claims: Sequence[Claim], summary: Mapping[str, Any]) -> dict[str, int]:
    """Evaluate ``claims`` on ``summary``, write ``claims.json`` into ``run_dir``; returns the summary keys."""
    from reprlab.runs.atomic import atomic_write_json

    results = evaluate_claims(claims, summary)
    atomic_write_json(Path(run_dir) / "claims.json", {"claims": claims_table(results)})
    return claim_summary_keys(results)
