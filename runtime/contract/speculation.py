"""Expert speculation: when a step fetches every expert before its router has chosen."""

from __future__ import annotations

#: Experts are fetched before the router has chosen them when a step's rows x top_k reach
#: this many times the experts (the runtime does it, the planner's schedule prices it).
SPECULATE_ROUTED_PER_EXPERT = 4


def speculates(rows: float, top_k: int, num_experts: int) -> bool:
    """True when a step of `rows` rows, each routed to top_k of num_experts experts, almost
    surely uses every expert: rows * top_k >= 4 * num_experts, so under even routing an
    expert is unused with probability (1 - k/E)^rows <= e^-4 (about 2%); a speculated
    expert that no row chose costs only its wasted copy."""
    return rows * top_k >= SPECULATE_ROUTED_PER_EXPERT * num_experts
