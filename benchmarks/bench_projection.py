"""Engram wkv projection at real size (25,600 x 6,144, FP8 E4M3 + E8M0 [128,128] block scales),
T in {1, 8, 32, 128, 512, 2048}, against baselines measured in the same run: read bandwidth of
a 1 GiB array, FP32 GEMM of the same shape (T=512) and the naive `x.bfloat16() @ W.t()` (BF16).
Prefill (T >= 512) is also compared with the best dense matmul this CPU offers on the same shape:
max(torch FP32, torch BF16) at T=512, for BF16 input and for FP32 input (holding BF16 values, as
decoded table rows do), target >= 0.85.
Also MXFP8 gather+decode per token (48 rows: 24 columns x 2 layers) from a hot table.
"Official" numerics (quant_linear: the native block-scaled kernel, bit-equal to the V4.1 code) on
the same wkv (scales as 32 x 32 tiles) at T = 1 .. 2048, each against its roof line
roof_ms = max(weight bytes / read bandwidth, 2*T*N*K / best dense FLOP/s), both measured here.
--official-only: just those rows at T = 1 .. 64 against the roof of their own arithmetic,
max(weight bytes / read bandwidth, 2*T*N*K / fp32 FMA rate) (the ebs_fma_gflops probe), read
bandwidth and FMA rate measured in the same run before and after the rows: a quick A/B of the
kernel."""
from __future__ import annotations

import statistics

import numpy as np
import torch

from common import parser, print_machine, print_table, timed, write_json
from engramflow.kernels import block_scaled_lib, mxfp8, native
from engramflow.kernels.formats import dequant_blocks
from engramflow.kernels.quant import QuantWeight, quant_linear
from engramflow.kernels.projection import EngramProjection
from engramflow.io.presets import preset


def best(fn, repeat: int) -> float:
    fn()  # warm: first-touch of outputs, thread pools
    return min(timed(fn, repeat))


