"""One V4.1 Flash decoder layer at released size: the decode step's weight work at 1/4/16/64 rows
against the machine's bytes-read bound, measured in the same run.

Weights (shapes from the released config.json, tests/v41_sparse.py RELEASED_CONFIG, through
model/v41/names.py `tensor_specs`; used in the dtypes model/v41/weights.py gives them): layer 2 by
default (--layer), a ratio-2 KV + index source, so it holds every kind of weight a layer can:
HyperMix fns fp32 [24, 4 x 5,120] (attention and FFN side); attention wq_a [1,280, 5,120],
wq_b [64 x 512, 1,280], wkv [512, 5,120], wo_b [5,120, 8 x 1,024] (FP8 E4M3, E8M0 32 x 32 tile
scales) and wo_a [8 x 1,024, 4,096] (stored FP8, used dequantised in bf16, one linear per group);
the ratio-2 compressor's wkv and wgate fp32 [512, 5,120]; the indexer's wq_b FP8 [32 x 128, 1,280],
weights_proj bf16 [32, 5,120] and wk bf16 [128, 512]; the MoE gate fp32 [384, 5,120]; 384 routed
experts (FP4 E2M1, E8M0 scale per 32: w1, w3 [2,304, 5,120], w2 [5,120, 2,304]), 6 active per
token; the shared expert (FP8, same shapes); plus a row block of the head: 1/8 of its 129,280
rows (16,160 x 5,120, --head-split), as one of 8 pipeline stages would hold it, kept in bf16 (the
model computes the head in fp32; a bf16-held head widens exactly, the same bits, half the bytes).
Random weights in those formats (FP8 without NaN codes, E8M0 scales 2^-3 .. 2^3), built straight
in the native kernel's packed layout (kernels/block_scaled.py `PackedWeight`, checked against
`pack()` on a small weight at start); only the routed experts the routing touches are built.

Routing: the real gate over hidden states of real text needs the real model, so each row's 6
experts are drawn (without repeats, seeded) from a Zipf distribution over the 384 experts
(p ~ 1 / rank^s, s = --zipf, 1.0 by default; a seeded random expert order); --zipf 0 is uniform
routing. The rows of a count are the first rows of one draw of 64. Each count reports the
distinct experts its rows touch.

A step is every weight matmul of the layer done once over the step's rows, in the default
(batched) numerics: the FP8/FP4 projections by the exact block-scaled kernel
(`block_scaled.linear`, quant_linear's bits), each touched routed expert once over its own rows
(w1, w3, w2), the shared expert over all rows, the dense fp32/bf16 linears by the row-invariant
`dense_rows`, and the head block. Not timed: the attention core (window and compressed KV reads
are small at decode next to the weights), the indexer's key scores, norms, RoPE, activations and
quantisation of intermediates between ops (every op gets a ready random input).
Per row count: best-of-N step time; the bytes its rows touch (each touched weight read once, in
the layout the kernels read: codes plus one E8M0 byte per column and 32-wide K block, i.e. FP8
tile scales as the packed layout repeats them; activations not counted); read bandwidth of a
1 GiB array (bench_projection's probe) measured right around that count's timing; the fp32 FMA
rate the block-scaled kernel's exact sums run at (block_scaled_lib.fma_gflops), same run; the
bound max(bytes / bandwidth, flops / FMA rate); time over bound; ms per op kind.
Target: a 16-row step within 1.3x its bytes-read bound.
"""
from __future__ import annotations

import time
import types

import torch

from bench_projection import best, read_gbps
from common import parser, print_machine, print_table, tests_oracle, write_json
from engramflow.kernels import block_scaled, block_scaled_lib, sum_order
from engramflow.kernels.dense_rows import dense_rows
from engramflow.kernels.quant import QuantWeight, quant_linear_reference
from engramflow.model.v41.config import v41_from_dict
from engramflow.model.v41.names import FP8, tensor_specs

