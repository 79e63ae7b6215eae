"""Evaluation dispatch: the evaluation bags scored on the DPGS workers, in shards balanced by length."""

from __future__ import annotations

from collections.abc import Callable

import ray
from ray.exceptions import GetTimeoutError, RayActorError

from dpgs.distributed.actors import PlacedActors
from dpgs.distributed.assignment import assign_lpt
from dpgs.train.evaluate import EvalProtocol, Predictions


def shards_by_length(indices: list[int], lengths: list[int], workers: int) -> list[list[int]]:
    """``indices`` split over ``workers`` shards balanced by ``lengths`` (instances per bag, LPT)."""
    plan = assign_lpt([lengths[i] for i in indices], workers)
    return [[indices[p] for p in positions] for positions in plan]


def evaluate_on_workers(workers: PlacedActors, state: dict | None, indices: list[int], protocol: EvalProtocol,
                        lengths: list[int], fallback: Callable[[list[int]], Predictions]) -> Predictions:
    """Predictions of the bags ``indices`` with the weights ``state`` (None: each worker's replica, which
    must then be exact), sharded over the workers by ``lengths`` (instances per bag, LPT) and merged in the
    order of ``indices``. A shard whose worker fails is scored by ``fallback`` (on the driver; the group
    notices the failure at its next chunk)."""
    state_ref = None if state is None else ray.put(state)
    shards = shards_by_length(indices, lengths, len(workers))
    refs = [w.evaluate.remote(state_ref, s, protocol) for w, s in zip(workers.handles, shards, strict=True)]
    scored = []
    for ref in refs:
        try:
            scored.append(workers.get([ref])[0])
        except (RayActorError, GetTimeoutError):
            scored.append(None)
    missing = [shard for shard, preds in zip(shards, scored, strict=True) if preds is None]
    if missing:
        print(f"[dpgs] {len(missing)} evaluation shard(s) lost with their worker: scoring them here",
              flush=True)
    found = [p for p in scored if p is not None] + [fallback(shard) for shard in missing]
    return Predictions.merge(found, indices)
