import json

import numpy as np
import torch

from engramflow.cli.app import main
from engramflow.memory.history import SessionHistory
from engramflow.memory.tables import EngramTable
from engramflow.io.checkpoint import Checkpoint, engram_names


def run(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_inspect_prints_the_summary(capsys, tiny_ckpt):
    code, out, _ = run(capsys, "inspect", tiny_ckpt)
    doc = json.loads(out)
    assert code == 0 and doc["engram"]["layer_ids"] == [1, 14] and doc["engram"]["layout_ok"] is True
    t = doc["tensors"][engram_names(1)["embed.weight"]]
    assert t["dtype"] == "F8_E4M3" and t["shape"][1] == 32 and t["file"].endswith(".safetensors")


def test_lookup_prints_decoded_rows(capsys, tiny_ckpt):
    code, out, _ = run(capsys, "lookup", tiny_ckpt, "--layer", 14, "--text", "Engram memory")
    doc = json.loads(out)
    ckpt = Checkpoint(tiny_ckpt)
    history = SessionHistory.from_config(ckpt.config)
    ids = json.loads(run(capsys, "addresses", "--config", tiny_ckpt, "--text", "Engram memory")[1])["token_ids"]
    addr = history.append(history.open(), ids)[:, 1]
    assert code == 0 and doc["addresses"] == addr.tolist()
    expect = EngramTable(ckpt, 14).lookup(addr, torch.float32).numpy()
    assert np.array_equal(np.array(doc["values"], dtype=np.float32), expect)
    assert len(doc["values"][0]) == 24 * 32


def test_make_checkpoint_cli_and_bad_checkpoints(capsys, tmp_path, tiny_ckpt):
    code, out, _ = run(capsys, "make-checkpoint", "--preset", "tiny", "--out", tmp_path / "c", "--seed", 0, "--quiet")
    assert code == 0 and json.loads(out)["preset"] == "tiny"
    assert (tmp_path / "c" / "model.safetensors.index.json").read_bytes() == \
        (tiny_ckpt / "model.safetensors.index.json").read_bytes()
    code, _, err = run(capsys, "inspect", tmp_path / "nope")
    assert code == 2 and "checkpoint directory not found" in err and err.count("\n") == 1
    (tmp_path / "c" / "config.json").write_text("{}")
    code, _, err = run(capsys, "inspect", tmp_path / "c")
    assert code == 2 and "config key 'vocab_size' is missing" in err
    code, _, err = run(capsys, "lookup", tiny_ckpt, "--layer", 3, "--ids", "1,2")
    assert code == 2 and "layer 3 is not an Engram layer" in err
    code, _, err = run(capsys, "make-checkpoint", "--preset", "tiny", "--out", tmp_path / "d",
                       "--engram-vocab-size", 1)
    assert code == 2 and "engram_vocab_size must be an integer >= 2, got 1" in err
