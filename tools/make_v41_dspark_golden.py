"""Produce the DSpark (V4.1 draft layers) golden data: tests/data/v41_small/dspark_golden.*.

NEEDS the CPU-runnable official reference folder (default ``../shared/official_v41``; pass another
path as the first argument). It is imported at run time only; none of its code is copied here.
A one-off generator: not part of the package, not imported or run by the tests.

Usage (from the repository root):
    OMP_NUM_THREADS=2 .venv/bin/python tools/make_v41_dspark_golden.py ../shared/official_v41
    ... --add-cpu-set NAME [--cpu "description"]   # another CPU kind's numbers (see below)

Like the backbone's logits (make_v41_golden.py), these numbers depend on the CPU kind: torch's
GEMM kernels sum in an order chosen by the instruction set, and the model's re-quantisations
amplify a one-ulp change. `--add-cpu-set NAME` writes dspark_golden_NAME.safetensors and lists it
in dspark_golden.json's "sets" with this machine's numerics fingerprint, which the tests match.

The model is `testing.build_small_model(seed=0)` with the parameter conversions that
tools/make_v41_golden.py applied before writing tests/data/v41_small/model.safetensors; every
parameter is then checked bit-equal against that committed checkpoint, so the numbers belong to it.

Run: prefill ids_a[:P] (the backbone forward, then the DSpark prefill that seeds the draft layers'
window rings); then teacher-forced decode steps t = P..P+N-1: the backbone forward of ids_a[t] at
start_pos t, then the DSpark forward at start_pos t whose block starts with ids_a[t+1] (the token
after t) followed by noise tokens. Each step's drafted ids, fp32 logits (Markov biases added) and
fp32 confidence are stored. The decode runs with the index-key fix of the official decode path
(each key-owning indexer publishes its own key cache every step), as tools/make_v41_golden.py does.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from make_v41_golden import (BF16_STORED, HF_REVISION, dequant_blocks, index_key_fix, sha256,  # noqa: E402
                             write_safetensors)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(REPO, "tests", "data", "v41_small")
COMMAND = "OMP_NUM_THREADS=2 .venv/bin/python tools/make_v41_dspark_golden.py ../shared/official_v41"
P, N = 5, 40


def convert_like_checkpoint(model, stored: dict[str, torch.Tensor]) -> None:
    """Set every parameter to the value the committed checkpoint holds, and check it is exact."""
    from safetensors.torch import load_file  # noqa: F401 (only to be sure the reader exists)

    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".attn.wo_a.weight"):
                p.copy_(dequant_blocks(stored[name], stored[name[: -len("weight")] + "scale"]).to(torch.bfloat16))
            elif p.dtype == torch.float32 and p.dim() == 2 and any(r.search(name) for r in BF16_STORED):
                p.copy_(p.to(torch.bfloat16).float())
            got = stored[name]
            if got.dtype == torch.int8 and p.dtype == torch.float4_e2m1fn_x2:
                assert torch.equal(got, p.view(torch.int8)), name
            elif name.endswith(".attn.wo_a.weight"):
                continue  # checked through the dequantisation above
            elif got.dtype != p.dtype:
                assert torch.equal(got.float(), p.float()), name
            else:
                assert torch.equal(got.view(torch.uint8), p.detach().view(torch.uint8)), name


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("official", nargs="?", default=os.path.join(REPO, "..", "shared", "official_v41"))
    ap.add_argument("--add-cpu-set", metavar="NAME", help="add this CPU kind's numbers as a set of their own")
    ap.add_argument("--cpu", default="", help="with --add-cpu-set: a description of this CPU")
    cli = ap.parse_args()
    official = os.path.abspath(cli.official)
    sys.path.insert(0, os.path.join(official, "_shim"))
    from models.demos.deepseek_v3_d_p.reference.deepseek_v41 import model as v41
    from models.demos.deepseek_v3_d_p.reference.deepseek_v41.testing import build_small_model
    from safetensors.torch import load_file

    torch.set_default_dtype(torch.bfloat16)
    t_start = time.perf_counter()
    model = build_small_model(seed=0)
    convert_like_checkpoint(model, load_file(os.path.join(OUT, "model.safetensors")))
    ids = load_file(os.path.join(OUT, "golden.safetensors"))["ids_a"].view(1, -1)
    block = model.mtp[-1].block_size

    drafts, logits, confidence, backbone = [], [], [], []
    with index_key_fix(v41):
        out, lg, main_hidden = model(ids[:, :P], 0)
        assert model.forward_spec(out, main_hidden, 0) is None
        for t in range(P, P + N):
            _, lg, main_hidden = model(ids[:, t: t + 1], t)
            backbone.append(lg[0].float().clone())
            d, dl, c = model.forward_spec(ids[:, t + 1], main_hidden, t)
            drafts.append(d[0].to(torch.int64).clone())
            logits.append(dl[0].float().clone())
            confidence.append(c[0].float().clone())
    gold = {
        "drafts": torch.stack(drafts).contiguous(),          # [N, block + 1]
        "draft_logits": torch.stack(logits).contiguous(),    # [N, block, vocab]
        "confidence": torch.stack(confidence).contiguous(),  # [N, block]
        "backbone_logits": torch.stack(backbone).contiguous(),  # [N, vocab]
    }
    if cli.add_cpu_set:
        return add_cpu_set(gold, cli.add_cpu_set, cli.cpu, time.perf_counter() - t_start)
    golden_path = os.path.join(OUT, "dspark_golden.safetensors")
    write_safetensors(golden_path, gold, {"format": "pt"})
    meta = {
        "official_source": {"hf_repo": "deepseek-ai/DeepSeek-V4.1-Flash", "hf_revision": HF_REVISION,
                            "sha256": {f: sha256(os.path.join(official, f))
                                       for f in ("model.py", "kernel_cpu.py", "testing.py")}},
        "torch_version": torch.__version__,
        "command": COMMAND,
        "model": "testing.build_small_model(seed=0), parameters checked bit-equal to model.safetensors",
        "prefill_tokens": P,
        "decode_steps": N,
        "block_size": block,
        "noise_token_id": model.mtp[-1].noise_token_id,
        "inputs": "ids_a of golden.safetensors",
        "tensors": {
            "drafts": f"row i = step t = {P} + i: forward_spec(ids_a[t+1], main_hidden(t), t) output ids "
                      "(column 0 the block's first token, then the greedy drafts for positions t+2..)",
            "draft_logits": "row i: fp32 logits of the block's positions t+1.. with the Markov biases added",
            "confidence": "row i: fp32 confidence per block position",
            "backbone_logits": "row i: the backbone's decode logits at position t (a check of the decode run)",
        },
        "decode_patch": "v41.Indexer.forward wrapped: key-owning indexers publish their own key cache every step",
        "runtime_s": round(time.perf_counter() - t_start, 1),
    }
    with open(os.path.join(OUT, "dspark_golden.json"), "w") as f:
        json.dump(meta, f, indent=1)
        f.write("\n")
    with open(os.path.join(OUT, "PROVENANCE.md"), "a") as f:
        if not re.search("dspark_golden", open(os.path.join(OUT, "PROVENANCE.md")).read()):
            f.write(f"""
