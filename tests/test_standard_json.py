"""Every JSON file a run writes is standard JSON (no NaN/Infinity), on a demo-like set of runs of every method."""

import json

from reprlab.jsonfile import loads_strict


def test_every_json_file_of_every_method_parses_strictly(micro_runs):
    micro_runs["smoke-sweep"]  # a 2-seed sweep too: its summary, aggregate and claims files
    root = micro_runs["demo"].parent  # every method's micro run and the combined report
    files = sorted(p for p in root.rglob("*") if p.suffix in (".json", ".jsonl") and p.is_file())
    assert len(files) > 50  # summaries, claims, artefacts, stages, checkpoint metadata, metrics of 5 recipes
    for path in files:
        text = path.read_text(encoding="utf-8")
        for i, doc in enumerate(text.splitlines() if path.suffix == ".jsonl" else [text]):
            if doc.strip():
                try:
                    loads_strict(doc)
                except ValueError as err:
                    raise AssertionError(f"{path}:{i + 1}: {err}") from None
    # NaN statistics were computed (constant norms, one-piece sources) and written as null with a reason
    summary = json.loads((micro_runs["normic-tiny"] / "summary.json").read_text())
    reasons = {k: v for k, v in summary.items() if k.endswith(".null_reason")}
    assert reasons and all(summary[k[: -len(".null_reason")]] is None for k in reasons)
