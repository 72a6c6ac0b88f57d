"""Engram wkv projection: kv = x @ Wᵀ on host CPUs, key = first hc·dim outputs, value = last dim.

W is [R = dim·(hc+1), C = 6144], kept compact: FP8 E4M3 codes with block scales (150 MiB at
real size) or BF16 (300 MiB); never as a full FP32 copy. With the native kernels, FP8 codes are
re-laid once at load into row groups (`pack_rows`, same bytes, another order) so that the decode
GEMV reads one sequential stream per thread.

Two regimes, chosen by the number of tokens T (docs/architecture.md, "Numerics"):
* decode (T <= decode_max_tokens): memory-bound. The native GEMV (native_kernels.c) streams
  each weight byte once, decodes it in L1 and multiplies it with all T tokens; threads (the
  library's persistent pool in C, kernel_common.h) split the rows. Floor: weight bytes / memory
  bandwidth; on 2 AVX2 cores the E4M3 decode arithmetic is about as slow as that floor.
* prefill: compute-bound. Row tiles of W are decoded to FP32 (exact) and fed to torch's FP32
  GEMM, so each decoded tile is reused across all T tokens. (Torch's BF16 matmul on CPUs
  without native BF16 does not reuse weights and runs ~5x slower.) On CPUs with native BF16
  (AMX / avx512_bf16; there BF16 GEMM is ~2.5x FP32) the input goes to one torch BF16 GEMM
  against a BF16 copy of W made once: when it is BF16, or FP32 holding only BF16 values (decoded
  table rows always do), so the result is the same either way.
Without a C compiler both regimes use the tiled torch path; the numbers agree to fp32 rounding.
"""
from __future__ import annotations

import contextlib
import math
import mmap
from pathlib import Path
from typing import Callable

import torch

from engramflow.errors import EngramflowError
from engramflow.kernels import dense_rows, native, sum_order
from engramflow.kernels.formats import block_shape, e4m3_to_float32, scales_to_float32
from engramflow.kernels.quant import QuantWeight, quant_linear

FP8, BF16 = 0, 1  # weight kinds, as native_kernels.c numbers them
GEMV_GRAIN = 64  # rows a decode thread claims at a time
TILE_ROWS = 512  # prefill tile: 512 x 6144 fp32 = 12 MiB, L3-resident while the GEMM reuses it


