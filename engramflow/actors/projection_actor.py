"""EngramProjectionActor: one per NUMA node that holds tables.

A thin Ray wrapper over `EngramMemory`. Its threads are pinned to the package's selected
cores, and it serves its layers concurrently (a threaded actor: torch releases the GIL in the
lookup and the GEMM), so L1 and L14 of one step do not queue behind each other.
"""
from __future__ import annotations

import os
import time

import numpy as np
import ray
import torch

from engramflow.actors.init_guard import keep_init_error
from engramflow.actors.topology import pin_process
from engramflow.io.checkpoint import Checkpoint
from engramflow.model.engram_memory import EngramMemory
from engramflow.model.engram_rows import EngramRows
from engramflow.model.projection_calibration import CALIBRATION_TOKENS, measure
from engramflow.tiers.config import TiersConfig
from engramflow.timeline import SpanRecorder


@ray.remote
@keep_init_error
class EngramProjectionActor:
    def __init__(self, checkpoint: str, layer_ids: list[int], cpus: list[int] | None = None,
                 warmup: bool = False, delay_ms: dict[int, float] | None = None, tiers: TiersConfig | dict | None = None,
                 numerics: str = "fast", threads: int | None = None):
        if cpus:
            pin_process(cpus)
        threads = threads or (len(cpus) if cpus else max(1, len(os.sched_getaffinity(0))))  # the run's, else its cores
        torch.set_num_threads(threads)
        self.memory = EngramMemory(Checkpoint(checkpoint), layer_ids, threads=threads, warmup=warmup, tiers=tiers,
                                   numerics=numerics)
        self.spans = SpanRecorder(f"engram[{','.join(map(str, layer_ids))}]")
        self.delay_s = {l: ms / 1e3 for l, ms in (delay_ms or {}).items()}  # slowdowns for overlap experiments

    def project(self, layer_id: int, addresses: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        with self.spans.span(f"project L{layer_id}", layer=layer_id, tokens=int(addresses.shape[0])):
            key, value = self.memory.project(layer_id, addresses)
            if self.delay_s.get(layer_id):
                time.sleep(self.delay_s[layer_id])
        return key.numpy(), value.numpy()

    def rows(self, layer_id: int, addresses: np.ndarray) -> EngramRows:
        """The addressed rows as stored (MXFP8): the stage projects them (projection="stage")."""
        with self.spans.span(f"rows L{layer_id}", layer=layer_id, tokens=int(addresses.shape[0])):
            rows = self.memory.rows(layer_id, addresses)
            if self.delay_s.get(layer_id):
                time.sleep(self.delay_s[layer_id])
        return rows

    def calibrate(self, tokens: int = CALIBRATION_TOKENS) -> dict:
        """This actor's projection rate (model.projection_calibration.measure) on its first layer."""
        proj = self.memory.projections[self.memory.layer_ids[0]]
        xs = {}

        def run(t: int):
            if t not in xs:
                xs[t] = torch.randn(t, proj.cols, generator=torch.Generator().manual_seed(t)).bfloat16()
            return proj.project(xs[t])
        return measure(run, tokens)

    def payload(self, nbytes: int) -> np.ndarray:
        """n bytes, to time the link from here to a stage (placement calibration)."""
        return np.ones(int(nbytes), dtype=np.uint8)

    def drain_spans(self) -> list[dict]:
        return self.spans.drain()

    def where(self) -> dict:
        return {"node_id": ray.get_runtime_context().get_node_id(), "pid": os.getpid(),
                "cpus": sorted(os.sched_getaffinity(0)), "layers": list(self.memory.layer_ids)}
