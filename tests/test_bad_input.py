"""Every bad input gets a clear error naming the value, and leaves state as it was."""
import json
import shutil

import numpy as np
import pytest

from engramflow.cli.app import main
from engramflow.errors import EngramflowError
from engramflow.io.checkpoint import TOKEN_MAP, Checkpoint, engram_names
from engramflow.pipeline.engine import Engine


@pytest.fixture(scope="module")
def engine(tiny_ckpt):
    return Engine(tiny_ckpt)


API_CASES = [
    ("empty prompt", lambda e, s: e.prefill(s, []), "empty prompt"),
    ("empty text", lambda e, s: e.generate([""], 2), "empty prompt"),
    ("over-long prompt", lambda e, s: e.prefill(s, [5] * 4097), "above max_seq_len=4096"),
    ("prompt + new tokens too long", lambda e, s: e.generate([[5] * 4090], 10), "exceeds max_seq_len=4096"),
    ("id out of range", lambda e, s: e.prefill(s, [1, 129_280]), "token id 129280 at position 1"),
    ("negative id", lambda e, s: e.prefill(s, [-3]), "token id -3"),
    ("float id", lambda e, s: e.prefill(s, [1, 2.5]), "must be integers, got 2.5"),
    ("string id", lambda e, s: e.prefill(s, ["7"]), "must be integers, got '7'"),
    ("text where ids go", lambda e, s: e.prefill(s, "hello"), "got a string"),
    ("unknown session", lambda e, s: e.prefill("ghost", [1]), "unknown session 'ghost'"),
    ("closed session", lambda e, s: (e.close(e.open("gone")), e.prefill("gone", [1])), "unknown session 'gone'"),
    ("double close", lambda e, s: (e.close(e.open("twice")), e.close("twice")), "unknown session 'twice'"),
    ("start_pos past the end", lambda e, s: e.prefill(s, [1], start_pos=99), r"start_pos=99 is outside \[0, 6\]"),
    ("image span outside", lambda e, s: e.prefill(s, [1, 2, 3], image_spans=[(2, 5)]), "image span 2:5 is empty or outside"),
    ("image spans overlap", lambda e, s: e.prefill(s, [1, 2, 3, 4], image_spans=[(0, 2), (1, 3)]), "overlaps"),
    ("bad sampling", lambda e, s: e.generate([[1, 2]], 2, sampling=__import__("engramflow.model.sampling", fromlist=["x"]).Sampling(temperature=-1)), "temperature must be >= 0"),
    ("negative max_new_tokens", lambda e, s: e.generate([[1, 2]], -1), "max_new_tokens must be an integer >= 0"),
    ("duplicate session name", lambda e, s: e.open(s), "already exists"),
    ("empty decode step", lambda e, s: e.decode_step({}), "at least one session"),
    ("prompt of the wrong type", lambda e, s: e.generate([42], 2), "text or a list of token ids, got int"),
    ("id beyond int64", lambda e, s: e.prefill(s, [1, 2**70]), "token id 1180591620717411303424 is out of range"),
]


@pytest.mark.parametrize("name,call,match", API_CASES, ids=[c[0] for c in API_CASES])
def test_api_bad_input_leaves_state_unchanged(engine, name, call, match):
    s = engine.open()
    engine.prefill(s, [10, 11, 12, 13, 14, 15])
    before_tokens, before_sessions = engine.tokens(s), set(engine.sessions)
    with pytest.raises(EngramflowError, match=match):
        call(engine, s)
    assert engine.tokens(s) == before_tokens
    assert set(engine.sessions) - {"gone", "twice"} == before_sessions
    assert engine.stage.cached_len(s) == 6 and engine.history.length(s) == 6
    engine.close(s)


