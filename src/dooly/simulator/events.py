"""Discrete events: a time-ordered heap whose ties break by insertion order, so runs are deterministic."""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any


class EventKind(IntEnum):
    # at equal times an iteration ends before an arrival is seen, as in a real engine loop that checks its
    # queue after each step
    BATCH_END = 0
    ARRIVAL = 1


@dataclass(order=True)
class Event:
    time: float
    kind: EventKind
    seq: int
    replica: int = field(compare=False, default=0)
    payload: Any = field(compare=False, default=None)


class EventQueue:
    def __init__(self) -> None:
        self._heap: list[Event] = []
        self._seq = itertools.count()

    def push(self, time: float, kind: EventKind, replica: int = 0, payload: Any = None) -> None:
        heapq.heappush(self._heap, Event(time, kind, next(self._seq), replica, payload))

    def pop(self) -> Event:
        return heapq.heappop(self._heap)

    def peek_time(self) -> float:
        return self._heap[0].time

    def __len__(self) -> int:
        return len(self._heap)