def cpu_has_native_bf16() -> bool:
    """AMX-BF16 or AVX512-BF16 in /proc/cpuinfo: then torch's BF16 matmul is fast."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    return "amx_bf16" in flags or "avx512_bf16" in flags


@contextlib.contextmanager
def torch_threads(n: int | None):
    """Run the block with torch using n intra-op threads, then restore the old count."""
    if n is None:
        yield
        return
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


HUGE_PAGE = 2 << 20


def huge_page_bytes(n: int) -> torch.Tensor:
    """n bytes of anonymous memory asking for transparent huge pages (a streamed 150 MiB weight
    then needs 75 TLB entries, not 38,400; measured +2-4 % for the T = 1 GEMV). Where THP is off
    this is ordinary memory. Pages are placed by the first thread that writes them."""
    buf = mmap.mmap(-1, n + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # shared would be shmem
    flat = torch.frombuffer(buf, dtype=torch.uint8)  # holds a reference to buf
    start = -flat.data_ptr() % HUGE_PAGE
    if hasattr(buf, "madvise") and hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            buf.madvise(mmap.MADV_HUGEPAGE, start, n // HUGE_PAGE * HUGE_PAGE)
        except OSError:
            pass  # kernel without THP: 4 KiB pages
    return flat[start:start + n]


def pack_rows(codes: torch.Tensor, group: int = native.PACK_ROWS) -> torch.Tensor:
    """[R, C] uint8 -> the packed layout native_kernels.c reads with g = group:
    [R/group, C/32, group, 32], i.e. each group's rows interleaved 32 bytes at a time."""
    rows, cols = codes.shape
    if rows % group or cols % 32:
        raise EngramflowError(f"pack_rows needs rows % {group} == 0 and cols % 32 == 0, got {rows} x {cols}")
    out = huge_page_bytes(codes.numel()).view(rows // group, cols // 32, group, 32)
    return out.copy_(codes.reshape(rows // group, group, cols // 32, 32).permute(0, 2, 1, 3))


def _has_nan_codes(codes: torch.Tensor) -> bool:
    """E4M3 NaN codes (0x7F / 0xFF) anywhere? Scanned in chunks to keep memory flat."""
    flat = codes.reshape(-1)
    step = 1 << 24
    return any(bool(((flat[i:i + step] & 0x7F) == 0x7F).any()) for i in range(0, flat.numel(), step))


class EngramProjection:
    """One Engram layer's wkv. `project(x)` -> (key [T, hc, dim], value [T, dim]), both fp32.

    threads: decode threads (default torch's count); use_native: None = if it builds, True =
    required, False = torch only; prefill: "auto" | "fp32" | "bf16" tile matmul; decode_max_tokens:
    up to this many tokens take the GEMV; pack: re-lay FP8 codes in 8-row groups (a copy, on
    huge pages, made by the calling process so its pages sit on its NUMA node); results are
    bit-identical either way, only the T = 1 GEMV is ~1.2x faster packed.

    numerics: "fast" computes x @ Wᵀ in fp32 with the kernels above; "official" computes it the
    way DeepSeek's V4.1 code does (kernels/quant.py): rows quantised to FP8 per 32 values, the
    block-scaled GEMM in K-block order, K/V rounded to bf16. The v41 backbone needs the latter:
    its logits move by 10-40% for a one-ulp difference in K/V. "batched" is the same arithmetic
    with every row's bits its own (kernels/sum_order.py): the v41 backbone's default numerics.
    """

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor | None, hc_mult: int, dim: int,
                 threads: int | None = None, use_native: bool | None = None, prefill: str = "auto",
                 decode_max_tokens: int = 64, pack: bool = True, numerics: str = "fast"):
        if weight.ndim != 2:
            raise EngramflowError(f"wkv weight must be 2-D [dim*(hc+1), C], got shape {list(weight.shape)}")
        rows, cols = weight.shape
        if rows != dim * (hc_mult + 1):
            raise EngramflowError(f"wkv weight has {rows} rows, expected dim*(hc_mult+1) = {dim}*{hc_mult + 1} = "
                                  f"{dim * (hc_mult + 1)}")
        if numerics not in ("fast", "official", "batched"):
            raise EngramflowError(f"numerics must be 'fast', 'official' or 'batched', got {numerics!r}")
        if prefill not in ("auto", "fp32", "bf16"):
            raise EngramflowError(f"prefill must be 'auto', 'fp32' or 'bf16', got {prefill!r}")
        if threads is not None and threads < 1:
            raise EngramflowError(f"threads must be >= 1, got {threads}")
        self.hc, self.dim, self.rows, self.cols = hc_mult, dim, rows, cols
        self.threads = threads
        self.decode_max_tokens = min(decode_max_tokens, native.GEMV_MAX_TOKENS)
        weight = weight.detach().cpu()
        if weight.dtype in (torch.uint8, torch.float8_e4m3fn):
            if scale is None:
                raise EngramflowError("an FP8 wkv weight needs its block scale tensor (got scale=None)")
            self.kind = FP8
            self.weight = weight.view(torch.uint8).contiguous()
            self.block = block_shape(weight.shape, scale.shape)
            self.scale = scales_to_float32(scale.detach().cpu()).contiguous()
            # the native decode yields e4m3 * 2^-8, so its scales carry the 2^8 (exact for powers of two)
            self.folded_scale = (self.scale.double() * 256.0).float().contiguous()
            native_ok = (cols % 16 == 0 and self.block[1] % 16 == 0 and not _has_nan_codes(self.weight)
                         and bool(torch.isfinite(self.folded_scale).all()))
        elif weight.dtype == torch.bfloat16:
            if scale is not None:
                raise EngramflowError(f"a BF16 wkv weight takes no scale, got scale of shape {list(scale.shape)}")
            self.kind = BF16
            self.weight = weight.contiguous()
            self.block, self.scale, self.folded_scale = (rows, cols), None, None
            native_ok = cols % 8 == 0
        else:
            raise EngramflowError(f"wkv weight dtype must be FP8 E4M3 (uint8 / float8_e4m3fn) or bfloat16, "
                                  f"got {weight.dtype}")
        lib = native.library() if use_native is not False else None
        if use_native and lib is None:
            raise EngramflowError("use_native=True but the native kernels could not be built on this machine")
        self._lib = lib if native_ok else None
        # packed rows for the T = 1 GEMV's single stream (pack=False keeps row-major, to compare)
        self.group = 1
        if (pack and self._lib is not None and self.kind == FP8 and rows % native.PACK_ROWS == 0
                and cols % 32 == 0 and self.block[1] % 32 == 0 and cols % self.block[1] == 0):
            self.weight, self.group = pack_rows(self.weight), native.PACK_ROWS
        self.native_bf16 = prefill == "bf16" or (prefill == "auto" and cpu_has_native_bf16())
        self._w_bf16: torch.Tensor | None = None  # the BF16 copy of W for native-BF16 prefill, made on first use
        self.official, self.numerics = None, numerics
        if numerics in ("official", "batched"):
            self.official = (QuantWeight.fp8(weight.view(torch.float8_e4m3fn), scale.detach().cpu())
                             if self.kind == FP8 else self.weight)

    @classmethod
    def from_checkpoint(cls, get_tensor: Callable[[str], torch.Tensor], layer_id: int, cfg, **kwargs) -> "EngramProjection":
        """Build from `layers.{l}.engram.wkv.weight` (+ `.scale` for FP8) read via get_tensor(name)."""
        prefix = f"layers.{layer_id}.engram.wkv"
        weight = get_tensor(f"{prefix}.weight")
        expected = [cfg.engram_output_dim, cfg.engram_input_dim]
        if list(weight.shape) != expected:
            raise EngramflowError(f"{prefix}.weight has shape {list(weight.shape)}, config expects {expected}")
        scale = None
        if weight.dtype != torch.bfloat16:
            try:
                scale = get_tensor(f"{prefix}.scale")
            except KeyError:
                raise EngramflowError(f"{prefix}.weight is {weight.dtype} but {prefix}.scale is missing") from None
        return cls(weight, scale, cfg.hc_mult, cfg.dim, **kwargs)

    # ---- public API ---------------------------------------------------------------------------

    @property
    def weight_bytes(self) -> int:
        """Bytes streamed per decode call: the compact weight plus its scales."""
        extra = self.scale.numel() * 4 if self.scale is not None else 0
        return self.weight.numel() * self.weight.element_size() + extra

    @property
    def uses_native(self) -> bool:
        return self._lib is not None

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, C] (fp32 or bf16, CPU) -> key [T, hc, dim] fp32, value [T, dim] fp32."""
        if x.ndim != 2 or x.shape[1] != self.cols:
            raise EngramflowError(f"projection input must be [T, {self.cols}], got shape {list(x.shape)}")
        if not x.is_floating_point():
            raise EngramflowError(f"projection input must be a float tensor, got {x.dtype}")
        x = x.detach().cpu()
        t = x.shape[0]
        kv = torch.empty(t, self.rows, dtype=torch.float32)
        if self.official is not None:
            kv = self._official(x)
        elif t == 0:
            pass
        elif self._lib is not None and t <= self.decode_max_tokens:
            self._decode(x.float().contiguous(), kv)
        else:
            self._prefill(x, kv)
        split = self.hc * self.dim
        # separate contiguous tensors: a view into kv would ship all of kv when pickled to an actor
        return kv[:, :split].reshape(t, self.hc, self.dim).contiguous(), kv[:, split:].contiguous()

    __call__ = project

    def _official(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(torch.bfloat16)
        with torch_threads(self.threads), sum_order.use(self.numerics):
            if isinstance(self.official, QuantWeight):
                return quant_linear(x, self.official, torch.bfloat16).float()
            return dense_rows.linear(x, self.official).float()

    # ---- decode: native GEMV, threads split the rows ---------------------------------------------

    def _n_threads(self) -> int:
        return self.threads or torch.get_num_threads()

    def _native_weight_args(self) -> tuple:
        if self.kind == FP8:
            s = self.folded_scale
            return (FP8, self.weight.data_ptr(), self.cols, self.group, s.data_ptr(), s.shape[1], *self.block)
        return (BF16, self.weight.data_ptr(), self.cols, 1, None, 0, 1, 1)

    def _decode(self, x: torch.Tensor, kv: torch.Tensor) -> None:
        t = x.shape[0]
        n = max(1, min(self._n_threads(), self.rows // GEMV_GRAIN))
        # one call: n - 1 workers of the C library's pool join it (taking the caller's pinning); ctypes drops the GIL
        rc = self._lib.ef_gemv_threads(n, *self._native_weight_args(), x.data_ptr(), self.cols, t, self.cols,
                                       self.rows, kv.data_ptr(), self.rows, GEMV_GRAIN)
        if rc:
            raise RuntimeError(f"ef_gemv rejected T={t}, C={self.cols}")  # guarded above; a bug if seen

    # ---- prefill: decode a row tile to fp32 (exact), reuse it across all tokens --------------------

    def _tile_rows(self) -> int:
        br = self.block[0] if self.kind == FP8 else 1
        return max(br, TILE_ROWS // br * br)  # whole scale blocks per tile

    def _dequant_tile(self, r0: int, r1: int, out: torch.Tensor) -> torch.Tensor:
        """Rows [r0, r1) of W as fp32 [r1-r0, C], exact, written into `out` (reused across tiles:
        a fresh 12 MiB tile per step would cost more in page faults than the decode itself)."""
        tile = out[: r1 - r0]
        if self._lib is not None:
            # in the calling thread: torch's OpenMP workers still spin after each GEMM, and
            # extra decode threads on the same cores would fight them
            if self._lib.ef_dequant_rows(*self._native_weight_args(), self.cols, r0, r1, tile.data_ptr()):
                raise RuntimeError(f"ef_dequant_rows rejected the weight layout (group {self.group})")  # a bug if seen
        elif self.kind == BF16:
            tile.copy_(self.weight[r0:r1])
        else:
            br, bc = self.block
            s = self.scale[r0 // br: math.ceil(r1 / br)]
            vals = e4m3_to_float32(self.weight[r0:r1]).view(-1, br, s.shape[1], bc)
            torch.mul(vals, s[:, None, :, None], out=tile.view(-1, br, s.shape[1], bc))
        return tile

    def _bf16_weight(self) -> torch.Tensor:
        """W as BF16 [R, C] (exact: FP8 times a power of two and BF16 weights are BF16 values), built
        once on the first native-BF16 prefill and kept: one dense BF16 GEMM per call is the best
        matmul such a CPU offers, where decoding tiles per call cost ~30 % of it. Costs R*C*2 bytes
        (300 MiB per layer at real size) on the projection's host, only where BF16 prefill runs."""
        if self._w_bf16 is None:
            w = torch.empty(self.rows, self.cols, dtype=torch.bfloat16)
            step = self._tile_rows()
            tile_buf = torch.empty(step, self.cols, dtype=torch.float32)
            for r0 in range(0, self.rows, step):
                r1 = min(r0 + step, self.rows)
                w[r0:r1].copy_(self._dequant_tile(r0, r1, tile_buf))
            self._w_bf16 = w
        return self._w_bf16

    def _bf16_input(self, x: torch.Tensor) -> torch.Tensor | None:
        """x as BF16 when the BF16 GEMM may take it without changing the result: a BF16 input, or an
        FP32 one whose every value is a BF16 value (decoded table rows always are). Else None."""
        if x.dtype == torch.bfloat16:
            return x.contiguous()
        xb = x.to(torch.bfloat16)
        return xb if torch.equal(xb.float(), x.float()) else None

    def _prefill(self, x: torch.Tensor, kv: torch.Tensor) -> None:
        xb = self._bf16_input(x) if self.native_bf16 else None
        if xb is not None:  # exact: every product of two BF16 values is exact in the FP32 accumulator
            with torch_threads(self.threads):
                kv.copy_(torch.nn.functional.linear(xb, self._bf16_weight()))
            return
        xin = x.float().contiguous()
        step = self._tile_rows()
        tile_buf = torch.empty(step, self.cols, dtype=torch.float32)
        with torch_threads(self.threads):
            for r0 in range(0, self.rows, step):
                r1 = min(r0 + step, self.rows)
                tile = self._dequant_tile(r0, r1, tile_buf)
                kv[:, r0:r1] = torch.mm(xin, tile.t())
