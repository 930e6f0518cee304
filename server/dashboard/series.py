"""Per-second samples of the server's counters and gauges, over the last few minutes (a ring buffer)."""
from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from typing import Any

Row = Mapping[str, Any]


class SecondRing:
    """One row per whole second (monotonic clock), the newest last. A second with no sample repeats the row
    before it: cumulative counters then show no change, gauges keep their value."""

    def __init__(self, capacity: int) -> None:
        if capacity < 2:
            raise ValueError("capacity must be >= 2")
        self.capacity = capacity
        self._seconds: deque[int] = deque(maxlen=capacity)
        self._rows: deque[Row] = deque(maxlen=capacity)

    def __len__(self) -> int:
        return len(self._rows)

    def record(self, second: int, row: Row) -> None:
        """The latest sample of `second` (a later one in the same second replaces it)."""
        if self._seconds and second <= self._seconds[-1]:
            if second == self._seconds[-1]:
                self._rows[-1] = row
            return                                     # an older second: the clock never goes back
        if self._seconds:
            previous = self._rows[-1]
            for gap in range(max(self._seconds[-1] + 1, second - self.capacity + 1), second):
                self._seconds.append(gap)
                self._rows.append(previous)
        self._seconds.append(second)
        self._rows.append(row)

    def rows(self, seconds: int | None = None) -> tuple[list[int], list[Row]]:
        """The last `seconds` + 1 rows (all when None): enough for `seconds` per-second differences."""
        n = len(self._rows) if seconds is None else min(len(self._rows), seconds + 1)
        return list(self._seconds)[-n:] if n else [], list(self._rows)[-n:] if n else []


def rates(rows: list[Row], key: str) -> list[float]:
    """Per-second increase of a cumulative column between consecutive rows (never negative)."""
    return [max(0.0, b[key] - a[key]) for a, b in zip(rows, rows[1:])]


def change(rows: list[Row], key: str) -> float:
    """Increase of a cumulative column from the first row to the last."""
    return max(0.0, rows[-1][key] - rows[0][key]) if len(rows) > 1 else 0.0
