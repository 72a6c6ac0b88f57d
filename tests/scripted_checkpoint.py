"""A copy of a reference-backbone checkpoint whose weights make greedy decoding write a chosen
completion after a chosen prompt: a real model (real Engram lookup, projection, gate, blocks,
head) whose Engram memory holds the script. It lets the live-server tests force a multi-token
completion, such as a DSML tool-call block, that a static logit_bias cannot: the block repeats
tokens with different successors, while Engram addresses 4-grams, which differ at every step.

How (docs/architecture.md, "Backbones"; the reference backbone adds Engram at layer 1's entry):
  * layer 1's wkv is rewritten so the value is two 4-gram heads' rows side by side (dim 64) and
    the key is zero (the gate is then sigmoid(~0) = 0.5 for every stream);
  * at each position that must predict token c, those two rows hold +-256 in the signs of
    Hadamard row i(c): the residual stream becomes 128 * H[i(c)] plus O(1) from everything else;
  * the head row of c is H[i(c)] / 2, so c's logit is ~32 and every other scripted token's ~0
    (Hadamard rows are orthogonal); unscripted tokens keep their O(1) logits;
  * layer 14's wkv is zeroed (its value would add a second, unscripted term).
Two of the eight 4-gram heads are picked so that no two positions wanting different tokens
share a row; the script fails loudly if no pair works.
"""
from __future__ import annotations

import itertools
import shutil
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from engramflow.io.checkpoint import Checkpoint
from engramflow.memory.history import SessionHistory

E4M3_ONE, E4M3_256, E8M0_ONE = 0x38, 0x78, 127  # 1.0, 256.0 (0x80 | code: negative); scale 2^0


def hadamard(n: int) -> np.ndarray:
    h = np.ones((1, 1), dtype=np.float32)
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h


def _pick_heads(addr: np.ndarray, wants: dict[int, int], first: int, heads: int) -> tuple[int, int]:
    """Two 4-gram columns where each addressed row is wanted for one token only."""
    def clean(col):
        seen = {}
        return all(seen.setdefault(int(addr[p, col]), tok) == tok for p, tok in wants.items())
    for a, b in itertools.combinations(range(first, first + heads), 2):
        if clean(a) and clean(b):
            return a, b
    raise ValueError("no two 4-gram heads keep the scripted steps apart: the completion repeats a 4-gram with "
                     "another next token, or rows collide")


def script_checkpoint(src: Path, dst: Path, prompt: list[int], completion: list[int]) -> Path:
    """Write to dst a copy of src that greedily continues `prompt` with `completion`."""
    shutil.copytree(src, dst)
    ckpt = Checkpoint(dst)
    cfg = ckpt.config
    if cfg.dim != 64 or cfg.engram_head_dim * 2 != cfg.dim:
        raise ValueError("the script needs dim 64 = two Engram heads (the tiny preset)")
    history = SessionHistory.from_checkpoint(ckpt)
    session = history.open()
    seq = list(prompt) + list(completion)
    addr = history.append(session, np.asarray(seq, dtype=np.int64))[:, cfg.engram_layer_ids.index(1)]
    wants = {p: seq[p + 1] for p in range(len(prompt) - 1, len(seq) - 1)}  # position -> its next token
    first4 = (cfg.engram_max_ngram_size - 2) * cfg.engram_n_heads  # columns: 2-grams, 3-grams, 4-grams
    cols = _pick_heads(addr, wants, first4, cfg.engram_n_heads)
    tokens = sorted(set(completion))
    h = hadamard(cfg.dim)
    if len(tokens) >= cfg.dim:
        raise ValueError(f"{len(tokens)} distinct tokens; the script holds at most {cfg.dim - 1}")
    sign = {tok: h[i + 1] for i, tok in enumerate(tokens)}  # row 0 (all ones) left out

    for path in sorted(dst.glob("*.safetensors")):
        tensors = load_file(path)
        changed = False
        for key, t in tensors.items():
            if key == "layers.1.engram.embed.weight":
                codes = t.view(torch.uint8).clone()
                for p, tok in wants.items():
                    for half, col in enumerate(cols):
                        s = sign[tok][32 * half:32 * (half + 1)]
                        codes[int(addr[p, col])] = torch.from_numpy(np.where(s > 0, E4M3_256, 0x80 | E4M3_256)
                                                                    .astype(np.uint8))
                tensors[key] = codes.view(torch.float8_e4m3fn)
            elif key == "layers.1.engram.embed.scale":
                scales = t.view(torch.uint8).clone()
                for p in wants:
                    for col in cols:
                        scales[int(addr[p, col])] = E8M0_ONE
                tensors[key] = scales.view(torch.float8_e8m0fnu)
            elif key.endswith(".engram.wkv.weight"):
                w = torch.zeros(t.shape, dtype=torch.uint8)
                if key == "layers.1.engram.wkv.weight":
                    split = cfg.hc_mult * cfg.dim  # rows: key [hc * dim], then value [dim]
                    for d in range(cfg.dim):
                        w[split + d, 32 * cols[d // 32] + d % 32] = E4M3_ONE
                tensors[key] = w.view(torch.float8_e4m3fn)
            elif key.endswith(".engram.wkv.scale"):
                tensors[key] = torch.full(t.shape, E8M0_ONE, dtype=torch.uint8).view(torch.float8_e8m0fnu)
            elif key == "head.weight":
                head = t.clone()
                for tok in tokens:
                    head[tok] = torch.from_numpy(sign[tok] / 2).to(head.dtype)
                tensors[key] = head
            else:
                continue
            changed = True
        if changed:
            save_file(tensors, path, metadata={"format": "pt"})
    return dst
