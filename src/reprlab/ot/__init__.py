"""Batched optimal transport: log-domain-stable Sinkhorn, IPOT, cost builders, ragged point-set distances.

The performance core of OTCCLIP's patch-to-token matching (the paper's OT distance between image patches and caption tokens), usable
on its own. See ``docs/ot.md`` for the math, the API and the measured speed.
"""

from reprlab.ot.costs import cosine_cost, sq_euclidean_cost
from reprlab.ot.distance import ot_distance
from reprlab.ot.ipot import ipot
from reprlab.ot.result import SinkhornResult
from reprlab.ot.sinkhorn import sinkhorn

__all__ = ["SinkhornResult", "cosine_cost", "ipot", "ot_distance", "sinkhorn", "sq_euclidean_cost"]
