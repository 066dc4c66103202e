"""Run folders: config, metrics, checkpoints, stages, summary."""

from reprlab.runs.atomic import atomic_write_json, atomic_write_text, read_json
from reprlab.runs.run import Run, RunExistsError

__all__ = ["Run", "RunExistsError", "atomic_write_json", "atomic_write_text", "read_json"]
