"""Capability checks: an offline multiple-choice check [ours] and lm-evaluation-harness by task name.

The paper reports that CRL keeps "standard performance", measured with lm-evaluation-harness (task list [unknown]).

- **Offline multiple choice** [ours] (:func:`mc_accuracy`): 40 hand-written easy general-knowledge questions with four
  choices each (``data/capability_mc.jsonl``, MIT), or a user's JSONL of ``{"question", "choices", "answer"}``.
  Scored as lm-evaluation-harness scores multiple choice: the context ``"Question: {q}\\nAnswer:"``, each choice as
  the continuation ``" {choice}"``; ``acc`` takes the highest summed log-likelihood, ``acc_norm`` the highest
  log-likelihood per character of the choice (lm_eval's ``acc_norm``). Chance is 0.25 on the packaged set.
- **lm-evaluation-harness** (:func:`lm_eval_tasks`, extra ``lmeval``): any task names (``hellaswag``, ``arc_easy``,
  ``mmlu``...) evaluated through lm_eval's ``HFLM`` wrapper on the in-memory model (adapters active), so no copy is
  saved or reloaded. Those tasks download their data from the hub; ``include_path`` adds local task YAMLs (which can
  read local files, as the offline test does).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from reprlab.errors import ConfigError, DataError

MC_FILE = Path(__file__).parent / "data" / "capability_mc.jsonl"


def load_mc(path: str | Path = "") -> list[dict]:
    """Multiple-choice items ``{"question": str, "choices": [str, ...], "answer": int}`` (the packaged set by default).

    Raises:
        DataError: a missing file, a line that is not such an object (the message names file and line).
    """
    path = Path(path) if path else MC_FILE
    if not path.exists():
        raise DataError(f"multiple-choice file {path} does not exist")
    items = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}:{n}"
        try:
            d = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{where}: not JSON ({e.msg})") from None
        q, c, a = (d.get(k) if isinstance(d, dict) else None for k in ("question", "choices", "answer"))
        if not (isinstance(q, str) and q.strip()):
            raise DataError(f'{where}: "question" must be a non-empty string')
        if not (isinstance(c, list) and len(c) >= 2 and all(isinstance(x, str) and x for x in c)):
            raise DataError(f'{where}: "choices" must be a list of at least 2 non-empty strings')
        if isinstance(a, bool) or not isinstance(a, int) or not 0 <= a < len(c):
            raise DataError(f'{where}: "answer" must be the index of the right choice (0..{len(c) - 1})')
        items.append({"question": q, "choices": c, "answer": a})
    if not items:
        raise DataError(f"multiple-choice file {path} holds no items")
    return items


def _encode(tok, text: str) -> list[int]:
    return list(tok.encode(text, add_special_tokens=False))


def _pair(tok, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-evaluation-harness's split: encode context and context + continuation, the continuation being the tail."""
    whole, ctx = _encode(tok, context + continuation), _encode(tok, context)
    return ctx, whole[len(ctx) :]


@torch.no_grad()
def choice_loglik(model, tok, pairs: list[tuple[list[int], list[int]]], batch_size: int = 16) -> list[float]:
    """Summed log-likelihood of each continuation given its context (left-padded batches, mask-derived positions)."""
    from reprlab.methods.crl_safety.chat import collate, forward, response_logits

    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    dev = next(model.parameters()).device
    out: list[float] = []
    for s in range(0, len(pairs), batch_size):
        b = collate(pairs[s : s + batch_size], pad).to(dev)
        logits = forward(model, b.attention_mask, input_ids=b.input_ids, hidden=False,
                         logits_last=b.n_response + 1).logits  # fmt: skip
        lg, tg, m = response_logits(logits, b)
        lp = torch.log_softmax(lg.float(), -1).gather(-1, tg.unsqueeze(-1)).squeeze(-1)
        out += (lp * m).sum(-1).tolist()
    return out


