"""Results across runs: declared claims, seed-sweep aggregation and its statistics."""

from reprlab.results.claims import Claim, ClaimResult, claims_table, evaluate_claims, parse_claims

__all__ = ["Claim", "ClaimResult", "claims_table", "evaluate_claims", "parse_claims"]
