"""The in-process engine: the same components as the Ray pipeline, in one process, in order.

It is the oracle the pipeline is checked against (same tokens, same logits to fp32
rounding), and a fine way to run the model on one machine without Ray.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from engramflow.memory.history import SessionHistory
from engramflow.io.tokenizer_file import load_checkpoint_tokenizer
from engramflow.model.backbones import default_backbone, make_backbone, projection_numerics
from engramflow.io.checkpoint import Checkpoint
from engramflow.model.engram_memory import EngramMemory
from engramflow.tiers.config import parse_tiers
from engramflow.pipeline.config import EngineConfig, check_known
from engramflow.pipeline.runner import Runner
from engramflow.pipeline.speculative import check_draft_tokens
from engramflow.model.speculative import drafts_on_stage
from engramflow.model.vision import VisionEncoder, has_vision
from engramflow.pipeline.step import Request, StepResult, Ticket
from engramflow.model.stage_batch import StageRequest, run_stage_batch



class Engine(Runner):
    def __init__(self, config: EngineConfig | str | Path, **options):
        """`config`: an EngineConfig, or a checkpoint and the keywords EngineConfig.build takes
        (`Engine("ckpt", backbone="emulated", block_ms=0)`). Its `numerics`: "batched" (a step's
        sessions share one forward, every row's bits its own) or "official" (per-session
        forwards, bit for bit the official V4.1 code); kernels/sum_order.py."""
        super().__init__()
        if isinstance(config, EngineConfig):
            check_known(options)
        else:
            config = EngineConfig.build(config, **options)
        self.config = config
        checkpoint, self.numerics, self.prefill_chunk = config.checkpoint, config.numerics, config.prefill_chunk
        ckpt = Checkpoint(checkpoint)
        self.backbone = backbone = config.backbone or default_backbone(checkpoint)  # v41 for a V4.1 checkpoint
        self.cfg = ckpt.config
        self.history = SessionHistory.from_checkpoint(ckpt)
        if config.threads is not None:  # process-wide: torch's ops and the C kernels size their work by it
            torch.set_num_threads(config.threads)
        tiers = parse_tiers(config.tiers, self.cfg.engram_layer_ids) if config.tiers else None
        self.memory = EngramMemory(ckpt, threads=config.threads, tiers=tiers,
                                   numerics=projection_numerics(backbone, self.numerics))
        spec, device = config.spec, config.device
        self.stage = make_backbone(backbone, ckpt, range(self.cfg.n_layers), device, config.emulation.block_ms,
                                   dspark=spec is not None, numerics=self.numerics,
                                   exact_rows=spec is not None and spec.exact)
        if spec is not None:
            self.speculative = check_draft_tokens(spec.k, self.stage.dcfg.block_size)
            self.speculative_gate = spec.threshold
        self.tokenizer = load_checkpoint_tokenizer(checkpoint)  # its own tokenizer.json when it ships one
        self._ckpt = ckpt  # the tables read through its mappings
        self.vision = VisionEncoder(ckpt, device) if has_vision(ckpt) else None
        self.vision_cfg = self.vision.cfg if self.vision else None

    def cached_token_bytes(self) -> list[int]:
        """Bytes one cached position costs this (one) stage (token_cost.py: the prefix cache's unit)."""
        from engramflow.model.token_cost import stage_token_bytes

        return stage_token_bytes(self._ckpt, self.backbone, [range(self.cfg.n_layers)], self.speculative is not None)

    def shutdown(self) -> None:
        """Release the projection threads and the checkpoint mappings (like Pipeline.shutdown)."""
        self.memory.close()
        self._ckpt.close()

    def _encode_image(self, image) -> torch.Tensor:
        return self.vision.span_rows(image)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text).ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)

    def _session_op(self, op: str, *args: str) -> None:
        getattr(self.history, op)(*args)
        getattr(self.stage, op)(*args)

    def _submit(self, ticket: Ticket) -> None:
        """In process: the step runs now."""
        ticket.result = self._step(ticket.requests)

    def _step(self, requests: list[Request]) -> StepResult:
        addr = np.concatenate([self.history.append(r.session, r.ids, r.start_pos, r.dead) for r in requests])
        kv = self.memory.project_all(addr)  # SSD-tier layers: all layers' reads in flight together
        out = run_stage_batch(
            self.stage, [StageRequest(r.session, r.start_pos, r.ids.size, r.dead, r.pick, r.images) for r in requests],
            [torch.from_numpy(r.ids) for r in requests], {layer: (lambda kv_l=kv[layer]: kv_l) for layer in kv})
        return StepResult(out.logits, out.exposed_wait_ms, out.spans)

    # -- speculative decoding (pipeline/speculative.py) -----------------------------------------
    def _draft(self, session: str, token: int, start: int, n: int, sampling, stream: int, step: int):
        return self.drafts([(session, token, start, n, sampling, stream, step)])[0]

    def drafts(self, asks: list[tuple]) -> list:
        return drafts_on_stage(self.stage, asks)  # every session's drafts in one forward
