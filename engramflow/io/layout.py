"""Engram table layout: hash multipliers, per-column primes and row offsets (docs/v41.md, "Engram").

For each Engram layer there are (max_ngram − 1) n-gram sizes × n_heads columns; column c owns
rows [offset[c], offset[c] + prime[c]) of the layer's table.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from engramflow.errors import EngramflowError
from engramflow.io.config import ModelConfig

_INT64_MAX = np.iinfo(np.int64).max
# Deterministic Miller-Rabin witnesses: exact for every n < 3.3e24.
_WITNESSES = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41)


def is_prime(n: int) -> bool:
    if n < 2:
        return False
    for p in _WITNESSES:
        if n % p == 0:
            return n == p
    d, r = n - 1, 0
    while d % 2 == 0:
        d, r = d // 2, r + 1
    for a in _WITNESSES:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(r - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


def next_prime(after: int, seen: set[int]) -> int:
    """The smallest prime > `after` not in `seen`."""
    n = after + 1
    while not (is_prime(n) and n not in seen):
        n += 1
    return n


@dataclasses.dataclass(frozen=True)
class EngramLayout:
    layer_ids: tuple[int, ...]
    max_ngram: int
    n_heads: int
    multipliers: np.ndarray  # int64 [n_layers, max_ngram]
    primes: np.ndarray  # int64 [n_layers, columns], n-gram major, head minor
    offsets: np.ndarray  # int64 [n_layers, columns], exclusive cumulative sum of primes

    @property
    def columns(self) -> int:
        return self.primes.shape[1]

    @property
    def rows_needed(self) -> np.ndarray:
        """Minimum table rows per layer: the sum of its primes."""
        return self.primes.sum(axis=1)

    def layer_index(self, layer_id: int) -> int:
        if layer_id not in self.layer_ids:
            raise EngramflowError(f"layer {layer_id} is not an Engram layer (Engram layers: {list(self.layer_ids)})")
        return self.layer_ids.index(layer_id)

    def check_rows(self, layer_id: int, rows: int, where: str = "table") -> None:
        need = int(self.rows_needed[self.layer_index(layer_id)])
        if rows < need:
            raise EngramflowError(
                f"{where}: Engram layer {layer_id} table has {rows} rows, fewer than the layout's prime sum {need}")


def multipliers_for(layer_id: int, max_ngram: int, compressed_vocab: int) -> np.ndarray:
    bound = max(1, (_INT64_MAX // compressed_vocab) // 2)
    rng = np.random.default_rng(10007 * layer_id)
    return rng.integers(0, bound, size=max_ngram, dtype=np.int64) * 2 + 1


def build_layout(cfg: ModelConfig) -> EngramLayout:
    seen: set[int] = set()
    primes = []
    for _ in cfg.engram_layer_ids:
        layer = []
        for _ngram in range(2, cfg.engram_max_ngram_size + 1):
            cur = cfg.engram_vocab_size - 1
            for _head in range(cfg.engram_n_heads):
                cur = next_prime(cur, seen)
                seen.add(cur)
                layer.append(cur)
        primes.append(layer)
    primes = np.array(primes, dtype=np.int64)
    offsets = np.zeros_like(primes)
    offsets[:, 1:] = np.cumsum(primes, axis=1)[:, :-1]
    mult = np.stack([multipliers_for(l, cfg.engram_max_ngram_size, cfg.engram_compressed_vocab_size)
                     for l in cfg.engram_layer_ids])
    return EngramLayout(tuple(cfg.engram_layer_ids), cfg.engram_max_ngram_size, cfg.engram_n_heads,
                        mult, primes, offsets)
