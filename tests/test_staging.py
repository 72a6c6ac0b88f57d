"""Pinned staging uploads (the stage actors' host -> GPU path)."""
import numpy as np
import pytest
import torch

from engramflow.actors.staging import PinnedStaging


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_pinned_staging_uploads_exact_values_and_reuses_buffers():
    staging = PinnedStaging(torch.device("cuda"))
    a, b = np.random.rand(7, 4, 64).astype(np.float32), np.random.rand(7, 4, 64).astype(np.float32)
    ga, gb = staging.upload(a), staging.upload(b)  # same shape: the second waits for the first
    assert torch.equal(ga.cpu(), torch.from_numpy(a)) and torch.equal(gb.cpu(), torch.from_numpy(b))
    assert len(staging._buffers) == 1


def test_staging_on_cpu_returns_a_private_copy():
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    a.setflags(write=False)  # like a zero-copy Ray buffer
    t = PinnedStaging(torch.device("cpu")).upload(a)
    t += 1  # must not touch the read-only source
    assert np.array_equal(a, np.arange(12, dtype=np.float32).reshape(3, 4))
