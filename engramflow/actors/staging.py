"""Host → device uploads through reused pinned staging buffers.

A pinned (page-locked) source lets the copy run as DMA without an extra bounce through
pageable memory. Buffers are kept per shape and dtype; before one is refilled, the event of
its previous upload is waited on, so an in-flight copy is never overwritten.

The pool is bounded: prompts of many lengths make many shapes, and pinned pages count in the
process's RSS and cannot be swapped, so at most `max_buffers` buffers and `max_bytes` bytes are
kept (least recently used go first, after their upload has finished). `clear()` drops them all
(the stage actor calls it when its last session closes).
"""
from __future__ import annotations

from collections import OrderedDict

import numpy as np
import torch

MAX_BUFFERS = 16
MAX_BYTES = 256 << 20


class PinnedStaging:
    def __init__(self, device: torch.device, max_buffers: int = MAX_BUFFERS, max_bytes: int = MAX_BYTES):
        self.device = device
        self.max_buffers, self.max_bytes = max_buffers, max_bytes
        self._buffers: OrderedDict[tuple, tuple[torch.Tensor, torch.cuda.Event | None]] = OrderedDict()

    @property
    def pinned_bytes(self) -> int:
        return sum(buf.numel() * buf.element_size() for buf, _ in self._buffers.values())

    def upload(self, array: np.ndarray) -> torch.Tensor:
        array = np.asarray(array)  # often a read-only view of Ray's object store
        if self.device.type != "cuda":
            return torch.tensor(array)  # a private, writable copy
        key = (array.shape, array.dtype.str)
        buf, done = self._buffers.pop(key, (None, None))
        if buf is None:
            if array.nbytes > self.max_bytes:  # too big to keep: a one-off pinned copy
                return torch.from_numpy(array.copy()).pin_memory().to(self.device, non_blocking=False)
            buf = torch.from_numpy(array.copy()).pin_memory()  # made (and filled) on first use
        else:
            if done is not None:
                done.synchronize()  # the previous upload from this buffer has finished
            buf.numpy()[...] = array
        out = buf.to(self.device, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self._buffers[key] = (buf, event)  # most recently used last
        self._evict(keep=key)
        return out

    def _evict(self, keep: tuple | None = None) -> None:
        while len(self._buffers) > self.max_buffers or (len(self._buffers) > 1 and self.pinned_bytes > self.max_bytes):
            key = next(iter(self._buffers))
            if key == keep:
                break
            _, done = self._buffers.pop(key)
            if done is not None:
                done.synchronize()  # never free a buffer a copy still reads

    def clear(self) -> None:
        """Drop every buffer (after its upload has finished)."""
        for _, done in self._buffers.values():
            if done is not None:
                done.synchronize()
        self._buffers.clear()
