"""Quantiles from Prometheus histogram buckets, computed the way PromQL's histogram_quantile does, so the
dashboard and a Grafana panel over the same /metrics agree; and one pass over a registry's samples."""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from prometheus_client import CollectorRegistry


@dataclass(frozen=True)
class Buckets:
    """Cumulative counts per upper bound; the last bound is +Inf."""
    bounds: tuple[float, ...]
    counts: tuple[float, ...]

    def minus(self, earlier: "Buckets") -> "Buckets":
        """The observations made between `earlier` and this snapshot."""
        return Buckets(self.bounds, tuple(a - b for a, b in zip(self.counts, earlier.counts)))

    @property
    def total(self) -> float:
        return self.counts[-1] if self.counts else 0.0


def histogram_quantile(q: float, buckets: Buckets) -> float | None:
    """Linear interpolation inside the bucket holding rank q * total (the lowest bucket starts at 0); a rank
    in the +Inf bucket answers the highest finite bound. None without observations."""
    if not 0.0 <= q <= 1.0:
        raise ValueError("q must be in [0, 1]")
    bounds, counts = buckets.bounds, buckets.counts
    total = buckets.total
    if total <= 0 or len(bounds) < 2 or not math.isinf(bounds[-1]):
        return None
    rank = q * total
    i = next(i for i, c in enumerate(counts) if c >= rank)
    if i == len(bounds) - 1:
        return bounds[-2]
    start, before = (0.0, 0.0) if i == 0 else (bounds[i - 1], counts[i - 1])
    if i == 0 and bounds[0] <= 0:
        return bounds[0]
    in_bucket = counts[i] - before
    if in_bucket <= 0:
        return bounds[i]
    return start + (bounds[i] - start) * (rank - before) / in_bucket


def summary(buckets: Buckets, qs: Sequence[float] = (0.5, 0.9, 0.99)) -> dict[str, float | None]:
    out: dict[str, float | None] = {f"p{round(q * 100)}": histogram_quantile(q, buckets) for q in qs}
    out["count"] = buckets.total
    return out


def read_registry(registry: CollectorRegistry) -> tuple[dict[str, float], dict[str, Buckets]]:
    """Every sample once: plain values keyed `name` or `name{label values}` (model_name left out), and
    histograms' buckets keyed by the histogram's name."""
    values: dict[str, float] = {}
    buckets: dict[str, list[tuple[float, float]]] = {}
    for family in registry.collect():
        for s in family.samples:
            if s.name.endswith("_bucket") and "le" in s.labels:
                buckets.setdefault(family.name, []).append((float(s.labels["le"]), s.value))
                continue
            extra = ",".join(v for k, v in sorted(s.labels.items()) if k != "model_name")
            values[s.name + (f"{{{extra}}}" if extra else "")] = s.value
    hists = {name: Buckets(*map(tuple, zip(*sorted(pairs)))) for name, pairs in buckets.items()}
    return values, hists
