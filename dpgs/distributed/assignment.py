"""Assigning a step's bags to workers by length (longest-processing-time first).

The cost of a bag is modelled as its number of instances. LPT sorts bags by decreasing cost and gives
each to the currently least-loaded worker; its makespan is at most 4/3 of the optimum, so the slowest
worker decides the step time as little as possible.
"""

from __future__ import annotations

import heapq


def assign_lpt(lengths: list[int], workers: int) -> list[list[int]]:
    """Positions into ``lengths`` per worker (each position exactly once; ties broken by worker rank)."""
    if workers < 1:
        raise ValueError(f"need at least one worker, got {workers}")
    heap = [(0, rank) for rank in range(workers)]
    assignment: list[list[int]] = [[] for _ in range(workers)]
    for pos in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        load, rank = heapq.heappop(heap)
        assignment[rank].append(pos)
        heapq.heappush(heap, (load + lengths[pos], rank))
    return assignment


def imbalance(loads: list[float]) -> float:
    """max / mean - 1 over the workers that had work (0 = perfectly balanced)."""
    busy = [x for x in loads if x > 0]
    if not busy:
        return 0.0
    return max(busy) / (sum(busy) / len(busy)) - 1.0
