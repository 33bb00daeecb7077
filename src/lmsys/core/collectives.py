"""The bus factor of each collective: busbw / algbw on n ranks, as nccl-tests defines it (PERFORMANCE.md).

algbw = bytes / time (the full buffer, as nccl-tests counts it); busbw = algbw · factor, the fraction of
the buffer that crosses each rank's link in a bandwidth-optimal algorithm (a ring): an all-reduce sends
2(n−1)/n of it (a reduce-scatter, then an all-gather), an all-gather or a reduce-scatter (n−1)/n, a
broadcast and a send-recv the whole buffer once. busbw compares across collectives and world sizes and
with a link's peak. One table for `comm` (what it prints) and the planner (what it predicts). Torch-free.
"""

from __future__ import annotations

from typing import Callable, NamedTuple


class BusFactor(NamedTuple):
    """A collective's bus factor: its formula as printed under a table, and its value on n ranks (also by
    calling it: `BUS_FACTORS["all-reduce"](8)`)."""

    formula: str
    of: Callable[[int], float]

    def __call__(self, n: int) -> float:
        return self.of(n)


BUS_FACTORS: dict[str, BusFactor] = {
    "all-reduce": BusFactor("2(n−1)/n", lambda n: 2 * (n - 1) / n),
    "all-gather": BusFactor("(n−1)/n", lambda n: (n - 1) / n),
    "reduce-scatter": BusFactor("(n−1)/n", lambda n: (n - 1) / n),
    "broadcast": BusFactor("1", lambda n: 1.0),
    "send-recv": BusFactor("1", lambda n: 1.0),  # sendrecv_perf: each rank's send buffer crosses its link once
}
ALIASES = {"send": "send-recv"}  # the planner's pipeline send: one direction of a send-recv, the same factor


def bus_factor(collective: str, n: int) -> float:
    """busbw / algbw for `collective` (a BUS_FACTORS name, or "send") on n ranks."""
    name = ALIASES.get(collective, collective)
    if name not in BUS_FACTORS:
        raise ValueError(f"unknown collective {collective!r}")
    return BUS_FACTORS[name](n)
