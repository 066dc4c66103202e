"""FDA analyses of a trained model, each returning a JSON-able dict (saved as an artefact by the recipe).

Layer/position choices and summary statistics are [ours]; the method names follow Reason to Rote
(arXiv 2507.04782): logit lens, probes, INLP, attribution-patching circuits, outlier-heuristic neurons.
Positions: the answer starts at sequence index ``s`` (= 10 for FDA); the logits at ``s - 1 + j`` predict
answer token ``j``. For a noisy item, ``k`` is the first answer index where ỹ and y* differ.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor, nn

from reprlab.hooks import hooks
from reprlab.interp.attribution import (
    ItemMetric,
    attribution_patching,
    faithfulness,
    iou,
    node_hooks,
    node_means,
    random_iou_baseline,
)
from reprlab.interp.inlp import inlp, project_out_hook, random_projection
from reprlab.interp.logit_lens import logit_lens, residual_names
from reprlab.interp.neurons import outlier_neuron_analysis
from reprlab.interp.probing import collect, fit_probe, probe_grid
from reprlab.methods.reason_to_rote.dataset import Batch, Item
from reprlab.methods.reason_to_rote.evaluate import answer_matches
from reprlab.methods.reason_to_rote.fda import answer_columns, column_features


def first_diff(noisy: Batch) -> Tensor:
    """(m,) first answer index where the noisy and true answers differ."""
    diff = noisy.ids != noisy.ids_true  # (m, pos)
    return diff.float().argmax(1) - noisy.answer_start


def tokens_at(ids: Tensor, at: Tensor) -> Tensor:
    return ids[torch.arange(ids.shape[0]), at]


def run_logit_lens(model: nn.Module, noisy: Batch) -> dict:
    """Logit lens on noisy items at the first differing answer position: a = true y*, b = noisy ỹ."""
    k = first_diff(noisy)
    at = noisy.answer_start + k
    res = logit_lens(model, noisy.ids, at - 1, tokens_at(noisy.ids_true, at), tokens_at(noisy.ids, at))
    out = res.to_json()
    out["labels"] = {"a": "true answer y*", "b": "noisy label ỹ"}
    out["first_diff_histogram"] = np.bincount(k.numpy(), minlength=6).tolist()
    return out


def run_lens_over_training(model: nn.Module, snapshots: list, noisy: Batch) -> dict:
    """Logit lens on noisy items at every kept training snapshot (weights restored into a copy of ``model``).

    Shows when the noisy label overtakes the true answer at the output, and whether the true answer stays
    on top at the intermediate layer meanwhile (the paper's "still decodable" claim).
    """
    import copy

    from reprlab.runs.checkpoint import load_checkpoint_dir

    probe = copy.deepcopy(model)
    rows = []
    for folder in snapshots:
        step, _ = load_checkpoint_dir(folder, {"model": probe}, restore_rng=False)
        probe.eval()
        res = run_logit_lens(probe, noisy)
        rows.append({"step": step, "layers": res["layers"], "share_true_above_noisy": res["share_a_above_b"],
                     "top1_true": res["top1_a"], "top1_noisy": res["top1_b"]})  # fmt: skip
    return {"snapshots": rows}


def revealing_columns(target: str) -> set[int]:
    """Sum columns whose teacher-forced answer token gives ``target`` away to a linear probe [ours].

    ``sum_digit{k}`` is the column-k token itself; ``sum_digit4`` is also carry 3. ``carry{k}`` is read off
    the column-k token (a small digit with large operands means a carry: an untrained model's probe reaches
    0.84-0.89 there, against 0.52 majority) and the column-(k+1) token (column 4 *is* carry 3: 1.0 untrained).
    """
    kind, k = target.rstrip("0123456789"), int(target[-1])
    if kind == "carry":
        return {k, k + 1}
    return {3, 4} if k == 4 else {k}


def leak_free_last_position(target: str, digit_order: str, answer_start: int) -> int:
    """Last sequence position whose prefix holds no answer token that reveals ``target`` (both digit orders).

    The answer token of column c sits at ``answer_start + answer_columns(order).index(c)`` and is visible
    from there on, so a probe is scored only at positions before the earliest revealing token.
    """
    cols = answer_columns(digit_order)
    return answer_start + min(cols.index(c) for c in revealing_columns(target)) - 1


def selection_split(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Disjoint halves of ``range(n)``: (select, report). Cells are chosen on one and scored on the other."""
    perm = np.random.default_rng(seed + 7).permutation(n)
    return np.sort(perm[: n // 2]), np.sort(perm[n // 2 :])


def run_probes(model: nn.Module, random_model: nn.Module, train_clean: Batch, train_items: list[Item],
               test: Batch, test_items: list[Item], noisy: Batch, noisy_items: list[Item],
               seed: int, digit_order: str = "reversed", layer_every: int = 1) -> dict:  # fmt: skip
    """Probes for carries c_0..c_3 and sum digits s_0..s_4 on residual streams at the answer positions.

    Trained on clean training items; evaluated on held-out clean test items and on noisy training items
    (against their *true* intermediate values). The best cell per target is chosen on one half of the test
    items (``select``) and its clean accuracy reported on the other half (``report``), among positions where
    no teacher-forced answer token reveals the target (:func:`leak_free_last_position`). Controls: shuffled
    labels, and the same probe on a random-init model at the chosen cell (``acc_random_model``); the
    headline ``selectivity`` is clean accuracy minus the random-init model's.

    ``layer_every`` > 1 probes the embedding, every ``layer_every``-th block and the last block only (a
    30-block model has 31 residual streams; the probes' cost grows with each).
    """
    names = residual_names(model)
    layers = ["embed"] + [f"block{i}" for i in range(len(names) - 1)]
    if layer_every > 1:
        keep = sorted({0, len(names) - 1, *range(layer_every, len(names), layer_every)})
        names, layers = [names[i] for i in keep], [layers[i] for i in keep]
    s = int(train_clean.answer_start[0])
    positions = list(range(s - 1, s + 5))  # '=' and the first 5 answer tokens: they predict answer 0..5
    sel, rep = selection_split(len(test_items), seed)
    acts = {n: collect(model, b.ids, names, positions) for n, b in
            (("train", train_clean), ("test", test), ("noisy", noisy))}  # fmt: skip
    rand_acts = {n: collect(random_model, b.ids, names, positions) for n, b in
                 (("train", train_clean), ("test", test), ("noisy", noisy))}  # fmt: skip
    acts |= {"select": acts["test"][:, sel], "report": acts["test"][:, rep]}
    rand_acts["report"] = rand_acts["test"][:, rep]
    targets = {f"carry{k}": lambda it, k=k: it.meta["carries"][k] for k in range(4)}
    targets |= {f"sum_digit{k}": lambda it, k=k: it.meta["sum_digits"][k] for k in range(5)}
    results, summary = {}, {}
    for name, get in targets.items():
        ys = {n: np.array([get(it) for it in items]) for n, items in
              (("train", train_items), ("test", test_items), ("noisy", noisy_items))}  # fmt: skip
        ys |= {"select": ys["test"][sel], "report": ys["test"][rep]}
        grid = probe_grid(name, acts["train"], ys["train"],
                          {"clean_select": (acts["select"], ys["select"]), "clean_test": (acts["report"], ys["report"]),
                           "noisy": (acts["noisy"], ys["noisy"])},
                          layers, positions, seed=seed, shuffle_control=name.startswith("carry"))  # fmt: skip
        last = leak_free_last_position(name, digit_order, s)
        allowed = np.array([p <= last for p in positions])
        masked = np.where(allowed[None, :], grid.acc["clean_select"], -1.0)
        li, pi = (int(v) for v in np.unravel_index(np.argmax(masked), masked.shape))
        rgrid = probe_grid(name, rand_acts["train"][li:li + 1, :, pi:pi + 1], ys["train"],
                           {"clean_test": (rand_acts["report"][li:li + 1, :, pi:pi + 1], ys["report"])},
                           layers[li:li + 1], positions[pi:pi + 1], seed=seed, shuffle_control=False)  # fmt: skip
        results[name] = grid.to_json()
        # Noisy items are teacher-forced with their noisy label, so positions after the first differing digit
        # see a wrong digit; also score only items whose probed position lies in the shared prefix.
        shared = positions[pi] <= (noisy.answer_start - 1 + first_diff(noisy)).numpy()
        scaler, clf = fit_probe(acts["train"][li, :, pi].numpy(), ys["train"], seed)
        hit = clf.predict(scaler.transform(acts["noisy"][li, :, pi].numpy())) == ys["noisy"]
        acc_clean, acc_rand = float(grid.acc["clean_test"][li, pi]), float(rgrid.acc["clean_test"][0, 0])
        summary[name] = {
            "acc_noisy_shared_prefix": float(hit[shared].mean()) if shared.any() else float("nan"),
            "n_noisy_shared_prefix": int(shared.sum()),
            "best_layer": layers[li], "best_position": positions[pi],
            "acc_clean": acc_clean, "acc_noisy": float(grid.acc["noisy"][li, pi]),
            "acc_clean_select": float(grid.acc["clean_select"][li, pi]),
            "last_allowed_position": last,
            "acc_shuffled": float(grid.acc_shuffled[li, pi]), "acc_random_model": acc_rand,
            "selectivity": acc_clean - acc_rand, "majority": grid.majority,
        }  # fmt: skip
    carries = [summary[f"carry{k}"] for k in range(4)]
    return {
        "grids": results, "best": summary, "layers": layers, "hooks": names, "positions": positions,
        "digit_order": digit_order,
        "n_select": len(sel), "n_report": len(rep),
        "carry_acc_clean": float(np.mean([c["acc_clean"] for c in carries])),
        "carry_acc_noisy": float(np.mean([c["acc_noisy"] for c in carries])),
        "carry_acc_noisy_shared_prefix": float(np.nanmean([c["acc_noisy_shared_prefix"] for c in carries])),
        "carry_acc_shuffled": float(np.mean([c["acc_shuffled"] for c in carries])),
        "carry_acc_random_model": float(np.mean([c["acc_random_model"] for c in carries])),
        "carry_selectivity": float(np.mean([c["selectivity"] for c in carries])),
    }  # fmt: skip


def _em_with(model: nn.Module, batch: Batch, ids: Tensor, fwd_hooks) -> float:
    with hooks(model, fwd_hooks):
        return (
            answer_matches(model, ids.to(next(model.parameters()).device), batch).all(1).float().mean().item()
        )


def run_inlp(model: nn.Module, probes: dict, train_clean: Batch, train_items: list[Item], test: Batch,
             noisy: Batch, n_iters: int, seed: int) -> dict:  # fmt: skip
    """INLP on each carry at its best block (non-embedding) cell; all four removed together.

    Reports noisy-label memorisation, true-answer rate on noisy items and clean test EM, before and after
    the intervention and with random subspaces of the same ranks at the same cells (control).
    """
    # the probed streams (results written before probes kept "hooks" probed every stream)
    names = probes.get("hooks") or residual_names(model)
    layers, positions = probes["layers"], probes["positions"]
    cells, fwd, fwd_rand = [], [], []
    for k in range(4):
        acc = np.array(probes["grids"][f"carry{k}"]["acc"]["clean_select"])
        acc[0] = -1  # exclude the embedding layer: it holds no computed carry
        acc[:, [p > probes["best"][f"carry{k}"]["last_allowed_position"] for p in positions]] = -1
        li, pi = np.unravel_index(np.argmax(acc), acc.shape)
        x = collect(model, train_clean.ids, [names[li]], [positions[pi]])[0, :, 0].numpy()
        y = np.array([it.meta["carries"][k] for it in train_items])
        res = inlp(x, y, n_iters=n_iters, seed=seed)
        fwd.append((names[li], project_out_hook(res.projection, [positions[pi]])))
        fwd_rand.append((names[li], project_out_hook(random_projection(x.shape[1], res.rank, seed + k),
                                                     [positions[pi]])))  # fmt: skip
        cells.append({"carry": k, "layer": layers[li], "position": positions[pi], "rank": res.rank,
                      "accuracies": [round(a, 4) for a in res.accuracies], "majority": res.majority,
                      "converged": res.converged})  # fmt: skip

    def measure(h) -> dict:
        return {"noisy_memorized": _em_with(model, noisy, noisy.ids, h),
                "noisy_true_answer": _em_with(model, noisy, noisy.ids_true, h),
                "clean_test_em": _em_with(model, test, test.ids, h)}  # fmt: skip

    base, after, rand = measure([]), measure(fwd), measure(fwd_rand)
    return {
        "cells": cells, "before": base, "inlp": after, "random": rand,
        "memorization_drop": base["noisy_memorized"] - after["noisy_memorized"],
        "random_memorization_drop": base["noisy_memorized"] - rand["noisy_memorized"],
        "clean_drop": base["clean_test_em"] - after["clean_test_em"],
        "random_clean_drop": base["clean_test_em"] - rand["clean_test_em"],
    }  # fmt: skip


def _clean_metric_items(clean: Batch, corrupt: Batch, ks: Tensor, seed: int):
    """Clean items with a position k (drawn from the noisy k distribution) whose corrupted digit differs."""
    gen = torch.Generator().manual_seed(seed)
    k = ks[torch.randint(len(ks), (len(clean),), generator=gen)]
    at = clean.answer_start + k
    tgt, alt = tokens_at(clean.ids, at), tokens_at(corrupt.ids, at)
    keep = tgt != alt
    return keep, at, tgt, alt


def _unrelated_metric(at: Tensor, gen: torch.Generator, digits: Tensor | None = None) -> ItemMetric:
    """logit(t1) - logit(t2) for a random digit pair per item, read at ``at`` - 1 (the null metric).

    ``digits``: (10,) model ids of the digits 0..9; None = ids 0..9 (``FDA_VOCAB`` starts with the digits).
    """
    t1 = torch.randint(10, (len(at),), generator=gen)
    t2 = (t1 + torch.randint(1, 10, (len(at),), generator=gen)) % 10
    if digits is not None:
        t1, t2 = digits[t1], digits[t2]
    return ItemMetric(at - 1, t1, t2)


@dataclass(frozen=True)
class CircuitItems:
    """The items, corruptions and metrics every circuit analysis reads (one draw, shared by all of them).

    ``mem_*``: noisy items (batch,) with a random clean corruption and the memorisation metric at the first
    differing position ``at``; ``gen_*``: clean items whose corrupted token differs at a position drawn from
    the noisy items' positions, with the generalisation metric.
    """

    mem_ids: Tensor
    mem_corrupt: Tensor
    mem_metric: ItemMetric
    at: Tensor
    gen_ids: Tensor
    gen_corrupt: Tensor
    gen_metric: ItemMetric


def circuit_items(train_clean: Batch, noisy: Batch, n_items: int, seed: int) -> CircuitItems:
    gen = torch.Generator().manual_seed(seed)
    n_clean = len(train_clean)
    noisy_sub = noisy.select(torch.arange(min(n_items, len(noisy))))
    corrupt_n = train_clean.select(torch.randint(n_clean, (len(noisy_sub),), generator=gen))
    k = first_diff(noisy_sub)
    at = noisy_sub.answer_start + k
    mem_metric = ItemMetric(at - 1, tokens_at(noisy_sub.ids, at), tokens_at(noisy_sub.ids_true, at))
    clean_sub = train_clean.select(torch.randperm(n_clean, generator=gen)[: 2 * n_items])
    corrupt_c = train_clean.select(torch.randint(n_clean, (len(clean_sub),), generator=gen))
    keep, at_c, tgt, alt = _clean_metric_items(clean_sub, corrupt_c, k, seed)
    keep_idx = torch.nonzero(keep).flatten()[:n_items]
    gen_metric = ItemMetric(at_c[keep_idx] - 1, tgt[keep_idx], alt[keep_idx])
    return CircuitItems(noisy_sub.ids, corrupt_n.ids, mem_metric, at, clean_sub.ids[keep_idx],
                        corrupt_c.ids[keep_idx], gen_metric)  # fmt: skip


def run_circuits(model: nn.Module, train_clean: Batch, noisy: Batch, top_k_frac: float, n_items: int,
                 seed: int, n_null: int = 3, digits: Tensor | None = None,
                 mean_items: int = 1000) -> tuple[dict, dict]:  # fmt: skip
    """Generalisation (clean) vs memorisation (noisy) circuits by node attribution patching, with nulls.

    Memorisation metric: logit(ỹ_k) − logit(y*_k) at the first differing position k; corrupted input = a
    random clean training item. Generalisation metric [ours]: logit(y_k) − logit(y'_k) on clean items,
    with y' the corrupted item's token at k (items where they coincide are dropped) and k drawn from the
    noisy items' k distribution so both circuits look at comparable positions.

    Matched null [ours, docs/reason_to_rote.md]: ``n_null`` circuits of *unrelated* metrics (logit difference of a random
    digit pair per item) on the same noisy items, corruptions and positions. Any two circuits read at the
    same positions share the position-generic nodes, so a uniform-random-subset IoU (``iou_random_baseline``,
    ~0.01) is no evidence of shared mechanism; ``iou`` must beat ``iou_null_unrelated`` (mean IoU of the
    memorisation or generalisation circuit with an unrelated one, the larger of the two).

    ``digits`` are the model ids of 0..9 (None: ids 0..9, our GPT's vocabulary); ``mean_items`` clean items
    give the mean activations of mean ablation.

    Returns:
        (summary dict, memorisation attribution scores per hook as nested lists for the neuron analysis)
    """
    it = circuit_items(train_clean, noisy, n_items, seed)
    mem = attribution_patching(model, it.mem_ids, it.mem_corrupt, it.mem_metric)
    gen_ = attribution_patching(model, it.gen_ids, it.gen_corrupt, it.gen_metric)

    n_nodes = len(mem.flat()[1])
    top_k = max(1, int(top_k_frac * n_nodes))
    mem_c, gen_c = mem.top_k(top_k), gen_.top_k(top_k)
    null_gen = torch.Generator().manual_seed(seed + 101)
    nulls = [attribution_patching(model, it.mem_ids, it.mem_corrupt, _unrelated_metric(it.at, null_gen, digits)).top_k(top_k)
             for _ in range(n_null)]  # fmt: skip
    iou_mem_null = float(np.mean([iou(mem_c, c) for c in nulls])) if nulls else float("nan")
    iou_gen_null = float(np.mean([iou(gen_c, c) for c in nulls])) if nulls else float("nan")
    pairs = [iou(a, b) for i, a in enumerate(nulls) for b in nulls[i + 1 :]]
    means = node_means(model, train_clean.ids[:mean_items])
    f_mem = faithfulness(model, it.mem_ids, it.mem_metric, mem_c, means)
    f_gen = faithfulness(model, it.gen_ids, it.gen_metric, gen_c, means)
    f_mem_with_gen = faithfulness(model, it.mem_ids, it.mem_metric, gen_c, means)

    def composition(c: set) -> dict:
        out: dict[str, int] = {}
        for name, _, _ in c:
            out[name] = out.get(name, 0) + 1
        return out

    shared = iou(mem_c, gen_c)
    summary = {
        "n_nodes": n_nodes, "top_k": top_k, "iou": shared,
        "iou_random_baseline": random_iou_baseline(n_nodes, top_k),
        "iou_null_unrelated": max(iou_mem_null, iou_gen_null),
        "iou_null_unrelated_memorization": iou_mem_null, "iou_null_unrelated_generalization": iou_gen_null,
        "iou_null_unrelated_pair": float(np.mean(pairs)) if pairs else float("nan"), "n_null": n_null,
        "iou_excess": shared - max(iou_mem_null, iou_gen_null),
        "faithfulness_memorization": f_mem.faithfulness, "faithfulness_generalization": f_gen.faithfulness,
        "faithfulness_memorization_with_generalization_circuit": f_mem_with_gen.faithfulness,
        "metric_memorization": {"full": f_mem.m_full, "empty": f_mem.m_empty, "circuit": f_mem.m_circuit},
        "metric_generalization": {"full": f_gen.m_full, "empty": f_gen.m_empty, "circuit": f_gen.m_circuit},
        "composition_memorization": composition(mem_c), "composition_generalization": composition(gen_c),
        "n_items_memorization": len(it.mem_ids), "n_items_generalization": len(it.gen_ids),
        "score_share_by_hook_memorization": _shares(mem.scores), "score_share_by_hook_generalization": _shares(gen_.scores),
    }  # fmt: skip
    return summary, {name: s.tolist() for name, s in mem.scores.items()}


def permute_labels(train_set: Batch, seed: int) -> Batch:
    """The label-permuted training set [ours, docs/reason_to_rote.md]: every item gets the answer of another item.

    Prompts stay; the answer tokens (incl. EOS) of item ``i`` are those of item ``perm[i]`` for a random
    derangement ``perm`` drawn from ``seed``, so the label multiset is unchanged and no input keeps its own
    label. ``ids_true`` keeps the true answers and ``noisy`` is cleared (nothing is "noisy" when every label
    is arbitrary). Needs equal answer spans (FDA); a model trained on it can only memorise.

    Shapes: ``train_set.ids`` (n, pos) -> the same shape.
    """
    if len(set(train_set.answer_start.tolist())) != 1 or len(set(train_set.answer_len.tolist())) != 1:
        raise ValueError("permute_labels needs one answer span for all items (FDA)")
    n = len(train_set)
    if n < 2:
        raise ValueError("permute_labels needs at least 2 items")
    gen = torch.Generator().manual_seed(seed + 202)
    while True:  # derangement: no item keeps its own label slot
        perm = torch.randperm(n, generator=gen)
        if not (perm == torch.arange(n)).any():
            break
    s, length = int(train_set.answer_start[0]), int(train_set.answer_len[0])
    ids = train_set.ids.clone()
    ids[:, s : s + length] = train_set.ids[perm, s : s + length]
    return Batch(ids, train_set.ids_true, train_set.answer_start, train_set.answer_len,
                 torch.zeros_like(train_set.noisy))  # fmt: skip


def permuted_null_summary(real: dict, permuted: dict) -> dict:
    """Compare the real model's circuit overlap with the label-permuted model's (same items and metrics).

    ``real`` and ``permuted`` are :func:`run_circuits` summaries. In the permuted model no input predicts its
    label, so no mechanism can be shared for a reason that is about the task: its memorisation-generalisation
    IoU is what position, architecture and training on the same inputs give. [ours]
    """
    return {
        "iou": real["iou"], "iou_null_permuted": permuted["iou"],
        "iou_excess_permuted": real["iou"] - permuted["iou"],
        "iou_null_unrelated_permuted": permuted["iou_null_unrelated"],
        "faithfulness_memorization_permuted": permuted["faithfulness_memorization"],
        "faithfulness_generalization_permuted": permuted["faithfulness_generalization"],
    }  # fmt: skip


def run_edge_circuits(model: nn.Module, train_clean: Batch, noisy: Batch, top_k_frac: float, n_items: int,
                      seed: int, n_null: int = 3, ig_steps: int = 0, digits: Tensor | None = None,
                      mean_items: int = 1000) -> dict:  # fmt: skip
    """Edge circuits (EAP, or EAP-IG with ``ig_steps``) for the same metrics, items and nulls as
    :func:`run_circuits`: IoU of the memorisation and generalisation edge sets against unrelated-metric edge
    circuits at the same positions, and mean-ablation faithfulness (:mod:`reprlab.interp.edges`)."""
    from reprlab.interp.edges import edge_attribution_patching, edge_faithfulness, graph, upstream_means

    it = circuit_items(train_clean, noisy, n_items, seed)  # the same items and corruptions as run_circuits
    eap = lambda ids, cor, m: edge_attribution_patching(model, ids, cor, m, ig_steps=ig_steps)  # noqa: E731
    mem = eap(it.mem_ids, it.mem_corrupt, it.mem_metric)
    gen_ = eap(it.gen_ids, it.gen_corrupt, it.gen_metric)
    n_edges = len(graph(model)[2])
    top_k = max(1, int(top_k_frac * n_edges))
    mem_c, gen_c = mem.top_k(top_k), gen_.top_k(top_k)
    null_gen = torch.Generator().manual_seed(seed + 101)
    nulls = [
        eap(it.mem_ids, it.mem_corrupt, _unrelated_metric(it.at, null_gen, digits)).top_k(top_k)
        for _ in range(n_null)
    ]
    iou_mem_null = float(np.mean([iou(mem_c, c) for c in nulls])) if nulls else float("nan")
    iou_gen_null = float(np.mean([iou(gen_c, c) for c in nulls])) if nulls else float("nan")
    means = upstream_means(model, train_clean.ids[:mean_items])
    f_mem = edge_faithfulness(model, it.mem_ids, it.mem_metric, mem_c, means)
    f_gen = edge_faithfulness(model, it.gen_ids, it.gen_metric, gen_c, means)
    shared = iou(mem_c, gen_c)
    return {
        "n_edges": n_edges, "top_k": top_k, "ig_steps": ig_steps, "iou": shared,
        "iou_random_baseline": random_iou_baseline(n_edges, top_k),
        "iou_null_unrelated": max(iou_mem_null, iou_gen_null), "iou_excess": shared - max(iou_mem_null, iou_gen_null),
        "faithfulness_memorization": f_mem.faithfulness, "faithfulness_generalization": f_gen.faithfulness,
        "edges_memorization": sorted(f"{u}->{v}" for u, v in mem_c),
        "edges_generalization": sorted(f"{u}->{v}" for u, v in gen_c),
    }  # fmt: skip


def run_head_ablation(model: nn.Module, train_clean: Batch, noisy: Batch, n_items: int, seed: int,
                      n_null: int = 3, digits: Tensor | None = None, mean_items: int = 1000) -> dict:  # fmt: skip
    """Mean-ablate each attention head and compare its effect on the memorisation and generalisation metrics.

    Same metrics and items as :func:`run_circuits`. Statistic [ours]: Pearson correlation over heads of the
    two effect vectors; matched null: the mean correlation of the memorisation effects with the effects on
    unrelated digit-pair metrics at the same items and positions (heads that matter for any logit
    difference at a position correlate for every metric).
    """
    from reprlab.interp.ablation import head_ablation, head_means

    it = circuit_items(train_clean, noisy, n_items, seed)  # the same items as run_circuits
    means = head_means(model, train_clean.ids[:mean_items])
    mem = head_ablation(model, it.mem_ids, it.mem_metric, means)
    gen_ = head_ablation(model, it.gen_ids, it.gen_metric, means)
    null_gen = torch.Generator().manual_seed(seed + 101)
    nulls = [
        head_ablation(model, it.mem_ids, _unrelated_metric(it.at, null_gen, digits), means)
        for _ in range(n_null)
    ]

    def corr(a: Tensor, b: Tensor) -> float:
        return float(np.corrcoef(a.flatten().numpy(), b.flatten().numpy())[0, 1])

    r = corr(mem.effect, gen_.effect)
    r_null = float(np.mean([corr(mem.effect, nl.effect) for nl in nulls])) if nulls else float("nan")
    return {
        "effect_memorization": mem.to_json(), "effect_generalization": gen_.to_json(),
        "effect_null": [nl.to_json() for nl in nulls],
        "corr": r, "corr_null_unrelated": r_null, "corr_excess": r - r_null,
    }  # fmt: skip


def _shares(scores: dict[str, Tensor]) -> dict[str, float]:
    tot = sum(s.abs().sum().item() for s in scores.values()) or 1.0
    return {k: round(v.abs().sum().item() / tot, 4) for k, v in scores.items()}


def run_neurons(model: nn.Module, mem_scores: dict, train_clean: Batch, train_items: list[Item], test: Batch,
                test_items: list[Item], noisy: Batch, noisy_items: list[Item], digit_order: str, k: int,
                layer: int, seed: int, n_random: int = 5) -> dict:  # fmt: skip
    """Outlier-heuristic neurons in MLP ``layer`` (see :mod:`reprlab.interp.neurons`)."""
    hook = f"blocks.{layer}.mlp.hook_post"
    ranking = torch.tensor(mem_scores[hook]).abs().sum(0)  # (d_mlp,) summed |attribution| over positions
    s = int(train_clean.answer_start[0])
    positions = list(range(s - 1, s + 5))  # predict answer tokens 0..5
    feats = {n: torch.tensor(column_features(items, digit_order)) for n, items in
             (("train", train_items), ("test", test_items), ("noisy", noisy_items))}  # fmt: skip
    res = outlier_neuron_analysis(
        model, hook, ranking, k, positions, s, 6, train_clean.ids, feats["train"], test.ids, feats["test"],
        noisy.ids, noisy.ids_true, feats["noisy"], first_diff(noisy), n_values=20, seed=seed,
        n_random=n_random,
    )  # fmt: skip
    out = dict(res.__dict__)
    out["columns"] = answer_columns(digit_order)
    return out


__all__ = [
    "first_diff",
    "node_hooks",
    "run_circuits",
    "permute_labels",
    "permuted_null_summary",
    "run_inlp",
    "run_logit_lens",
    "run_neurons",
    "run_probes",
]
