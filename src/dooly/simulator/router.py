"""Global scheduling: which replica an arriving request goes to (Vidur's global schedulers).

* ``round_robin``: replicas in turn, whatever their load (the default; Vidur's and this simulator's original
  behaviour).
* ``random``: a uniformly random replica from a seeded generator, so a run is reproducible.
* ``least_outstanding``: the replica with the fewest requests queued or running at the arrival instant (Vidur's
  ``lor``); ties go to the lowest replica index.

A router only reads the replicas' queues; the replica schedulers stay in charge of batching.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import Protocol

import numpy as np

from dooly.core.errors import DoolyError
from dooly.simulator.entities import Request
from dooly.simulator.scheduler import ReplicaScheduler


class Router(Protocol):
    def route(self, req: Request, replicas: Sequence[ReplicaScheduler]) -> int: ...


class RoundRobinRouter:
    def __init__(self) -> None:
        self._next = 0

    def route(self, req: Request, replicas: Sequence[ReplicaScheduler]) -> int:
        rep = self._next % len(replicas)
        self._next = rep + 1
        return rep


class RandomRouter:
    def __init__(self, seed: int = 0) -> None:
        self._rng = np.random.default_rng(seed)

    def route(self, req: Request, replicas: Sequence[ReplicaScheduler]) -> int:
        return int(self._rng.integers(len(replicas)))


class LeastOutstandingRouter:
    def route(self, req: Request, replicas: Sequence[ReplicaScheduler]) -> int:
        loads = [s.outstanding for s in replicas]
        return loads.index(min(loads))


#: Each router by name: a factory of a fresh router from the seed (only ``random`` uses it). A new policy is a
#: class with ``route`` and one line here.
ROUTER_FACTORIES: Mapping[str, Callable[[int], Router]] = MappingProxyType(
    {
        "round_robin": lambda _seed: RoundRobinRouter(),
        "random": RandomRouter,
        "least_outstanding": lambda _seed: LeastOutstandingRouter(),
    }
)
ROUTERS = tuple(ROUTER_FACTORIES)


def make_router(name: str, seed: int = 0) -> Router:
    """A fresh router by name (routers keep state, so each simulation needs its own)."""
    factory = ROUTER_FACTORIES.get(name)
    if factory is None:
        raise DoolyError(f"unknown router {name!r} (known: {', '.join(ROUTERS)})")
    return factory(seed)
