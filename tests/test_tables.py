import json
import re

import numpy as np
import pytest
import torch

from ckpt_builders import write_sparse
from engramflow.errors import EngramflowError
from engramflow.memory.tables import EngramTable, EngramTables
from engramflow.io.checkpoint import Checkpoint, engram_names
from engramflow.io.layout import build_layout
from engramflow.model.synth import synth_config


@pytest.fixture(scope="module")
def tables(tiny_ckpt):
    return EngramTables(Checkpoint(tiny_ckpt))


def _reference_table(table: EngramTable) -> np.ndarray:
    """The whole small table dequantized in float64 by torch's own float8 cast."""
    codes = torch.from_numpy(np.array(table.codes)).view(torch.float8_e4m3fn).to(torch.float64).numpy()
    scales = np.ldexp(1.0, np.array(table.scales).astype(np.int64) - 127)
    return (codes.reshape(table.rows, -1, 32) * scales[:, :, None]).reshape(table.rows, -1)


@pytest.mark.parametrize("layer", [1, 14])
def test_lookup_equals_dequantizing_the_whole_table(tables, layer, rng):
    table = tables[layer]
    whole = _reference_table(table)
    addr = rng.integers(0, table.rows, (37, table.columns))
    expect = whole[addr].reshape(37, -1)
    got32 = table.lookup(addr, torch.float32).numpy()
    assert np.array_equal(got32, expect.astype(np.float32))
    got16 = table.lookup(addr, torch.bfloat16)
    assert torch.equal(got16, torch.from_numpy(expect).bfloat16())
    codes, scales = table.gather(addr)
    assert codes.shape == (37, 24, table.head_dim) and scales.shape == (37, 24, table.head_dim // 32)
    assert np.array_equal(codes, np.array(table.codes)[addr])


def test_lookup_rejects_bad_addresses(tables):
    table = tables[1]
    with pytest.raises(EngramflowError, match=f"layer 1: address {table.rows} is outside the table of {table.rows} rows"):
        table.lookup(np.full((1, 24), table.rows))
    with pytest.raises(EngramflowError, match="layer 1: address -1 is outside"):
        table.gather(np.full((1, 24), -1))
    with pytest.raises(EngramflowError, match=r"must be integer \[T, 24\]"):
        table.lookup(np.zeros((2, 23), dtype=np.int64))
    with pytest.raises(EngramflowError, match="no Engram table for layer 3"):
        tables[3]


def _rss_kib(field="VmRSS") -> int:
    text = open("/proc/self/status").read()
    return int(re.search(rf"{field}:\s+(\d+) kB", text).group(1))


def test_big_table_lookups_do_not_grow_rss(tmp_path, rng):
    # 2 tables of ~560 MB each, sparse on disk, vs a 64 MiB RSS allowance
    cfg = synth_config("tiny").replace(engram_head_dim=256, engram_vocab_size=90_000)
    rows = [int(r) for r in build_layout(cfg).rows_needed]
    cfg = cfg.replace(engram_num_embeddings=rows)
    tensors = {}
    for layer, n_rows in zip(cfg.engram_layer_ids, rows):
        n = engram_names(layer)
        tensors[n["embed.weight"]] = ("F8_E4M3", (n_rows, 256))
        tensors[n["embed.scale"]] = ("F8_E8M0", (n_rows, 8))
        tensors[n["wkv.weight"]] = ("BF16", (cfg.engram_output_dim, cfg.engram_input_dim))
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_dict()))
    write_sparse(tmp_path / "model.safetensors", tensors)
    tables = EngramTables(Checkpoint(tmp_path))
    table_bytes = sum(t.nbytes for t in tables.layers.values())
    allowance = 64 << 20
    assert table_bytes > 8 * allowance
    before = _rss_kib() << 10
    for layer, t in tables.layers.items():
        for _ in range(20):
            addr = rng.integers(0, t.rows, (8, 24))
            assert t.lookup(addr, torch.float32).abs().sum() == 0  # a hole reads as zeros
    assert (_rss_kib() << 10) - before < allowance


def test_warmup_faults_the_table_in(tiny_ckpt):
    table = EngramTable(Checkpoint(tiny_ckpt), 14)
    before = _rss_kib("RssFile") << 10
    table.warmup(progress=False)
    grown = (_rss_kib("RssFile") << 10) - before
    assert grown >= 0.9 * table.nbytes  # a fresh mapping: every page now mapped in
    addr = np.arange(24)[None] * 7
    assert table.lookup(addr).shape == (1, 24 * table.head_dim)