GROUP = block_scaled.GROUP
KINDS = ("hc", "attn_fp8", "wo_a", "compressor", "indexer", "gate", "routed_fp4", "shared_fp8", "head")
# --tiny: the same layer at toy size (development runs, seconds)
TINY = {"dim": 256, "moe_inter_dim": 128, "n_heads": 8, "head_dim": 64, "rope_head_dim": 32, "q_lora_rank": 128,
        "o_groups": 2, "o_lora_rank": 64, "index_n_heads": 4, "index_head_dim": 32, "n_routed_experts": 32,
        "vocab_size": 4096, "dspark_n_routed_experts": 8}
SCALE_LO, SCALE_HI = 124, 131  # E8M0 bytes: 2^-3 .. 2^3


class Bytes:
    """Random bytes from one seeded pool, copied in chunks at random offsets: fresh memory for
    every weight at memcpy speed (torch's random_ makes ~0.2 GB/s here). FP8 codes skip NaNs."""

    def __init__(self, seed: int, pool: int = 16 << 20):
        self.g = torch.Generator().manual_seed(seed)
        self.raw = torch.randint(0, 256, (pool,), dtype=torch.uint8, generator=self.g)
        self.fp8 = self.raw.clone()
        self.fp8[(self.fp8 & 0x7F) == 0x7F] = 0x7E  # no NaN codes, as in a real checkpoint
        self.scale = torch.randint(SCALE_LO, SCALE_HI + 1, (pool,), dtype=torch.uint8, generator=self.g)

    def take(self, pool: torch.Tensor, shape) -> torch.Tensor:
        out = torch.empty(shape, dtype=torch.uint8)
        flat, half = out.view(-1), pool.numel() // 2
        for at in range(0, flat.numel(), half):
            n = min(half, flat.numel() - at)
            o = int(torch.randint(0, half, (1,), generator=self.g))
            flat[at:at + n] = pool[o:o + n]
        return out


