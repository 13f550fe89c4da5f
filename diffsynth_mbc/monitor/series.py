"""A bounded, down-sampled series for drawing an unbounded stream of (step, value) points."""

from __future__ import annotations

import math

MAX_POINTS = 2000  # per rank and series kept for drawing
TREND_POINTS = 24


class Series:
    """At most ``max_points`` buckets of (last x, mean, min, max, count) over an unbounded stream.

    Every bucket but the last holds ``bucket`` samples; when a new bucket would exceed
    ``max_points``, neighbouring buckets are merged in pairs and ``bucket`` doubles, so memory
    stays bounded and adding is amortised O(1).
    """

    __slots__ = ("max_points", "bucket", "x", "mean", "lo", "hi", "n", "count")

    def __init__(self, max_points: int = MAX_POINTS):
        self.max_points = max(2, int(max_points) // 2 * 2)
        self.bucket = 1
        self.x: list[float] = []
        self.mean: list[float] = []
        self.lo: list[float] = []
        self.hi: list[float] = []
        self.n: list[int] = []
        self.count = 0

    def __len__(self) -> int:
        return len(self.x)

    def add(self, x: float, y: float) -> None:
        self.count += 1
        if self.n and self.n[-1] < self.bucket:
            k = self.n[-1]
            self.mean[-1] += (y - self.mean[-1]) / (k + 1)
            self.lo[-1] = min(self.lo[-1], y)
            self.hi[-1] = max(self.hi[-1], y)
            self.n[-1] = k + 1
            self.x[-1] = x
            return
        self.x.append(x)
        self.mean.append(y)
        self.lo.append(y)
        self.hi.append(y)
        self.n.append(1)
        if len(self.x) > self.max_points:
            self._halve()

    def extend(self, xs: list, ys: list) -> None:
        """Same result as ``add`` for each pair, a bucket at a time (sum/min/max run in C)."""
        i, total = 0, len(xs)
        self.count += total
        while i < total:
            if self.n and self.n[-1] < self.bucket:
                k = self.n[-1]
                take = min(self.bucket - k, total - i)
                seg = ys[i:i + take]
                self.mean[-1] = (self.mean[-1] * k + sum(seg)) / (k + take)
                self.lo[-1] = min(self.lo[-1], min(seg))
                self.hi[-1] = max(self.hi[-1], max(seg))
                self.n[-1] = k + take
                self.x[-1] = xs[i + take - 1]
            else:
                take = min(self.bucket, total - i)
                seg = ys[i:i + take]
                self.x.append(xs[i + take - 1])
                self.mean.append(sum(seg) / take)
                self.lo.append(min(seg))
                self.hi.append(max(seg))
                self.n.append(take)
                if len(self.x) > self.max_points:
                    self._halve()
            i += take

    def _halve(self) -> None:
        x, mean, lo, hi, n = [], [], [], [], []
        size = len(self.x)
        for i in range(0, size - 1, 2):
            n1, n2 = self.n[i], self.n[i + 1]
            x.append(self.x[i + 1])
            mean.append((self.mean[i] * n1 + self.mean[i + 1] * n2) / (n1 + n2))
            lo.append(min(self.lo[i], self.lo[i + 1]))
            hi.append(max(self.hi[i], self.hi[i + 1]))
            n.append(n1 + n2)
        if size % 2:
            x.append(self.x[-1])
            mean.append(self.mean[-1])
            lo.append(self.lo[-1])
            hi.append(self.hi[-1])
            n.append(self.n[-1])
        self.x, self.mean, self.lo, self.hi, self.n = x, mean, lo, hi, n
        self.bucket *= 2

    def points(self, since: float | None = None, max_points: int | None = None) -> list[dict]:
        """Buckets with x > since, merged further so that at most ``max_points`` come back."""
        start = 0
        if since is not None:
            start = len(self.x)
            for i, xv in enumerate(self.x):  # x is usually increasing, but not after a restart
                if xv > since:
                    start = i
                    break
        size = len(self.x) - start
        group = 1
        if max_points is not None and max_points > 0 and size > max_points:
            group = math.ceil(size / max_points)
        if group == 1:
            return [{"step": x, "value": m, "min": lo, "max": hi, "n": n}
                    for x, m, lo, hi, n in zip(self.x[start:], self.mean[start:], self.lo[start:], self.hi[start:],
                                               self.n[start:])]
        out = []
        for g in range(start, len(self.x), group):
            end = min(g + group, len(self.x))
            ns = self.n[g:end]
            total = sum(ns)
            out.append({
                "step": self.x[end - 1],
                "value": sum(m * k for m, k in zip(self.mean[g:end], ns)) / total,
                "min": min(self.lo[g:end]),
                "max": max(self.hi[g:end]),
                "n": total,
            })
        return out

    def trend(self, width: int = TREND_POINTS) -> list[float]:
        return [float(f"{p['value']:.6g}") for p in self.points(max_points=width)][-width:]


