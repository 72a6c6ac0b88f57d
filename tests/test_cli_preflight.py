"""Mistakes the command line refuses before Ray starts (one stderr line, exit 2, no "starting
Ray" line, nothing written), each through the real command's `main()` in process
(cli_run.engramflow_here: any path to Ray fails the test, as a "starting Ray" line would in a
fresh process)."""
import os
import shutil

import numpy as np
import pytest

from cli_run import engramflow_here as engramflow, one_line_error
from engramflow.io.checkpoint import TOKEN_MAP, Checkpoint


def linked_copy(src, dst):
    """A copy of a checkpoint whose files are hard links (cheap), token map a real copy."""
    dst.mkdir()
    for f in src.iterdir():
        (shutil.copyfile if f.name == TOKEN_MAP else os.link)(f, dst / f.name)
    return dst


@pytest.mark.parametrize("damage, named", [
    (lambda b: b[: len(b) // 2], "entries but the vocabulary has"),            # truncated
    (lambda b: b[:-2], "not a whole number of u32 entries"),                   # cut mid-entry
    (lambda b: np.random.default_rng(0).integers(0, 2**32, len(b) // 4, dtype=np.uint32).tobytes(),
     "compresses to"),                                                         # garbage of the right size
])
def test_inspect_refuses_the_token_map_lookup_would_refuse(tiny_ckpt, tmp_path, damage, named):
    ckpt = linked_copy(tiny_ckpt, tmp_path / "ckpt")
    path = ckpt / TOKEN_MAP
    path.write_bytes(damage(path.read_bytes()))
    for argv in (["inspect", ckpt, "--headers-only"], ["lookup", ckpt, "--layer", "1", "--ids", "1,2,3"]):
        line = one_line_error(engramflow(*argv))
        assert TOKEN_MAP in line and named in line, line


def test_inspect_still_accepts_the_intact_checkpoint(tiny_ckpt):
    done = engramflow("inspect", tiny_ckpt, "--headers-only")
    assert done.returncode == 0 and done.stderr == "", done.stderr


def test_access_stats_checks_its_output_folder_before_ray(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text('{"text": "hello world"}\n')
    out = tmp_path / "taken"
    out.write_text("a file, not a folder")
    line = one_line_error(engramflow("access-stats", "--input", data, "--out", out))
    assert "is not a folder" in line and str(out) in line and "starting" not in line
    below = one_line_error(engramflow("access-stats", "--input", data, "--out", out / "stats"))
    assert "cannot be made" in below
    assert out.read_text() == "a file, not a folder" and sorted(p.name for p in tmp_path.iterdir()) == ["d.jsonl", "taken"]


def test_access_stats_takes_the_engram_layers_of_the_checkpoint(tiny_ckpt, tmp_path):
    from engramflow.cli.app import build_parser
    from engramflow.cli.data import access_stats_model

    args = build_parser().parse_args(["access-stats", "--input", "x", "--out", "y", "--checkpoint", str(tiny_ckpt)])
    cfg, token_map = access_stats_model(args)
    ckpt = Checkpoint(tiny_ckpt)
    assert cfg.engram_layer_ids == ckpt.config.engram_layer_ids
    assert cfg.engram_num_embeddings == ckpt.config.engram_num_embeddings
    assert token_map == str(ckpt.token_map_path())  # the checkpoint's own map, as the engine reads it


def test_generate_refuses_max_new_tokens_past_max_seq_len_before_ray(tiny_ckpt):
    limit = Checkpoint(tiny_ckpt).config.max_seq_len
    line = one_line_error(engramflow("generate", "--checkpoint", tiny_ckpt, "--prompt", "The quick brown fox",
                                     "--max-new-tokens", limit))
    assert f"+ --max-new-tokens {limit} exceeds the checkpoint's max_seq_len={limit}" in line
    assert "prompt of 4 tokens" in line and "starting" not in line


def test_prefill_job_names_a_wrong_shaped_backbone_weight(tiny_ckpt, tmp_path):
    """Replica mode: the weight of the wrong shape is named on one line (the backbone checks
    every tensor's shape as it loads it), not Ray Data's retry boilerplate."""
    import json
    import struct

    ckpt = linked_copy(tiny_ckpt, tmp_path / "ckpt")
    name = "layers.0.ffn.w1.weight"
    shard = ckpt / json.loads((ckpt / "model.safetensors.index.json").read_text())["weight_map"][name]
    raw = shard.read_bytes()
    shard.unlink()  # a hard link: do not write through it into the shared checkpoint
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    header[name]["shape"] = header[name]["shape"][::-1]  # same bytes, transposed shape
    new = json.dumps(header, separators=(",", ":")).encode()
    shard.write_bytes(raw[:8] + new + b" " * (n - len(new)) + raw[8 + n:])
    data = tmp_path / "d.jsonl"
    data.write_text('{"id": 1, "text": "hello world"}\n')
    line = one_line_error(engramflow("prefill-job", "--checkpoint", ckpt, "--input", data,
                                     "--output", tmp_path / "out.parquet"))
    assert f"tensor {name!r} has shape [64, 128], the config implies [128, 64]" in line, line
    assert "RayTaskError" not in line and "retry" not in line
    assert not (tmp_path / "out.parquet").exists()


def test_a_replicas_own_exception_line_is_reported_not_ray_datas_boilerplate():
    from ray.exceptions import RayError

    from engramflow.data.prefill.job import job_error

    relayed = ("ray::MapWorker(MapBatches(CheckedReplica)).submit() (pid=1)\n"
               '  File "x.py", line 3, in forward\n'
               "RuntimeError: mat1 and mat2 shapes cannot be multiplied (15x64 and 128x64)\n\n"
               "The above exception was the direct cause of the following exception:\n\n"
               "ray.exceptions.UserCodeException: UDF failed to process a data block.\n"
               "To change retry attempts, backoff, or which errors are retried, configure ...")
    assert str(job_error(RayError(relayed))) == ("prefill-job failed in a replica: RuntimeError: mat1 and mat2 "
                                                 "shapes cannot be multiplied (15x64 and 128x64)")
    engram = relayed.replace("RuntimeError: mat1", "engramflow.errors.EngramflowError: tensor 'w' bad; mat1")
    assert str(job_error(RayError(engram))).startswith("tensor 'w' bad")