def packed_weight(src: Bytes, fmt: str, n: int, k: int) -> types.SimpleNamespace:
    """A weight [n, k] in the kernel's group-major layout (what block_scaled.pack() makes of a
    QuantWeight): codes [n/32, k (FP8) or k/2 (FP4), 32], one E8M0 byte per (column, K block)
    [n/32, k/32, 32]; an FP8 tile's scale repeated over its 32 columns. A light object holding
    it as `_native_pack` (block_scaled.packed() takes it as is)."""
    assert n % GROUP == 0 and k % GROUP == 0, (n, k)
    if fmt == "fp8":
        codes = src.take(src.fp8, (n // GROUP, k, GROUP))
        scales = src.take(src.scale, (n // GROUP, k // GROUP, 1)).expand(-1, -1, GROUP).contiguous()
        kind = block_scaled.FMT_FP8
    else:
        codes = src.take(src.raw, (n // GROUP, k // 2, GROUP))
        scales = src.take(src.scale, (n // GROUP, k // GROUP, GROUP))
        kind = block_scaled.FMT_FP4
    return types.SimpleNamespace(_native_pack=block_scaled.PackedWeight(kind, codes, scales, n, k))


def pack_bytes(w) -> int:
    p = w._native_pack
    return p.codes.numel() + p.scales.numel()


def check_layout() -> None:
    """On small weights: the layout packed_weight() assumes is pack()'s, and the kernel on it gives
    quant_linear_reference's bits."""
    g = torch.Generator().manual_seed(7)
    n, k = 64, 128
    for fmt in ("fp8", "fp4"):
        if fmt == "fp8":
            codes = torch.randint(0, 256, (n, k), dtype=torch.uint8, generator=g)
            codes[(codes & 0x7F) == 0x7F] = 0x7E
            tiles = torch.randint(SCALE_LO, SCALE_HI + 1, (n // 32, k // 32), dtype=torch.uint8, generator=g)
            w = QuantWeight.fp8(codes.view(torch.float8_e4m3fn), tiles.view(torch.float8_e8m0fnu))
            rows_codes, rows_scales = codes, tiles.repeat_interleave(32, 0)
        else:
            codes = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g)
            rows_scales = torch.randint(SCALE_LO, SCALE_HI + 1, (n, k // 32), dtype=torch.uint8, generator=g)
            w = QuantWeight.fp4(codes, rows_scales.view(torch.float8_e8m0fnu))
            rows_codes = codes
        ref = block_scaled.pack(w)
        mine = block_scaled.PackedWeight(ref.fmt, rows_codes.view(n // GROUP, GROUP, -1).transpose(1, 2).contiguous(),
                                         rows_scales.view(n // GROUP, GROUP, -1).transpose(1, 2).contiguous(), n, k)
        assert torch.equal(ref.codes, mine.codes) and torch.equal(ref.scales, mine.scales), fmt
        x = torch.randn(3, k).bfloat16()
        y = block_scaled.linear(x, types.SimpleNamespace(_native_pack=mine))
        assert y is not None and torch.equal(y, quant_linear_reference(x, w)), fmt


class Op:
    """One weight matmul of the step: kind, its call, the bytes of weight it reads, its flops."""

    def __init__(self, kind: str, name: str, fn, nbytes: int, flops: int):
        self.kind, self.name, self.fn, self.nbytes, self.flops = kind, name, fn, nbytes, flops


def quant_op(kind: str, name: str, w, x: torch.Tensor) -> Op:
    p = w._native_pack

    def run():
        if block_scaled.linear(x, w) is None:
            raise RuntimeError(f"block_scaled.linear did not take {name}")

    return Op(kind, name, run, pack_bytes(w), 2 * x.shape[0] * p.out_features * p.in_features)


def dense_op(kind: str, name: str, w: torch.Tensor, x: torch.Tensor) -> Op:
    return Op(kind, name, lambda: dense_rows(x, w), w.numel() * w.element_size(), 2 * x.shape[0] * w.numel())


def randn(shape, dtype, g: torch.Generator, std: float = 0.02) -> torch.Tensor:
    return (torch.randn(shape, generator=g) * std).to(dtype)


class Layer:
    """The layer's weights, made once (routed experts on first use), and the ops of a step."""

    def __init__(self, raw: dict, layer: int, head_split: int, seed: int):
        self.cfg = c = v41_from_dict(raw)
        self.layer, self.role = layer, c.roles[layer]
        specs = tensor_specs(raw, c)
        self.src, self.g = Bytes(seed), torch.Generator().manual_seed(seed + 1)
        p = f"layers.{layer}."
        self.specs = {k[len(p):]: v for k, v in specs.items()
                      if k.startswith(p) and v.group == f"layer.{layer}" and k.endswith(("weight", "_fn"))
                      and len(v.shape) == 2 and ".experts." not in k}
        stored = {w: specs[f"{p}ffn.experts.0.{w}.weight"].shape for w in ("w1", "w2", "w3")}
        self.expert_shapes = {w: (n, 2 * half) for w, (n, half) in stored.items()}  # FP4 stored [out, in / 2]
        vocab, dim = specs["head.weight"].shape
        self.head_rows = vocab // head_split
        self.weights: dict[str, object] = {}
        self.experts: dict[int, dict[str, object]] = {}
        for name, spec in self.specs.items():
            self.weights[name] = self._make(name, spec)
        self.weights["head"] = randn((self.head_rows, dim), torch.bfloat16, self.g)

    def _make(self, name: str, spec):
        shape = spec.shape
        n, k = shape
        if name.endswith("_fn") or name == "ffn.gate.weight":
            return randn(shape, torch.float32, self.g)
        if name.startswith("attn.compressor."):  # fp32 for ratio > 1, bf16 for ratio 1 (weights.py)
            return randn(shape, torch.float32 if self.role.ratio > 1 else torch.bfloat16, self.g)
        if name in ("attn.indexer.weights_proj.weight", "attn.indexer.wk.weight"):
            return randn(shape, torch.bfloat16, self.g)
        if name == "attn.wo_a.weight":  # FP8 stored, dequantised once to bf16; one linear per group
            return randn(shape, torch.bfloat16, self.g).view(self.cfg.o_groups, n // self.cfg.o_groups, k)
        if name.startswith("engram."):  # q_weight / k_weight: elementwise in the Engram gate, no matmul
            return None
        if spec.dtypes != FP8:
            raise ValueError(f"layer weight {name} {list(shape)} {spec.dtypes} has no op here")
        return packed_weight(self.src, "fp8", n, k)

    def expert(self, e: int) -> dict[str, object]:
        if e not in self.experts:
            self.experts[e] = {w: packed_weight(self.src, "fp4", *s) for w, s in self.expert_shapes.items()}
        return self.experts[e]

    def weight_bytes(self) -> int:
        total = 0
        for w in list(self.weights.values()) + [x for e in self.experts.values() for x in e.values()]:
            total += pack_bytes(w) if isinstance(w, types.SimpleNamespace) else 0 if w is None else \
                w.numel() * w.element_size()
        return total

    def ops(self, chosen: torch.Tensor) -> list[Op]:
        """The step's ops for rows whose experts are chosen [T, k], each with a ready random input."""
        t, g, w = chosen.shape[0], self.g, self.weights

        def x_for(k: int, dtype=torch.bfloat16, rows: int = t) -> torch.Tensor:
            return torch.randn(rows, k, generator=g).to(dtype)

        out = []
        for name, spec in self.specs.items():
            weight, k = w[name], spec.shape[1]
            if weight is None:
                continue
            if name.endswith("_fn"):
                out.append(dense_op("hc", name, weight, x_for(k, torch.float32)))
            elif name == "ffn.gate.weight":
                out.append(dense_op("gate", name, weight, x_for(k, torch.float32)))
            elif name == "attn.wo_a.weight":
                o = x_for(weight.shape[0] * k).view(t, weight.shape[0], k)
                out += [dense_op("wo_a", f"{name}[{i}]", weight[i], o[:, i]) for i in range(weight.shape[0])]
            elif name.startswith("attn.compressor."):
                out.append(dense_op("compressor", name, weight, x_for(k, weight.dtype)))
            elif name.startswith("attn.indexer."):
                out.append(quant_op("indexer", name, weight, x_for(k)) if isinstance(weight, types.SimpleNamespace)
                           else dense_op("indexer", name, weight, x_for(k)))
            elif name.startswith("ffn.shared_experts."):
                out.append(quant_op("shared_fp8", name, weight, x_for(k)))
            elif name.startswith("attn."):
                out.append(quant_op("attn_fp8", name, weight, x_for(k)))
            else:
                raise ValueError(f"layer weight {name} {list(spec.shape)} has no op here")
        for e in sorted(set(chosen.flatten().tolist())):
            rows = int((chosen == e).any(dim=1).sum())
            ew = self.expert(e)
            for wn in ("w1", "w3", "w2"):
                out.append(quant_op("routed_fp4", f"experts.{e}.{wn}", ew[wn], x_for(self.expert_shapes[wn][1],
                                                                                   rows=rows)))
        out.append(dense_op("head", "head[block]", w["head"], x_for(w["head"].shape[1], torch.float32)))
        return out


def route(n_experts: int, k: int, rows: int, zipf: float, seed: int) -> torch.Tensor:
    """int64 [rows, k]: each row's k distinct experts, drawn with p ~ 1 / rank^zipf over a seeded
    random order of the experts."""
    g = torch.Generator().manual_seed(seed)
    rank = torch.empty(n_experts, dtype=torch.float64)
    rank[torch.randperm(n_experts, generator=g)] = torch.arange(1, n_experts + 1, dtype=torch.float64)
    p = rank ** -zipf
    return torch.multinomial((p / p.sum()).expand(rows, -1), k, replacement=False, generator=g)


def run_step(ops: list[Op]) -> tuple[float, dict[str, float]]:
    per = dict.fromkeys(KINDS, 0.0)
    t0 = time.perf_counter()
    for op in ops:
        t = time.perf_counter()
        op.fn()
        per[op.kind] += time.perf_counter() - t
    return time.perf_counter() - t0, per


def measure(ops: list[Op], repeat: int, probe: torch.Tensor, threads: int, fma_seconds: float) -> dict:
    """Read bandwidth and FMA rate probed before and after the step's timing (best of each)."""
    bw = read_gbps(probe, 3)
    fma = block_scaled_lib.fma_gflops(threads, fma_seconds)
    run_step(ops)  # warm: first touch of outputs, thread pools
    runs = [run_step(ops) for _ in range(repeat)]
    bw = max(bw, read_gbps(probe, 3))
    fma = max(fma, block_scaled_lib.fma_gflops(threads, fma_seconds))
    sec, per = min(runs, key=lambda r: r[0])
    return {"sec": sec, "per": per, "bw": bw, "fma": fma, "all_ms": [r[0] * 1e3 for r in runs]}


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--layer", type=int, default=2, help="which layer's weight set (default 2: ratio-2 KV+index source)")
    p.add_argument("--head-split", type=int, default=8, help="the head row block is 1/this of the head")
    p.add_argument("--zipf", type=float, default=1.0, help="routing skew s, p ~ 1/rank^s (0: uniform)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeat", type=int, help="timed steps per row count (best taken)")
    p.add_argument("--rows", help="comma-separated row counts (default 1,4,16,64; --quick 1,16)")
    p.add_argument("--tiny", action="store_true", help="toy-size layer (development)")
    args = p.parse_args()
    print_machine()
    if block_scaled_lib.library() is None:
        raise SystemExit(f"the block-scaled library is not available ({block_scaled_lib.why_not()})")
    check_layout()
    raw = dict(tests_oracle("v41_sparse").RELEASED_CONFIG)
    if args.tiny:
        raw |= TINY
    counts = [int(r) for r in args.rows.split(",")] if args.rows else [1, 16] if args.quick else [1, 4, 16, 64]
    repeat = args.repeat or (3 if args.quick or args.tiny else 7)
    threads = torch.get_num_threads()
    fma_seconds = 0.05 if args.tiny else 0.3

    t = time.perf_counter()
    layer = Layer(raw, args.layer, args.head_split, args.seed)
    c = layer.cfg
    chosen_all = route(c.n_routed_experts, c.n_activated_experts, max(counts), args.zipf, args.seed)
    base_gb = layer.weight_bytes() / 1e9
    expert_gb = sum(n * k // 2 + n * k // GROUP for n, k in layer.expert_shapes.values()) / 1e9  # FP4 codes + scales
    need = len(set(chosen_all.flatten().tolist()))
    print(f"layer {args.layer} ({layer.role.kind}) of the released V4.1 Flash shapes{' (TINY)' if args.tiny else ''}: "
          f"dim {c.dim}, {c.n_routed_experts} experts x {c.moe_inter_dim} ({c.n_activated_experts} active), "
          f"head block {layer.head_rows} x {c.dim} bf16 (1/{args.head_split}); non-routed weights {base_gb:.3f} GB "
          f"built in {time.perf_counter() - t:.1f} s; {need} routed experts to build x {expert_gb * 1e3:.1f} MB = "
          f"{need * expert_gb:.2f} GB; routing Zipf s={args.zipf}, seed {args.seed}; torch threads {threads}; "
          f"kernel path {block_scaled_lib.path()}; numerics batched")
    probe = torch.ones(1 << (24 if args.tiny else 28))  # 1 GiB of fp32 (64 MiB with --tiny)

    results = []
    with sum_order.use("batched"):
        for n in counts:
            chosen = chosen_all[:n]
            t = time.perf_counter()
            ops = layer.ops(chosen)
            built = time.perf_counter() - t
            m = measure(ops, repeat, probe, threads, fma_seconds)
            nbytes, flops = sum(o.nbytes for o in ops), sum(o.flops for o in ops)
            read_s, fma_s = nbytes / (m["bw"] * 1e9), flops / (m["fma"] * 1e9)
            bound = max(read_s, fma_s)
            kind_bytes = {k: sum(o.nbytes for o in ops if o.kind == k) for k in KINDS}
            top = max(KINDS, key=lambda k: m["per"][k])
            results.append({
                "rows": n, "experts": len(set(chosen.flatten().tolist())), "ms": m["sec"] * 1e3,
                "touched_gb": nbytes / 1e9, "read_gbps": m["bw"], "gflop": flops / 1e9, "fma_gflops": m["fma"],
                "read_ms": read_s * 1e3, "fma_ms": fma_s * 1e3, "bound_ms": bound * 1e3,
                "bound": "read" if read_s >= fma_s else "fma", "vs_bound": m["sec"] / bound,
                "vs_read": m["sec"] / read_s, "eff_gbps": nbytes / m["sec"] / 1e9,
                "top": f"{top} {m['per'][top] * 1e3:.1f}ms",
                "ms_by_kind": {k: m["per"][k] * 1e3 for k in KINDS},
                "read_ms_by_kind": {k: kind_bytes[k] / (m["bw"] * 1e9) * 1e3 for k in KINDS},
                "gb_by_kind": {k: kind_bytes[k] / 1e9 for k in KINDS},
                "calls": len(ops), "all_ms": m["all_ms"], "inputs_s": built,
            })
            print(f"  {n} rows: {results[-1]['ms']:.1f} ms, {len(ops)} calls, routed experts built so far "
                  f"{len(layer.experts)}", flush=True)

    print(f"\nthe step's weight work (best of {repeat}); bound = max(touched bytes / read bandwidth, flops / fp32 FMA "
          f"rate), both measured around each count's timing:")
    print_table(results, ["rows", "experts", "ms", "touched_gb", "read_gbps", "eff_gbps", "read_ms", "fma_ms",
                          "bound_ms", "bound", "vs_bound", "vs_read", "top"])
    print("\nms per op kind (best step), and [its bytes-read ms]:")
    print_table([{"rows": r["rows"]} | {k: f"{r['ms_by_kind'][k]:.1f} [{r['read_ms_by_kind'][k]:.1f}]" for k in KINDS}
                 for r in results], ["rows", *KINDS])
    for r in results:
        if r["rows"] == 16:
            print(f"\n16 rows: {r['ms']:.1f} ms = {r['vs_read']:.2f} x its bytes-read bound {r['read_ms']:.1f} ms "
                  f"({r['touched_gb']:.3f} GB at {r['read_gbps']:.1f} GB/s; target <= 1.3)")
    write_json(args.json, {
        "rows": results,
        "config": {"layer": args.layer, "kind": layer.role.kind, "tiny": args.tiny, "dim": c.dim,
                   "n_routed_experts": c.n_routed_experts, "n_activated_experts": c.n_activated_experts,
                   "moe_inter_dim": c.moe_inter_dim, "head_rows": layer.head_rows, "head_split": args.head_split,
                   "weights": {k: list(v.shape) for k, v in layer.specs.items()},
                   "expert_weights": {k: list(v) for k, v in layer.expert_shapes.items()}},
        "routing": {"zipf": args.zipf, "seed": args.seed, "chosen": chosen_all.tolist()},
        "repeat": repeat, "threads": threads, "kernel_path": block_scaled_lib.path(),
    })


if __name__ == "__main__":
    main()
