"""Add a per-CPU logit set to tests/data/v41_small (used by tools/make_v41_golden.py --add-cpu-set).

A fresh official run in a scratch folder must reproduce the committed weights, config and token
map byte-for-byte (only the logits may depend on the CPU); its golden.safetensors logits are then
stored as golden_<name>.safetensors and listed in golden_sets.json with this machine's numerics
fingerprint, which is what tests/v41_golden.py matches at test time.
"""
from __future__ import annotations

import filecmp
import json
import os
import platform
import sys

import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
from v41_golden import numerics_fingerprint  # noqa: E402,F401  (the one definition, shared with the tests)

SAME_BYTES = ("model.safetensors", "config.json", "engram_token_map.bin")
LOGITS = ("prefill_a", "decode_a", "prefill_b")
INPUTS = ("ids_a", "ids_b", "prefill_b_positions")


def cpu_model_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), platform.processor())
    except OSError:
        return platform.processor()


def add_cpu_set(scratch: str, data: str, name: str, cpu: str, command: str) -> None:
    for f in SAME_BYTES:
        if not filecmp.cmp(os.path.join(scratch, f), os.path.join(data, f), shallow=False):
            raise SystemExit(f"{f} regenerated differently from the committed one: regenerate the whole folder instead")
    new, committed = load_file(os.path.join(scratch, "golden.safetensors")), load_file(os.path.join(data, "golden.safetensors"))
    for k in INPUTS:
        if not torch.equal(new[k], committed[k]):
            raise SystemExit(f"input {k} differs from the committed one")
    fname = f"golden_{name}.safetensors"
    save_file({k: new[k].contiguous() for k in LOGITS}, os.path.join(data, fname),
              {"format": "pt", "cpu": cpu or cpu_model_name()})
    with open(os.path.join(scratch, "golden.json")) as f:
        run_meta = json.load(f)
    sets_path = os.path.join(data, "golden_sets.json")
    with open(sets_path) as f:
        sets = json.load(f)
    entry = {
        "name": name,
        "logits": fname,
        "cpu": cpu or cpu_model_name(),
        "cpu_model_name": cpu_model_name(),
        "fingerprint": numerics_fingerprint(),
        "torch_version": torch.__version__,
        "command": command.replace("NAME", name),
        "decode_vs_prefill": run_meta["decode_vs_prefill"],
        "max_abs_diff_vs_first_set": {k: float((new[k] - committed[k]).abs().max()) for k in LOGITS},
    }
    sets["sets"] = [e for e in sets["sets"] if e["name"] != name] + [entry]
    with open(sets_path, "w") as f:
        json.dump(sets, f, indent=1)
        f.write("\n")
    print(f"added {fname}: fingerprint {entry['fingerprint']}, diff vs first set {entry['max_abs_diff_vs_first_set']}")