## DSpark draft layers (`dspark_golden.safetensors`, `dspark_golden.json`)

Generated by `tools/make_v41_dspark_golden.py` from the same official code and model (`{COMMAND}`):
prefill of `ids_a[:{P}]` (backbone, then the DSpark prefill seeding the draft layers' window rings),
then {N} teacher-forced decode steps t = {P}..{P + N - 1}: backbone forward of `ids_a[t]` at start_pos t
(with the index-key fix), then the official `forward_spec` whose draft block is `ids_a[t+1]` followed by
{block - 1} noise token(s). Stored per step: drafted ids, fp32 draft logits (Markov biases added),
fp32 confidence, and the backbone's logits.
""")
    print(f"drafts {tuple(gold['drafts'].shape)}, logits {tuple(gold['draft_logits'].shape)}, "
          f"done in {meta['runtime_s']} s")


def add_cpu_set(gold: dict, name: str, cpu: str, seconds: float) -> None:
    """Write this CPU kind's numbers beside the first set and list them with its fingerprint."""
    import v41_golden_sets as sets_tool

    fname = f"dspark_golden_{name}.safetensors"
    write_safetensors(os.path.join(OUT, fname), gold, {"format": "pt"})
    meta_path = os.path.join(OUT, "dspark_golden.json")
    with open(meta_path) as f:
        meta = json.load(f)
    entry = {"name": name, "file": fname, "cpu": cpu or sets_tool.cpu_model_name(),
             "fingerprint": sets_tool.numerics_fingerprint(), "torch_version": torch.__version__,
             "command": COMMAND + f" --add-cpu-set {name}", "runtime_s": round(seconds, 1)}
    meta["sets"] = [e for e in meta.get("sets", []) if e["name"] != name] + [entry]
    with open(meta_path, "w") as f:
        json.dump(meta, f, indent=1)
        f.write("\n")
    print(f"set {name}: {fname}, fingerprint {entry['fingerprint']}")


if __name__ == "__main__":
    main()
