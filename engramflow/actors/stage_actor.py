"""BackboneStageActor: one per GPU (CPU when there is none), owning blocks [a, b).

K/V refs arrive *nested* ({layer: [ref]}) so Ray does not wait for them before the call
starts; each is resolved with ray.get only when the forward reaches its Engram block, and the
time spent there is the exposed wait.
"""
from __future__ import annotations

import gc
import os
import time

import ray
import torch

from engramflow.actors.init_guard import keep_init_error
from engramflow.actors.session_ops import MemoryReleaser, apply_session_op, freeze_long_lived, rss_bytes, sync_sessions
from engramflow.actors.staging import PinnedStaging
from engramflow.errors import EngramflowError
from engramflow.io.checkpoint import Checkpoint
from engramflow.model.backbones import make_backbone, projection_numerics
from engramflow.model.stage_batch import StageRequest, from_wire, run_stage_batch, to_wire
from engramflow.model.engram_rows import EngramRows, kv_nbytes
from engramflow.model.projection_calibration import CALIBRATION_TOKENS, measure, random_rows
from engramflow.model.speculative import drafts_on_stage
from engramflow.model.stage_projection import StageProjector
from engramflow.model.vision import VisionEncoder, has_vision
from engramflow.timeline import SpanRecorder


def _image_rows(rows):
    return ray.get(rows) if isinstance(rows, ray.ObjectRef) else rows


