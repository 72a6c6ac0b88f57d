"""Shared helpers for the tier tests (no tests here): a small checkpoint and a flaky tier."""
import numpy as np

from ckpt_builders import engram_arrays, write_single
from engramflow.io.checkpoint import Checkpoint
from engramflow.model.synth import synth_config
from engramflow.tiers.source import RowStore, TierUnavailable
from engramflow.tiers.stats import TierStats

SECRET = b"tier-tests-shared-secret-0123456789"


def small_checkpoint(root) -> Checkpoint:
    """The tiny geometry (tables of ~75K rows x 32) with random rows, written as one file."""
    cfg = synth_config("tiny")
    write_single(root, cfg.to_dict(), engram_arrays(cfg, rng=np.random.default_rng(7)))
    return Checkpoint(root)


class Flaky(RowStore):
    """Wraps a source; the next `fail` gathers raise TierUnavailable (a tier that is down)."""

    def __init__(self, inner: RowStore, fail: int = 0, name: str = "flaky"):
        self.inner, self.fail = inner, fail
        self.rows, self.head_dim, self.name = inner.rows, inner.head_dim, name
        self.stats = TierStats(name)
        self.calls = 0

    def _gather(self, ids):
        self.calls += 1
        if self.fail:
            self.fail -= 1
            raise TierUnavailable(f"{self.name} is down")
        return self.inner._fetch(ids)