def fp8_weight(rows: int, cols: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 256, (rows, cols), dtype=torch.uint8, generator=g)
    codes[(codes & 0x7F) == 0x7F] = 0x7E  # no NaN codes, as in a real checkpoint
    scale = torch.randint(115, 123, (rows // 128, cols // 128), dtype=torch.uint8, generator=g)
    return codes, scale


def read_gbps(a: torch.Tensor, repeat: int) -> float:
    """1 GiB of initialized fp32, summed by torch (all threads): what a stream of weights can get."""
    return a.numel() * 4 / best(lambda: a.sum(), repeat) / 1e9


def decode_vs_read(proj: EngramProjection, cols: int, rounds: int) -> tuple[float, float, list[float]]:
    """T = 1 seconds and read GB/s, measured in alternating rounds (this VM's bandwidth drifts by
    10 % within seconds); each the best over all rounds, plus each round's own ratio."""
    a = torch.ones(1 << 28)
    x = torch.randn(1, cols)
    secs, bws, ratios = [], [], []
    for _ in range(rounds):
        bws.append(read_gbps(a, 3))
        secs.append(best(lambda: proj.project(x), 5))
        ratios.append(proj.weight_bytes / secs[-1] / 1e9 / bws[-1])
    return min(secs), max(bws), ratios


def gather_decode_us(quick: bool) -> list[dict]:
    """Per-token gather+decode of 48 rows (2 calls of 24, as two layers) from a hot 1M-row table."""
    rows = 250_000 if quick else 1_000_000
    rng = np.random.default_rng(0)
    codes = rng.integers(0, 256, (rows, 256), dtype=np.uint8)
    scales = rng.integers(110, 140, (rows, 8), dtype=np.uint8)
    n = 2000
    addrs = rng.integers(0, rows, (n, 2, 1, 24))
    out = []
    for path, fn in (("native", mxfp8.gather_decode), ("numpy", mxfp8.gather_decode_numpy)):
        if path == "native" and native.library() is None:
            continue
        for dtype in (torch.float32, torch.bfloat16):
            buf = torch.empty(1, 24 * 256, dtype=dtype)

            def run():
                for i in range(n):
                    fn(codes, scales, addrs[i, 0], dtype, buf)
                    fn(codes, scales, addrs[i, 1], dtype, buf)

            us = best(run, 3) / n * 1e6
            out.append({"path": path, "dtype": str(dtype).replace("torch.", ""), "us_per_token": us})
    return out


def prefill_vs_dense_rounds(proj: EngramProjection, codes, scale, cols: int, flop_per_token: float,
                            rounds: int, t: int = 512) -> list[dict]:
    """Per round: torch FP32 and BF16 dense matmul on the same shape, then the projection with a
    BF16 input and with an FP32 input holding BF16 values; each projection's ratio to that round's
    best dense matmul (this shared VM's speed drifts between seconds)."""
    w32 = dequant_blocks(codes, scale, torch.float32)
    wbf = w32.bfloat16()
    xb = torch.randn(t, cols).bfloat16()
    xf, xr = xb.float(), xb.float()
    out = []
    for r in range(rounds):
        fp32 = t * flop_per_token / best(lambda: torch.nn.functional.linear(xf, w32), 2) / 1e9
        bf16 = t * flop_per_token / best(lambda: torch.nn.functional.linear(xb, wbf), 2) / 1e9
        dense = max(fp32, bf16)
        pb = t * flop_per_token / best(lambda: proj.project(xb), 2) / 1e9
        pf = t * flop_per_token / best(lambda: proj.project(xr), 2) / 1e9
        out.append({"round": r, "best_dense_gflops": dense, "fp32_gflops": fp32, "bf16_gflops": bf16,
                    "proj_bf16_input_gflops": pb, "proj_fp32_input_gflops": pf,
                    "bf16_input_vs_best": pb / dense, "fp32_bf16_values_vs_best": pf / dense})
    return out


def official_rows(codes, scale, read_bw: float, dense_gflops: float, fma_gflops: float, quick: bool,
                  ts: list[int] | None = None) -> list[dict]:
    """quant_linear on the wkv at each T against max(weight bytes / read_bw, flops / dense), and
    against the roof of its own arithmetic, max(weight bytes / read_bw, flops / fp32 FMA rate):
    the exact block sums need one fp32 rounding add per product, in order (see block_scaled.c)."""
    tiles = scale.repeat_interleave(4, 0).repeat_interleave(4, 1)  # 128 x 128 blocks as 32 x 32 tiles
    w = QuantWeight.fp8(codes.view(torch.float8_e4m3fn), tiles.view(torch.float8_e8m0fnu))
    n, k = codes.shape
    quant_linear(torch.randn(1, k), w)  # packs the weight once, as a model's first call does
    out = []
    for t in ts or ([1, 2, 8, 64, 512] if quick else [1, 2, 4, 8, 16, 32, 64, 128, 512, 2048]):
        x = torch.randn(t, k).bfloat16()
        sec = best(lambda: quant_linear(x, w), 7 if t <= 64 else (2 if t <= 512 else 1))
        roof = max(n * k / (read_bw * 1e9), 2 * t * n * k / (dense_gflops * 1e9))
        fp32_roof = max(n * k / (read_bw * 1e9), 2 * t * n * k / (fma_gflops * 1e9))
        out.append({"T": t, "ms": sec * 1e3, "roof_ms": roof * 1e3, "vs_roof": roof / sec,
                    "bound": "read" if n * k / (read_bw * 1e9) >= roof else "dense",
                    "fp32_roof_ms": fp32_roof * 1e3, "vs_fp32_roof": fp32_roof / sec})
    return out


def official_only(args) -> None:
    """--official-only: the exact kernel at T = 1 .. 64 against max(read, fp32 FMA) roofs."""
    print_machine()
    cfg = preset("deepseek-v4.1-flash")
    codes, scale = fp8_weight(cfg.engram_output_dim, cfg.engram_input_dim)
    threads = torch.get_num_threads()
    a = torch.ones(1 << 28)
    bw = max(read_gbps(a, 3) for _ in range(2))
    fma = block_scaled_lib.fma_gflops(threads)
    ts = [1, 2, 4, 8, 16, 32, 64]
    rows = official_rows(codes, scale, bw, fma, fma, args.quick, ts)
    bw, fma = max(bw, read_gbps(a, 3)), max(fma, block_scaled_lib.fma_gflops(threads))  # the best seen in the run
    n, k = codes.shape
    for r in rows:
        roof = max(n * k / (bw * 1e9), 2 * r["T"] * n * k / (fma * 1e9))
        r.update(fp32_roof_ms=roof * 1e3, vs_fp32_roof=roof / (r["ms"] / 1e3),
                 bound="read" if n * k / (bw * 1e9) >= roof else "fma")
    print(f"official numerics (block-scaled kernel, variant {block_scaled_lib.path()}, {threads} threads) vs the roof "
          f"of its arithmetic: read {bw:.1f} GB/s, fp32 FMA {fma:.0f} GFLOP/s (same run; target >= 0.75 at T = 2-64)")
    print_table(rows, ["T", "ms", "fp32_roof_ms", "vs_fp32_roof", "bound"])
    write_json(args.json, {"read_gbps": bw, "fp32_fma_gflops": fma, "threads": threads,
                           "official": [{k: r[k] for k in ("T", "ms", "fp32_roof_ms", "vs_fp32_roof", "bound")}
                                        for r in rows]})


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--official-only", action="store_true",
                   help="only the exact block-scaled kernel at T = 1..64 against the roof of its arithmetic")
    args = p.parse_args()
    if args.official_only:
        official_only(args)
        return
    print_machine()
    cfg = preset("deepseek-v4.1-flash")
    rows, cols = cfg.engram_output_dim, cfg.engram_input_dim
    flop_per_token = 2 * rows * cols
    codes, scale = fp8_weight(rows, cols)
    proj = EngramProjection(codes, scale, cfg.hc_mult, cfg.dim)
    print(f"wkv {rows} x {cols} FP8, {proj.weight_bytes / 2**20:.0f} MiB streamed per decode call; "
          f"native kernels: {proj.uses_native} (rows packed in groups of {proj.group}); "
          f"torch threads: {torch.get_num_threads()}")

    # baselines, same run
    t1_sec, bw, t1_ratios = decode_vs_read(proj, cols, 3 if args.quick else 5)
    x512 = torch.randn(512, cols)
    w32 = dequant_blocks(codes, scale, torch.float32)
    fp32_gemm = 512 * flop_per_token / best(lambda: x512 @ w32.t(), 2) / 1e9
    del w32
    wbf = dequant_blocks(codes, scale, torch.bfloat16)
    t_naive = 128 if args.quick else 512  # flat in T (no weight reuse), so 128 tells the same in a quarter of the time
    xb = x512[:t_naive].bfloat16()
    naive = t_naive * flop_per_token / best(lambda: xb @ wbf.t(), 1) / 1e9
    naive_t1 = flop_per_token / best(lambda: xb[:1] @ wbf.t(), 3) / 1e9
    xb512 = x512.bfloat16()
    bf16_gemm = 512 * flop_per_token / best(lambda: torch.nn.functional.linear(xb512, wbf), 2) / 1e9
    best_dense = max(fp32_gemm, bf16_gemm)
    del wbf
    dense_rounds = prefill_vs_dense_rounds(proj, codes, scale, cols, flop_per_token, 2 if args.quick else 3)

    results = []
    for t in ([1, 8, 32, 512] if args.quick else [1, 8, 32, 128, 512, 2048]):
        x = torch.randn(t, cols)
        sec = t1_sec if t == 1 else best(lambda: proj.project(x), 7 if t <= 32 else (2 if t <= 512 else 1))
        results.append({
            "T": t, "regime": "decode" if t <= proj.decode_max_tokens else "prefill",
            "ms": sec * 1e3, "ms_per_token": sec * 1e3 / t, "gflops": t * flop_per_token / sec / 1e9,
            "weight_gbps": proj.weight_bytes / sec / 1e9,
        })
    for r in results:
        r["vs_read_bw"] = r["weight_gbps"] / bw
        r["vs_fp32_gemm"] = r["gflops"] / fp32_gemm
        r["vs_naive_bf16"] = r["gflops"] / (naive_t1 if r["T"] == 1 else naive)
        r["vs_best_dense"] = r["gflops"] / best_dense
    prefill_dtypes = []  # T >= 512: the input as BF16 and as FP32 (BF16 values), vs the best dense matmul (one measure)
    for t in [r["T"] for r in results if r["T"] >= 512]:
        xr = torch.randn(t, cols).bfloat16()
        for name, x in (("bf16", xr), ("fp32 (bf16 values)", xr.float()), ("fp32 (any values)", torch.randn(t, cols))):
            sec = best(lambda: proj.project(x), 2 if t <= 512 else 1)
            g = t * flop_per_token / sec / 1e9
            prefill_dtypes.append({"T": t, "input": name, "gflops": g, "vs_best_dense": g / best_dense})
    print_table(results, ["T", "regime", "ms", "ms_per_token", "gflops", "weight_gbps", "vs_read_bw",
                          "vs_fp32_gemm", "vs_naive_bf16", "vs_best_dense"])
    baselines = {"read_gbps": bw, "fp32_gemm_gflops": fp32_gemm, "naive_bf16_gflops": naive,
                 "naive_bf16_t1_gflops": naive_t1, "naive_bf16_T": t_naive, "bf16_gemm_gflops": bf16_gemm,
                 "best_dense_gflops": best_dense}
    results[0]["round_ratios"] = t1_ratios
    print("baselines:", "  ".join(f"{k}={v:.4g}" for k, v in baselines.items()))
    t1 = results[0]
    print(f"T=1: {t1['weight_gbps']:.1f} GB/s = {t1['vs_read_bw']:.2f} x read bandwidth (target >= 0.8; "
          f"per round {', '.join(f'{r:.2f}' for r in t1_ratios)}); "
          f"{t1['ms']:.2f} ms vs naive BF16 {flop_per_token / naive_t1 / 1e6:.2f} ms")
    big = [r for r in results if r["T"] >= 512]
    for r in big:
        print(f"T={r['T']}: {r['vs_fp32_gemm']:.2f} x FP32 GEMM (target >= 0.8), {r['vs_naive_bf16']:.1f} x naive BF16 "
              f"(target >= 4)")

    print(f"\nprefill vs the best dense matmul here (max of torch FP32 {fp32_gemm:.0f} and BF16 {bf16_gemm:.0f} "
          f"GFLOP/s at T=512; target >= 0.85; FP32 input of any value takes the exact FP32 path):")
    print_table(prefill_dtypes, ["T", "input", "gflops", "vs_best_dense"])
    print("the same at T=512 in alternating rounds (best dense measured right before each; robust to a drifting load):")
    print_table(dense_rounds, ["round", "best_dense_gflops", "fp32_gflops", "bf16_gflops", "bf16_input_vs_best",
                               "fp32_bf16_values_vs_best"])
    for key in ("bf16_input_vs_best", "fp32_bf16_values_vs_best"):
        print(f"median {key}: {statistics.median(r[key] for r in dense_rounds):.3f} (target >= 0.85)")

    fma = block_scaled_lib.fma_gflops(torch.get_num_threads())
    official = official_rows(codes, scale, bw, best_dense, fma, args.quick)
    print(f"\nofficial numerics (block-scaled kernel, path {block_scaled_lib.path()}) vs its roof line "
          f"(read {bw:.1f} GB/s, best dense {best_dense:.0f} GFLOP/s; target vs_roof >= 0.8), and vs the "
          f"roof of its arithmetic (fp32 FMA {fma:.0f} GFLOP/s, same run):")
    print_table(official, ["T", "ms", "roof_ms", "vs_roof", "bound", "fp32_roof_ms", "vs_fp32_roof"])
    print(f"official T=1 / fast T=1: {official[0]['ms'] / t1['ms']:.2f} (target <= 1.1)")

    decode = gather_decode_us(args.quick)
    print("\ngather+decode, 48 rows per token (2 calls of 24 rows), hot table:")
    print_table(decode, ["path", "dtype", "us_per_token"])
    write_json(args.json, {
        "rows": [{k: r[k] for k in ("T", "ms_per_token", "gflops", "weight_gbps")} for r in results],
        "baselines": {k: baselines[k] for k in ("read_gbps", "fp32_gemm_gflops", "naive_bf16_gflops", "bf16_gemm_gflops",
                                                "best_dense_gflops")} | {"fp32_fma_gflops": fma},
        "prefill_vs_best_dense": prefill_dtypes, "prefill_vs_best_dense_rounds": dense_rounds,
        "official": [{k: r[k] for k in ("T", "ms", "roof_ms", "vs_roof", "fp32_roof_ms", "vs_fp32_roof")}
                     for r in official],
        "detail": {"rows": results, "baselines": baselines, "gather_decode": decode,
                   "weight_mib": proj.weight_bytes / 2**20, "native": proj.uses_native,
                   "pack_group": proj.group},
    })


if __name__ == "__main__":
    main()
