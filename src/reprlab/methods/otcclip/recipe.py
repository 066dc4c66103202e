"""otcclip-*: one poisoned image-caption dataset, the defenses trained side by side, one comparison.

The entry module that ``reprlab run`` loads for every ``otcclip-*`` recipe (``entry:`` in ``recipes/*.yaml``; the
contract is in CONTRIBUTING.md): the config, the checks before a run, the run, the report. Each is defined in its
own place; the package docstring (``reprlab.methods.otcclip``) maps them all.
"""

from reprlab.methods.otcclip.config import Config
from reprlab.methods.otcclip.pipeline.preflight import preflight
from reprlab.methods.otcclip.pipeline.report import HEADLINE, SUMMARY_KINDS, report_sections
from reprlab.methods.otcclip.pipeline.run import run

__all__ = ["HEADLINE", "SUMMARY_KINDS", "Config", "preflight", "report_sections", "run"]
