"""Weighted mixtures of sources: which source each training sample reads (`Mixture`), and the
mixture's rows (`MixedRows`), each source with its own windows and epochs."""

from __future__ import annotations

import fractions
import math
from collections.abc import Sequence

import numpy as np


class Mixture:
    """Which source each training sample of a weighted mixture comes from: a deterministic
    schedule with random access (sample i's source needs no scan of samples 0..i-1).

    The samples are cut into blocks of K = ceil(1 / smallest normalized weight). Source s's
    samples before block b, C_s(b), are the largest-remainder apportionment of the b * K
    samples by the weights (ties go to the source whose turn it is, a rotation by b), so
    |C_s(b) - w_s * b * K| < 1 at every block boundary: the mixture meets its weights to within
    one sample per source, however long it runs. Block b holds C_s(b + 1) - C_s(b) samples of
    each source (w_s * K rounded down or up, give or take one) in a seeded order; the k-th of
    source s's slots in block b is that source's own sample C_s(b) + k. Each source thus reads
    its own rows 0, 1, 2, ... (its own epochs) at its own rate. Weights (0.6, 0.25, 0.15) give
    K = 7; the first blocks (one row each, A/B/C = sources 0/1/2, slots in seeded order):

        block 0   B A C A A B A      C(1) = 4 2 1    (quotas  4.2  1.75 1.05)
        block 1   C B A A A A B      C(2) = 8 4 2    (quotas  8.4  3.5  2.1)
        block 2   B A A C A A A      C(3) = 13 5 3   (quotas 12.6  5.25 3.15)

    >>> mixture = Mixture((0.6, 0.25, 0.15), seed=0)
    >>> mixture.block, mixture.counts(7).tolist(), mixture.counts(70).tolist()
    (7, [4, 2, 1], [42, 18, 10])
    """

    def __init__(self, weights: Sequence[float], seed: int):
        exact = [fractions.Fraction(w) for w in weights]
        if not exact or any(w <= 0 for w in exact):
            raise ValueError(f"weights={[float(w) for w in weights]}: expected at least one "
                             "weight, each > 0")
        total = sum(exact)
        if min(exact) / total < fractions.Fraction(1, 2**20):
            raise ValueError(f"weights={[float(w) for w in weights]}: the smallest is "
                             f"{float(min(exact) / total):.2e} of the total: expected at "
                             "least 2**-20")
        weights = [w.limit_denominator(2**20) for w in exact]  # 0.6 as 3/5, not its float
        if any(abs(r / sum(weights) - w / total) > w / total / 10**6
               for r, w in zip(weights, exact, strict=True)):
            # weights so small that rounding each alone moved their ratios (1e-6 -> 1/2**20):
            # the normalized ones, rounded
            weights = [(w / total).limit_denominator(2**20) for w in exact]
        # Integer weights m_s (exact arithmetic: float quotas drift on long runs).
        denominator = math.lcm(*(w.denominator for w in weights))
        self._m = [int(w * denominator) for w in weights]
        self._total = sum(self._m)
        # K * w_s >= 1 for every s keeps C_s(b) non-decreasing (no source loses a sample).
        self.block = -(-self._total // min(self._m))
        self.weights = np.array(self._m) / self._total
        self.seed = seed
        self._cached: tuple[int, np.ndarray, np.ndarray] = (-1, np.zeros(0), np.zeros(0))

    def _before(self, b: int) -> np.ndarray:
        """C(b): each source's samples in blocks 0..b-1 (largest remainder over b * K)."""
        n = b * self.block
        quotas = [divmod(m * n, self._total) for m in self._m]  # Python ints: exact
        counts = np.array([whole for whole, _ in quotas], np.int64)
        left = n - int(counts.sum())  # in [0, S): the seats the remainders share
        sources = len(self._m)
        ranked = sorted(range(sources), key=lambda s: (-quotas[s][1], (s - b) % sources))
        counts[ranked[:left]] += 1
        return counts

    def _layout(self, b: int) -> tuple[np.ndarray, np.ndarray]:
        """Block b's slots: (source [K], that source's own sample index [K])."""
        if self._cached[0] != b:
            first = self._before(b)
            per_source = self._before(b + 1) - first
            rng = np.random.default_rng((self.seed, _MIXTURE_STREAM, b))
            source = rng.permutation(np.repeat(np.arange(len(first)), per_source))
            local = np.empty(self.block, np.int64)
            for s in range(len(first)):
                slots = np.flatnonzero(source == s)
                local[slots] = first[s] + np.arange(len(slots))
            self._cached = (b, source, local)
        return self._cached[1], self._cached[2]

    def locate(self, i: int) -> tuple[int, int]:
        """Global sample i -> (its source, that source's own sample index)."""
        b, j = divmod(int(i), self.block)
        source, local = self._layout(b)
        return int(source[j]), int(local[j])

    def counts(self, n: int) -> np.ndarray:
        """Each source's samples among global samples 0..n-1: [S] int64, in closed form."""
        b, j = divmod(int(n), self.block)
        counts = self._before(b)
        if j:
            counts += np.bincount(self._layout(b)[0][:j], minlength=len(counts))
        return counts


_MIXTURE_STREAM = 0x6D6978  # "mix": keeps the block orders' seeds apart from the epochs'


class MixedRows:
    """A mixture's rows: sample i is row `Mixture.locate(i)` of that source's rows."""

    def __init__(self, sources: Sequence, mixture: Mixture):
        self.sources, self.mixture = list(sources), mixture
        self.rows = min(source.rows for source in self.sources)

    def row(self, i: int) -> dict[str, np.ndarray]:
        source, local = self.mixture.locate(i)
        return self.sources[source].row(local)