@ray.remote
@keep_init_error
class BackboneStageActor:
    def __init__(self, checkpoint: str, blocks: tuple[int, int], backbone: str = "reference",
                 block_ms: float = 1.0, stage_projection: bool = False, speculative: tuple | None = None,
                 numerics: str | None = None, threads: int | None = None):
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        if self.device.type == "cpu":
            # Ray sets OMP_NUM_THREADS=1 in an actor asking for no CPUs; a CPU stage computes with the
            # cores it may use (or the run's `threads`), as the in-process Engine does. (fp32 GEMMs sum
            # in a thread-dependent order, and the V4.1 model's re-quantisation turns one last bit
            # into another token.)
            torch.set_num_threads(threads or max(1, len(os.sched_getaffinity(0))))
        ckpt = Checkpoint(checkpoint)
        self.stage = make_backbone(backbone, ckpt, range(*blocks), self.device, block_ms, dspark=speculative is not None,
                                   numerics=numerics, exact_rows=speculative is not None and speculative[1])
        # the wkv of this stage's Engram layers, when it may be sent rows to project (projection != "host")
        self.projector = (StageProjector(ckpt.tensor, ckpt.config, self.stage.engram_layers, self.device,
                                         projection_numerics(backbone, numerics))
                          if stage_projection and self.stage.engram_layers else None)
        # the first stage of a checkpoint with a vision tower also encodes images (docs/vision.md)
        self.vision = VisionEncoder(ckpt, self.device) if self.stage.first and has_vision(ckpt) else None
        ckpt.close()  # the backbone copied its weights; keep no mappings open
        self.spans = SpanRecorder(f"stage[{blocks[0]},{blocks[1]})")
        self.staging = PinnedStaging(self.device)
        self.releaser = MemoryReleaser(on_empty=self._drop_buffers)
        freeze_long_lived()

    def encode(self, image) -> torch.Tensor:
        """A PreparedImage -> its span rows (bf16, CPU): the task's result is the object ref the
        step that writes the image resolves."""
        if self.vision is None:
            raise EngramflowError("this pipeline's checkpoint has no vision tower: it takes no images")
        return self.vision.span_rows(image)

    def _fetch(self, layer: int, ref_box: list, moved: dict[int, int]):
        """ray.get the layer's payload: projected (key, value), uploaded to the stage's device; or
        rows (EngramRows), decoded and projected here. Counts the bytes that arrived."""
        payload = ray.get(ref_box[0])
        now = time.time_ns()
        if isinstance(payload, EngramRows):
            moved[layer] = moved.get(layer, 0) + payload.nbytes
            self.spans.add(f"bytes L{layer}", now, now, layer=layer, bytes=payload.nbytes, placement="stage")
            if self.projector is None:
                raise EngramflowError(f"stage {self.stage.blocks.start}..{self.stage.blocks.stop} was sent rows for "
                                      f"layer {layer} but holds no wkv (launched with projection='host')")
            with self.spans.span(f"project L{layer} (stage)", layer=layer, tokens=payload.tokens,
                                 bytes=payload.nbytes):
                return self.projector.project(layer, payload)
        key, value = payload
        moved[layer] = moved.get(layer, 0) + kv_nbytes(key, value)
        self.spans.add(f"bytes L{layer}", now, now, layer=layer, bytes=kv_nbytes(key, value), placement="host")
        return self.staging.upload(key), self.staging.upload(value)

    def calibrate(self, tokens: int = CALIBRATION_TOKENS) -> dict | None:
        """This stage's projection rate (rows decoded and projected here), or None without wkv."""
        if self.projector is None:
            return None
        layer, cfg = self.projector.layers[0], self.projector.cfg
        rows = {}
        sync = torch.cuda.synchronize if self.device.type == "cuda" else None

        def run(t: int):
            if t not in rows:
                rows[t] = random_rows(t, cfg.engram_columns, cfg.engram_head_dim, seed=t)
            return self.projector.project(layer, rows[t])
        return measure(run, tokens, sync=sync)

    def fetch_probe(self, ref_box: list) -> int:
        """ray.get a payload (placement calibration times the whole hop from the driver)."""
        value = ray.get(ref_box[0])
        return int(getattr(value, "nbytes", 0))

    def session_op(self, op: str, *args: str) -> None:
        apply_session_op(self.stage, lambda s: s in self.stage.cache, op, args)
        if op in ("close", "reset"):  # their buffers are garbage now: give the memory back
            self.releaser.closed(self.stage.live_sessions())

    def session_ops(self, ops: list) -> None:
        """Several (op, args) in order: the driver's deferred ones, in one call (or with a step)."""
        for op, args in ops:
            self.session_op(op, *args)

    def sessions(self) -> list[str]:
        return self.stage.cache.sessions()

    def sync_sessions(self, wanted: list[str]) -> dict:
        """Hold exactly `wanted`, all empty (the driver's log; it replays their writes next)."""
        out = sync_sessions(self.stage, self.sessions(), wanted)
        if out["closed"] or not wanted:
            self.releaser.closed(self.stage.live_sessions())
        return out

    def _drop_buffers(self) -> None:
        self.staging.clear()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def rss(self) -> dict:
        """Resident memory of this actor's process (and the GPU memory torch holds, if any)."""
        out = {"pid": os.getpid(), "rss_bytes": rss_bytes(), "live_sessions": self.stage.live_sessions(),
               "pinned_bytes": self.staging.pinned_bytes, "frozen_objects": gc.get_freeze_count()}
        if self.device.type == "cuda":
            out |= {"cuda_allocated": torch.cuda.memory_allocated(), "cuda_reserved": torch.cuda.memory_reserved()}
        return out

    def forward_batch(self, reqs: list[StageRequest], x, kv_refs: dict[int, list], ops: list = ()) -> dict:
        """x: token id arrays (first stage) or the previous stage's output dict. Hidden states
        travel as numpy (`to_wire`); the last stage returns per request the fp32 logits, or just
        the Picked its request asked for (a token instead of the vocabulary). `ops`: session ops
        made since the last step, applied first (they ride with the step: no call of their own)."""
        called_ns = time.time_ns()  # the "call" span: this stage's whole work (profiling/hops.py)
        self.session_ops(ops)
        waits = dict(x["waits"]) if isinstance(x, dict) else {}
        xs = [from_wire(v, self.device) for v in (x["hs"] if isinstance(x, dict) else x)]
        moved = dict(x["bytes"]) if isinstance(x, dict) and "bytes" in x else {}
        kv = {layer: (lambda layer=layer, box=box: self._fetch(layer, box, moved)) for layer, box in kv_refs.items()}
        out = run_stage_batch(self.stage, reqs, xs, kv, fetch=_image_rows)
        waits |= out.exposed_wait_ms
        for session, spans in out.spans:
            for s in spans:
                self.spans.add(f"block {s.block}", s.start_ns, s.end_ns, session=session)
                if s.wait_ms:
                    self.spans.add(f"wait L{s.block}", s.start_ns, s.start_ns + int(s.wait_ms * 1e6),
                                   session=session, layer=s.block)
        hs = None if out.hs is None else [to_wire(h) for h in out.hs]
        self.spans.add("call", called_ns, time.time_ns(), requests=len(reqs))
        return {"hs": hs, "logits": out.logits, "waits": waits, "bytes": moved}

    def drafts(self, asks: list[tuple]):
        """Last stage: DSpark drafts of several sessions in one forward (model/speculative.py)."""
        return drafts_on_stage(self.stage, asks)

    def drain_spans(self) -> list[dict]:
        return self.spans.drain()

    def stats(self) -> dict:
        return {"live_sessions": self.stage.live_sessions(), "cached_positions": self.stage.cached_positions()}

    def where(self) -> dict:
        return {"node_id": ray.get_runtime_context().get_node_id(), "pid": os.getpid(),
                "device": str(self.device), "blocks": [self.stage.blocks.start, self.stage.blocks.stop]}