@torch.inference_mode()
def shared_context_loglik(model, tok, pairs: list[tuple[list[int], list[int]]]) -> list[float]:
    """:func:`choice_loglik` with each distinct context run once: the context's KV cache serves all its choices.

    The pairs of one question share their context ids (lm-evaluation-harness's split encodes the context alone), so
    the context is prefilled once, unpadded, and its choices are scored together on copies of its cache, right-padded
    (a causal model's logits at a position never see later positions). The first continuation token is predicted by
    the context's last logits. Equal to :func:`choice_loglik` up to float32 summation order (tested), at a third of
    its tokens on the packaged questions (2,752 padded tokens -> ~750).
    """
    import copy

    from reprlab.methods.crl_safety.chat import _cache_kw

    dev = next(model.parameters()).device
    kw = _cache_kw(model)
    out: list[float] = [0.0] * len(pairs)
    groups: dict[tuple, list[int]] = {}
    for i, (ctx, _) in enumerate(pairs):
        groups.setdefault(tuple(ctx), []).append(i)
    for ctx, idx in groups.items():
        first = model(input_ids=torch.tensor([list(ctx)], device=dev), use_cache=True, logits_to_keep=1)
        cache = getattr(first, "cache", None) or first.past_key_values
        conts = [pairs[i][1] for i in idx]
        width = max(len(c) for c in conts)
        lp0 = torch.log_softmax(first.logits[0, -1].float(), -1)
        if width > 1:  # tokens 2.. of each continuation, predicted from the continuation's own positions
            ids = torch.tensor([c + [c[-1]] * (width - len(c)) for c in conts], device=dev)  # right padding
            kv = copy.deepcopy(cache)
            kv.batch_repeat_interleave(len(conts))
            pos = torch.arange(len(ctx), len(ctx) + width - 1, device=dev).expand(len(conts), -1)
            mask = torch.ones(len(conts), len(ctx) + width - 1, dtype=torch.long, device=dev)
            lp = torch.log_softmax(model(input_ids=ids[:, :-1], attention_mask=mask, position_ids=pos, use_cache=True,
                                         **{kw: kv}).logits.float(), -1)  # fmt: skip
        for j, (i, c) in enumerate(zip(idx, conts)):
            out[i] = float(lp0[c[0]] + sum(lp[j, t - 1, c[t]] for t in range(1, len(c)))) if c else 0.0
    return out


def mc_accuracy(model, tok, items: list[dict]) -> dict[str, float]:
    """``acc`` / ``acc_norm`` (per character) of ``model`` on multiple-choice ``items``, lm-evaluation-harness style
    (each question's context run once for its choices: :func:`shared_context_loglik`)."""
    was_training = model.training
    model.eval()
    pairs, owner = [], []
    for i, it in enumerate(items):
        ctx = f"Question: {it['question']}\nAnswer:"
        for c in it["choices"]:
            pairs.append(_pair(tok, ctx, f" {c}"))
            owner.append(i)
    ll = shared_context_loglik(model, tok, pairs)
    acc = acc_norm = 0
    at = 0
    for it in items:
        k = len(it["choices"])
        scores = ll[at : at + k]
        norm = [s / len(c) for s, c in zip(scores, it["choices"])]  # lm_eval: per character of the choice
        acc += max(range(k), key=scores.__getitem__) == it["answer"]
        acc_norm += max(range(k), key=norm.__getitem__) == it["answer"]
        at += k
    model.train(was_training)
    n = len(items)
    return {"acc": acc / n, "acc_norm": acc_norm / n, "n": n,
            "chance": sum(1 / len(it["choices"]) for it in items) / n}  # fmt: skip


def check_lm_eval(tasks, include_path: str = "") -> None:
    """Config-only checks of the lm-evaluation-harness option (no model load)."""
    if not tasks:
        return
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        raise ConfigError("capability.lm_eval_tasks needs lm-evaluation-harness",
                          hint="pip install 'reprlab[lmeval]' (lm_eval>=0.4.13)") from None  # fmt: skip
    if include_path and not Path(include_path).exists():
        raise ConfigError(f"capability.lm_eval_include_path {include_path} does not exist")


def lm_eval_tasks(model, tok, tasks, include_path: str = "", limit: float | None = None,
                  num_fewshot: int | None = None, batch_size: int = 8) -> dict[str, dict[str, float]]:  # fmt: skip
    """Evaluate ``tasks`` (lm-evaluation-harness names) on the in-memory ``model`` through lm_eval's ``HFLM``.

    Args:
        model: a ``transformers`` causal LM or a ``peft.PeftModel`` (its injected base model is evaluated, so the
            active adapter counts).
        include_path: a folder (or YAML file) of extra task definitions, e.g. local tasks reading local files.
        limit: evaluate only the first ``limit`` documents of each task (a float < 1: that share).

    Returns:
        ``{task: {metric: value}}`` with lm_eval's metric names (``"acc,none"``, ``"acc_stderr,none"``...), numbers only.
    """
    check_lm_eval(tasks, include_path)
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    hf = model.get_base_model() if hasattr(model, "get_base_model") else model
    was_training = hf.training
    hf.eval()
    lm = HFLM(pretrained=hf, tokenizer=tok, batch_size=batch_size, device=str(next(hf.parameters()).device))
    tm = TaskManager(include_path=include_path or None)
    res = simple_evaluate(model=lm, tasks=list(tasks), task_manager=tm, limit=limit, num_fewshot=num_fewshot,
                          log_samples=False, bootstrap_iters=0, verbosity="WARNING")  # fmt: skip
    hf.train(was_training)
    out: dict[str, dict[str, float]] = {}
    for task, metrics in (res or {}).get("results", {}).items():
        out[task] = {k: float(v) for k, v in metrics.items()
                     if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(float(v))}  # fmt: skip
    return out
