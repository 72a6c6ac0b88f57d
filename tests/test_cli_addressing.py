import json
import subprocess
import sys

import numpy as np
import pytest

from engramflow.cli.app import main
from engramflow.memory.history import SessionHistory


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_token_map_export_prints_sizes_and_hash(tmp_path, capsys, v4_token_map):
    out_file = tmp_path / "engram_token_map.bin"
    code, out, _ = run(capsys, "token-map", "export", "--out", str(out_file))
    info = json.loads(out)
    assert code == 0 and info["vocab_size"] == 129_280 and info["compressed_vocab_size"] == 99_092
    import hashlib
    assert info["sha256"] == hashlib.sha256(out_file.read_bytes()).hexdigest()
    assert np.array_equal(np.fromfile(out_file, dtype="<u4"), v4_token_map.table)


def test_addresses_for_text_match_the_library(capsys, v41_config, v4_token_map, tmp_path):
    code, out, _ = run(capsys, "addresses", "--text", "Engram reads memory ahead.", "--image-spans", "1:3")
    doc = json.loads(out)
    assert code == 0 and doc["layer_ids"] == [1, 14]
    hist = SessionHistory.from_config(v41_config, v4_token_map)
    dead = np.zeros(len(doc["token_ids"]), dtype=bool)
    dead[1:3] = True
    expect = hist.append(hist.open(), doc["token_ids"], dead_mask=dead)
    assert doc["addresses"] == expect.tolist()
    # --text-file and --token-map give the same answer
    (tmp_path / "p.txt").write_text("Engram reads memory ahead.")
    v4_token_map.save(tmp_path / "map.bin")
    code, out2, _ = run(capsys, "addresses", "--text-file", str(tmp_path / "p.txt"),
                        "--token-map", str(tmp_path / "map.bin"), "--image-spans", "1:3")
    assert json.loads(out2) == doc


@pytest.mark.parametrize("argv,match", [
    (["addresses", "--preset", "nope", "--ids", "1"], "unknown preset 'nope'"),
    (["addresses", "--ids", "1,x"], "token id 'x' is not an integer"),
    (["addresses", "--ids", "1,129280"], "token id 129280"),
    (["addresses", "--ids", "1,2", "--image-spans", "1-2"], "image span '1-2'"),
    (["addresses", "--ids", "1,2", "--image-spans", "0:3"], "outside the prompt"),
    (["addresses", "--ids", "1,2,3", "--image-spans", "0:2,1:3"], "overlaps"),
    (["addresses", "--text-file", "/nonexistent/p.txt"], "text file not found"),
    (["addresses", "--config", "/nonexistent/config.json", "--ids", "1"], "config file not found"),
    (["addresses", "--token-map", "/nonexistent/map.bin", "--ids", "1"], "token map file not found"),
    (["token-map", "export", "--tokenizer", "/nonexistent/tokenizer.json", "--out", "x.bin"], "tokenizer file not found"),
])
def test_bad_input_exits_2_with_one_line(capsys, argv, match):
    code, out, err = run(capsys, *argv)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and match in err


def test_wrong_size_token_map_is_refused(capsys, tmp_path):
    (tmp_path / "map.bin").write_bytes(b"\0" * 400)
    code, _, err = run(capsys, "addresses", "--token-map", str(tmp_path / "map.bin"), "--ids", "1")
    assert code == 2 and "100 entries but the vocabulary has 129280" in err


def test_console_script_usage_errors_exit_2(capsys):
    """The module entry point in a fresh interpreter (its exit status and its one stderr line);
    the same command's success path through main() in process."""
    exe = [sys.executable, "-m", "engramflow.cli"]
    done = subprocess.run(exe + ["addresses", "--ids", "1", "--text", "x"], capture_output=True, text=True)
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "not allowed" in done.stderr
    code, out, _ = run(capsys, "addresses", "--ids", "3,4")
    assert code == 0 and len(json.loads(out)["addresses"]) == 2