def _broken_checkpoints(src, tmp_path):
    """name -> (directory, expected message) for each kind of damage."""
    out = {}

    def copy(name):
        return shutil.copytree(src, tmp_path / name)

    d = copy("missing-shard")
    index = json.loads((d / "model.safetensors.index.json").read_text())
    victim = index["weight_map"][engram_names(14)["embed.weight"]]
    (d / victim).unlink()
    out["missing shard"] = (d, f"shard {victim} is listed but missing")

    d = copy("truncated")
    info = Checkpoint(d).info(engram_names(1)["wkv.weight"])
    with open(info.file, "r+b") as f:
        f.truncate(info.offset + 10)
    out["truncated shard"] = (d, "truncated")

    d = copy("wrong-dtype")
    cfg = json.loads((d / "config.json").read_text())
    cfg["engram_head_dim"] = 64  # table rows are now the wrong shape for the config
    (d / "config.json").write_text(json.dumps(cfg))
    out["wrong shape"] = (d, "has shape")

    d = copy("no-config-key")
    cfg = json.loads((d / "config.json").read_text())
    del cfg["hc_mult"]
    (d / "config.json").write_text(json.dumps(cfg))
    out["config key missing"] = (d, "config key 'hc_mult' is missing")

    d = copy("token-map")
    (d / TOKEN_MAP).write_bytes(np.arange(1000, dtype="<u4").tobytes())
    out["token map wrong size"] = (d, "has 1000 entries but the vocabulary has 129280")

    d = tmp_path / "no-files"
    d.mkdir()
    (d / "config.json").write_text((src / "config.json").read_text())
    out["no safetensors"] = (d, "neither model.safetensors.index.json nor model.safetensors found")
    return out


def test_broken_checkpoints_api_and_cli(tiny_ckpt, tmp_path, capsys):
    for name, (d, match) in _broken_checkpoints(tiny_ckpt, tmp_path).items():
        with pytest.raises(EngramflowError, match=match):
            Engine(d)
        # the CLI refuses before it starts any Ray actor: exit 2, one line
        code = main(["generate", "--checkpoint", str(d), "--prompt", "hi", "--max-new-tokens", "1"])
        err = capsys.readouterr().err
        assert code == 2 and err.count("\n") == 1 and "error:" in err, (name, err)


@pytest.mark.parametrize("argv,match", [
    (["generate", "--checkpoint", "{ckpt}", "--prompt", ""], "the prompt is empty"),
    (["generate", "--checkpoint", "/nonexistent", "--prompt", "x"], "checkpoint directory not found"),
    (["generate", "--checkpoint", "{ckpt}", "--prompt", "x", "--max-new-tokens", "-2"], "is negative"),
    (["generate", "--checkpoint", "{ckpt}", "--prompt", "x", "--stages", "99"], "stages must be an integer in [1, 16]"),
    (["generate", "--checkpoint", "{ckpt}", "--prompt", "x", "--backbone", "gpt"], "invalid choice"),
    (["addresses", "--ids", "1,2", "--image-spans", "0:1,0:2"], "overlaps"),
    (["make-dataset", "--out", "/proc/nope/x.jsonl"], "error:"),
    (["timing-model", "--base-tps", "inf"], "must be a finite positive number"),
    (["token-map", "export", "--out", "/proc/nope/map.bin"], "error:"),
])
def test_cli_bad_input_exits_2(tiny_ckpt, capsys, argv, match):
    code = main([a.replace("{ckpt}", str(tiny_ckpt)) for a in argv])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and match in err


def test_runner_options_are_checked_before_anything_is_built(tiny_ckpt):
    for bad in (-1, float("inf"), 1e9, True):
        with pytest.raises(EngramflowError, match=r"block_ms must be a number of ms in \[0, 1000\], got "):
            Engine(tiny_ckpt, backbone="emulated", block_ms=bad)
    with pytest.raises(EngramflowError, match="prefill_chunk must be an integer >= 1, got 0"):
        Engine(tiny_ckpt, prefill_chunk=0)


def test_emulated_backbone_generates_real_token_ids(tiny_ckpt):
    engine = Engine(tiny_ckpt, backbone="emulated", block_ms=0)
    (g,) = engine.generate(["The quick brown fox"], max_new_tokens=6)
    proxy = set(engine.stage.proxy_ids.tolist())
    assert len(proxy) == 256 and min(proxy) >= 3
    assert set(g.tokens) <= proxy
