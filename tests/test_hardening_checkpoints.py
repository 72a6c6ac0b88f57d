"""Hostile checkpoints: every class of broken file is refused with one line naming file and key.

Each bad checkpoint is a copy of a good small one (the committed `tests/data/v41_small`, a V4.1
model in the released format, or the `tiny_ckpt` fixture, sharded with an index) with one thing
rewritten by the small safetensors writer below. Every case goes through the Python API
(EngramflowError) and the CLI (exit 2, exactly one stderr line, no traceback, bounded time,
nothing left behind).

What is checked where:
* open (`Checkpoint(...)`, always): config.json / index / headers as typed JSON, byte ranges,
  overlaps, dtypes and shapes, config numbers and their limits, the small wkv scales' values;
* first use (`Checkpoint.tensor()`): NaN encodings in every tensor copied into memory (wkv,
  backbone weights);
* complete (`Checkpoint.verify_values()`): every byte of the Engram tables, scales and wkv.
"""
import json
import re
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from engramflow.cli.app import main
from engramflow.errors import EngramflowError
from engramflow.io.checkpoint import INDEX, Checkpoint, engram_names

pytestmark = pytest.mark.timeout(120)

V41_SMALL = Path(__file__).parent / "data" / "v41_small"
MODEL = "model.safetensors"
WQ_A, WQ_B = "layers.0.attn.wq_a.weight", "layers.0.attn.wq_b.weight"  # both F8_E4M3, 16,384 bytes
E0 = engram_names(0)


# -- a small safetensors rewriter --------------------------------------------------------------
def read_st(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8: 8 + n]), raw[8 + n:]


def write_st(path: Path, header, data: bytes, length: int | None = None) -> None:
    """`header`: a dict (dumped as JSON) or raw bytes; `length`: a header length to lie about."""
    hdr = header if isinstance(header, bytes) else json.dumps(header).encode()
    hdr += b" " * (-len(hdr) % 8)
    path.write_bytes(struct.pack("<Q", len(hdr) if length is None else length) + hdr + data)


def edit_header(path: Path, change) -> None:
    header, data = read_st(path)
    new = change(header)
    write_st(path, header if new is None else new, data)


def poke(d: Path, name: str, index, value: int) -> None:
    """Set raw byte(s) of tensor `name` (index into its u8 view, or `...` for all) to `value`."""
    info = Checkpoint(d).info(name)
    with open(info.file, "r+b") as f:
        f.seek(info.offset)
        arr = np.frombuffer(f.read(info.nbytes), dtype=np.uint8).reshape(info.shape).copy()
        arr[index] = value
        f.seek(info.offset)
        f.write(arr.tobytes())


def deep(n: int) -> str:
    return "[" * n + "]" * n


def set_entry(name: str, key: str, value):
    def change(h):
        h[name][key] = value
    return change


def set_config(d: Path, **changes) -> None:
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(changes)
    (d / "config.json").write_text(json.dumps(cfg))


# -- the cases: (name, base, damage(dir), message) -------------------------------------------
HEADER_CASES = [
    ("offsets as strings", lambda d: edit_header(d / MODEL, set_entry(WQ_A, "data_offsets", ["0", "16384"])),
     "'data_offsets' must be [begin, end]"),
    ("offsets as floats", lambda d: edit_header(d / MODEL, set_entry(WQ_A, "data_offsets", [0.0, 16384.0])),
     "'data_offsets' must be [begin, end]"),
    ("one offset", lambda d: edit_header(d / MODEL, set_entry(WQ_A, "data_offsets", [0])), "'data_offsets' must be"),
    ("offsets reversed", lambda d: edit_header(d / MODEL, set_entry(WQ_A, "data_offsets", [16384, 0])),
     "0 <= begin <= end"),
    ("dtype as a list", lambda d: edit_header(d / MODEL, set_entry(WQ_A, "dtype", ["F8_E4M3"])),
     "'dtype' must be a string, got ['F8_E4M3']"),
    ("unknown dtype", lambda d: edit_header(d / MODEL, set_entry(WQ_A, "dtype", "F7")), "unknown dtype 'F7'"),
    ("negative shape", lambda d: edit_header(d / MODEL, set_entry(WQ_A, "shape", [-64, -256])),
     "'shape' must be a list of at most 16 integers >= 0"),
    ("float shape", lambda d: edit_header(d / MODEL, set_entry(WQ_A, "shape", [64.0, 256])), "'shape' must be"),
    ("bool shape", lambda d: edit_header(d / MODEL, set_entry(WQ_A, "shape", [True, 16384])), "'shape' must be"),
    ("shape a string", lambda d: edit_header(d / MODEL, set_entry(WQ_A, "shape", "64x256")), "'shape' must be"),
    ("entry not an object", lambda d: edit_header(d / MODEL, lambda h: h.__setitem__(WQ_A, [1, 2])),
     "header entry must be an object"),
    ("entry without offsets", lambda d: edit_header(d / MODEL, lambda h: h[WQ_A].pop("data_offsets") and None),
     "has no 'data_offsets'"),
    ("metadata not strings", lambda d: edit_header(d / MODEL, lambda h: h.__setitem__("__metadata__", {"a": 1})),
     "'__metadata__' must be an object of strings"),
    ("header a list", lambda d: edit_header(d / MODEL, lambda h: [1]), "header is not a JSON object"),
    ("header not UTF-8", lambda d: edit_header(d / MODEL, lambda h: b'{"\xff\xfe": 1}'), "header is not valid UTF-8"),
    ("header not JSON", lambda d: edit_header(d / MODEL, lambda h: b"{'a': 1}"), "header is not valid JSON"),
    ("header nested 200,000 deep", lambda d: edit_header(d / MODEL, lambda h: deep(200_000).encode()),
     "header is nested too deeply"),
    ("duplicate tensor name", lambda d: edit_header(
        d / MODEL, lambda h: json.dumps(h)[:-1].encode() + b', "' + WQ_A.encode() + b'": '
        + json.dumps(h[WQ_A]).encode() + b"}"), f"gives key '{WQ_A}' twice"),
    ("header length past the file", lambda d: write_st(d / MODEL, *read_st(d / MODEL), length=1 << 40),
     "runs past the file's"),
    ("overlapping tensors", lambda d: edit_header(
        d / MODEL, lambda h: h[WQ_A].__setitem__("data_offsets", h[WQ_B]["data_offsets"])),
     f"tensors '{WQ_A}' and '{WQ_B}' overlap"),
    ("partly overlapping tensors", lambda d: edit_header(
        d / MODEL, lambda h: h[WQ_A].__setitem__("data_offsets", [h[WQ_B]["data_offsets"][0] + 8,
                                                                 h[WQ_B]["data_offsets"][0] + 8 + 16384])),
     "overlap"),
    ("tensor past the end", lambda d: edit_header(
        d / MODEL, lambda h: h[WQ_A].__setitem__("data_offsets", [1 << 40, (1 << 40) + 16384])), "truncated?"),
]

CONFIG_CASES = [
    ("config nested 200,000 deep", lambda d: (d / "config.json").write_text(deep(200_000)),
     "config file", "nested too deeply"),
    ("config not UTF-8", lambda d: (d / "config.json").write_bytes(b'{"dim": "\xff"}'), "config file",
     "not valid UTF-8"),
    ("config a list", lambda d: (d / "config.json").write_text("[1, 2]"), "config file", "must hold a JSON object"),
    ("config duplicate key", lambda d: (d / "config.json").write_text(
        (d / "config.json").read_text().rstrip()[:-1] + ', "dim": 7}'), "config file", "gives key 'dim' twice"),
    ("text_config a list", lambda d: set_config(d, text_config=[1]), "config file", "'text_config' must be an object"),
    ("rope_theta NaN", lambda d: set_config(d, rope_theta=float("nan")), "config", "'rope_theta' must be a finite"),
    ("norm_eps inf", lambda d: set_config(d, norm_eps=float("inf")), "config", "'norm_eps' must be a finite"),
    ("engram_n_heads 10^7", lambda d: set_config(d, engram_n_heads=10**7), "config",
     "'engram_n_heads'=10000000 is above the limit"),
    ("too many hash columns", lambda d: set_config(d, engram_n_heads=200, engram_max_ngram_size=16), "config",
     "hash columns, above the limit"),
    ("engram_vocab_size 10^30", lambda d: set_config(d, engram_vocab_size=10**30), "config",
     "'engram_vocab_size'=1000000000000000000000000000000 is above"),
    ("engram_head_dim 48", lambda d: set_config(d, engram_head_dim=48), "config", "must be a multiple of 32"),
    ("vocab 2^40", lambda d: set_config(d, vocab_size=1 << 40), "config", "'vocab_size'=1099511627776 is above"),
    ("huge list value", lambda d: set_config(d, engram_layer_ids=[[0]] * 100_000), "config",
     "config key 'engram_layer_ids' must be an integer"),
]

V41_CONFIG_CASES = [  # V4.1 keys (checked by inspect's name-set validation and the v41 backbone)
    ("heads that do not divide", lambda d: set_config(d, o_groups=3), "'o_groups': must divide n_heads=4"),
    ("compress_rope_theta NaN", lambda d: set_config(d, compress_rope_theta=float("nan")),
     "'compress_rope_theta' must be a finite number"),
    ("hc_eps inf", lambda d: set_config(d, hc_eps=float("inf")), "'hc_eps' must be a finite number"),
    ("10^7 experts", lambda d: set_config(d, n_routed_experts=10**7), "'n_routed_experts'=10000000 is above"),
    ("compress ratio 2^40", lambda d: set_config(d, compress_ratios=[0, 1 << 40, 2, 1, 1, 1, 0]),
     "'compress_ratios' must list"),
    ("candidate layer -7", lambda d: set_config(d, candidate_source_layer=-7), "'candidate_source_layer'"),
]

INDEX_CASES = [  # on the sharded tiny checkpoint
    ("weight_map value null", lambda wm, doc: wm.__setitem__(next(iter(wm)), None), "must be a shard file name"),
    ("weight_map value int", lambda wm, doc: wm.__setitem__(next(iter(wm)), 3), "must be a shard file name, got int"),
    ("weight_map value list", lambda wm, doc: wm.__setitem__(next(iter(wm)), ["a"]), "got list"),
    ("weight_map value outside", lambda wm, doc: wm.__setitem__(next(iter(wm)), "../config.json"),
     "is not a file in the checkpoint directory"),
    ("weight_map absolute", lambda wm, doc: wm.__setitem__(next(iter(wm)), "/etc/passwd"), "is not a file in"),
    ("weight_map a list", lambda wm, doc: doc.__setitem__("weight_map", list(wm)), "'weight_map' must be an object"),
    ("weight_map empty", lambda wm, doc: doc.__setitem__("weight_map", {}), "'weight_map' is empty"),
    ("no weight_map", lambda wm, doc: doc.pop("weight_map") and None, "not a safetensors index"),
    ("metadata a string", lambda wm, doc: doc.__setitem__("metadata", "x"), "'metadata' must be an object"),
]
RAW_INDEX_CASES = [
    ("index a list", b"[1, 2]", "not a safetensors index"),
    ("index not JSON", b"{weight_map: 1}", "not valid JSON"),
    ("index not UTF-8", b'{"weight_map": {"\xff": 1}}', "not valid UTF-8"),
    ("index nested deep", deep(200_000).encode(), "nested too deeply"),
]


# -- helpers -----------------------------------------------------------------------------------
@pytest.fixture
def v41_copy(tmp_path):
    return shutil.copytree(V41_SMALL, tmp_path / "ckpt")


@pytest.fixture
def tiny_copy(tiny_ckpt, tmp_path):
    return shutil.copytree(tiny_ckpt, tmp_path / "ckpt")


def listing(d: Path) -> list:
    return sorted((p.name, p.stat().st_size) for p in d.iterdir())


def cli(capsys, *argv) -> str:
    """Run the CLI in-process; it must refuse: exit 2, exactly one stderr line, no traceback."""
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    assert code == 2, (argv, out, err)
    assert err.count("\n") == 1 and err.endswith("\n") and "Traceback" not in err, err
    return err


def refused_everywhere(capsys, d: Path, match: str, commands=("inspect", "lookup", "generate")) -> None:
    before = listing(d)
    with pytest.raises(EngramflowError, match=re.escape(match)):
        Checkpoint(d)
    argvs = {"inspect": ["inspect", d], "lookup": ["lookup", d, "--layer", 0, "--ids", "1,2,3"],
             "generate": ["generate", "--checkpoint", d, "--prompt", "hi", "--max-new-tokens", 1]}
    for command in commands:
        err = cli(capsys, *argvs[command])
        assert match in err, (command, err)
    assert listing(d) == before  # nothing written next to the checkpoint


# -- open: headers, byte ranges, overlaps ------------------------------------------------------
@pytest.mark.parametrize("name,damage,match", HEADER_CASES, ids=[c[0] for c in HEADER_CASES])
def test_bad_headers_are_refused_at_open(capsys, v41_copy, name, damage, match):
    damage(v41_copy)
    refused_everywhere(capsys, v41_copy, match)


def test_overlap_names_both_tensors_and_was_a_silent_alias_before(v41_copy):
    edit_header(v41_copy / MODEL, lambda h: h[WQ_A].__setitem__("data_offsets", h[WQ_B]["data_offsets"]))
    with pytest.raises(EngramflowError) as e:
        Checkpoint(v41_copy)
    msg = str(e.value)
    assert WQ_A in msg and WQ_B in msg and MODEL in msg and "\n" not in msg


# -- open: config.json -------------------------------------------------------------------------
@pytest.mark.parametrize("name,damage,where,match", CONFIG_CASES, ids=[c[0] for c in CONFIG_CASES])
def test_bad_configs_are_refused_with_the_key_named(capsys, v41_copy, name, damage, where, match):
    damage(v41_copy)
    before = listing(v41_copy)
    with pytest.raises(EngramflowError, match=match) as e:
        Checkpoint(v41_copy)
    assert where in str(e.value)
    # lookup and prefill-job open the checkpoint first; inspect and generate read config.json
    # themselves before that (see test_deep_config_in_inspect_and_generate)
    assert re.search(match, cli(capsys, "lookup", v41_copy, "--layer", 0, "--ids", "1,2"))
    assert listing(v41_copy) == before


@pytest.mark.parametrize("name,damage,match", V41_CONFIG_CASES, ids=[c[0] for c in V41_CONFIG_CASES])
def test_bad_v41_configs_are_refused_with_the_key_named(capsys, v41_copy, name, damage, match):
    from engramflow.model.v41.config import v41_from_dict

    damage(v41_copy)
    with pytest.raises(EngramflowError, match=match):
        v41_from_dict(json.loads((v41_copy / "config.json").read_text()))
    assert match in cli(capsys, "inspect", v41_copy)


def test_deep_config_in_inspect_and_generate(capsys, v41_copy):
    (v41_copy / "config.json").write_text(deep(200_000))
    assert "nested too deeply" in cli(capsys, "inspect", v41_copy)
    assert "nested too deeply" in cli(capsys, "generate", "--checkpoint", v41_copy, "--prompt", "x")


@pytest.mark.timeout(60)  # a hang guard, not a speed bound
def test_layout_limit_is_fast(v41_copy):
    """engram_n_heads=10^7 used to hang in the prime search; now refused before it starts."""
    from engramflow.io.config import from_dict

    raw = json.loads((v41_copy / "config.json").read_text())
    for change in ({"engram_n_heads": 10**7}, {"engram_max_ngram_size": 10**6}, {"engram_vocab_size": 2**62},
                   {"engram_layer_ids": list(range(100)), "n_layers": 200,
                    "engram_num_embeddings": [1] * 100}):
        with pytest.raises(EngramflowError, match="above the limit"):
            from_dict(raw | change)


@pytest.mark.timeout(120)  # a hang guard, not a speed bound
@pytest.mark.parametrize("layers,ngram", [(4, 4), (64, 2)])
def test_the_largest_allowed_layouts_build_in_bounded_time(v41_copy, layers, ngram):
    from engramflow.io.config import MAX_ENGRAM_PRIMES, from_dict
    from engramflow.io.layout import build_layout

    raw = json.loads((v41_copy / "config.json").read_text())
    cfg = from_dict(raw | {"engram_layer_ids": list(range(layers)), "engram_num_embeddings": [1] * layers,
                           "n_layers": 64, "engram_max_ngram_size": ngram,
                           "engram_n_heads": MAX_ENGRAM_PRIMES // layers // (ngram - 1), "engram_vocab_size": 1 << 40})
    build_layout(cfg)


# -- open: the index ---------------------------------------------------------------------------
@pytest.mark.parametrize("name,change,match", INDEX_CASES, ids=[c[0] for c in INDEX_CASES])
def test_bad_index_values_are_refused(capsys, tiny_copy, name, change, match):
    doc = json.loads((tiny_copy / INDEX).read_text())
    change(doc["weight_map"], doc)
    (tiny_copy / INDEX).write_text(json.dumps(doc))
    before = listing(tiny_copy)
    with pytest.raises(EngramflowError, match=match):
        Checkpoint(tiny_copy)
    for argv in (["inspect", tiny_copy], ["lookup", tiny_copy, "--layer", 1, "--ids", "1,2"],
                 ["generate", "--checkpoint", tiny_copy, "--prompt", "hi"]):
        assert match in cli(capsys, *argv)
    assert listing(tiny_copy) == before


@pytest.mark.parametrize("name,raw,match", RAW_INDEX_CASES, ids=[c[0] for c in RAW_INDEX_CASES])
def test_malformed_index_files_are_refused(capsys, tiny_copy, name, raw, match):
    (tiny_copy / INDEX).write_bytes(raw)
    with pytest.raises(EngramflowError, match=match):
        Checkpoint(tiny_copy)
    assert match in cli(capsys, "inspect", tiny_copy)


# -- values: NaN encodings ---------------------------------------------------------------------
def test_nan_wkv_scale_is_refused_at_open(capsys, v41_copy):
    poke(v41_copy, E0["wkv.scale"], (3, 2), 0xFF)
    refused_everywhere(capsys, v41_copy, f"tensor '{E0['wkv.scale']}' holds E8M0 scale 0xFF (NaN) at [3, 2]")


@pytest.mark.parametrize("tensor,index,value,what", [
    (E0["embed.scale"], (17, 0), 0xFF, "E8M0 scale 0xFF (NaN) at [17, 0]"),
    (E0["embed.weight"], (600, 31), 0x7F, "E4M3 code 0x7F (NaN) at [600, 31]"),
    (E0["embed.weight"], (0, 0), 0xFF, "E4M3 code 0xFF (NaN) at [0, 0]"),
    (E0["wkv.weight"], (1279, 5), 0xFF, "E4M3 code 0xFF (NaN) at [1279, 5]"),
])
def test_nan_in_tables_and_wkv_found_by_the_complete_scan(v41_copy, tensor, index, value, what):
    poke(v41_copy, tensor, index, value)
    ckpt = Checkpoint(v41_copy)  # a table is not scanned at open (190 GB in the release)
    with pytest.raises(EngramflowError, match=re.escape(f"tensor '{tensor}' holds {what}")):
        ckpt.verify_values(progress=False)


def test_zero_e8m0_scales_are_legal(v41_copy):
    """E8M0 byte 0 is 2^-127, a real (tiny) scale: not refused."""
    poke(v41_copy, E0["embed.scale"], ..., 0)
    poke(v41_copy, E0["wkv.scale"], ..., 0)
    assert Checkpoint(v41_copy).verify_values(progress=False)["tensors"] == 8


def test_nan_wkv_weight_is_refused_at_first_use(v41_copy):
    from engramflow.pipeline.engine import Engine

    poke(v41_copy, E0["wkv.weight"], (5, 7), 0x7F)
    Checkpoint(v41_copy)  # opens: the weight is read when the projection loads it
    with pytest.raises(EngramflowError, match=r"wkv.weight' holds E4M3 code 0x7F \(NaN\) at \[5, 7\]"):
        Engine(v41_copy)


def test_nan_backbone_weight_is_refused_at_first_use(v41_copy):
    from engramflow.pipeline.engine import Engine

    poke(v41_copy, WQ_B, (100, 3), 0xFF)
    with pytest.raises(EngramflowError, match=rf"'{WQ_B}' holds E4M3 code 0xFF \(NaN\) at \[100, 3\]"):
        Engine(v41_copy, backbone="v41")


def test_inspect_and_lookup_refuse_nan_tables(capsys, v41_copy):
    poke(v41_copy, E0["embed.scale"], ..., 0xFF)
    assert "0xFF" in cli(capsys, "inspect", v41_copy)
    assert "NaN" in cli(capsys, "lookup", v41_copy, "--layer", 0, "--ids", "1,2")


# -- prefill-job: the checkpoint and the output checked on the driver, before Ray Data ----------
@pytest.fixture
def prompts(tmp_path):
    p = tmp_path / "in.jsonl"
    p.write_text("".join(json.dumps({"id": str(i), "ids": [1, 2, 3 + i]}) + "\n" for i in range(3)))
    return p


@pytest.fixture
def no_ray(monkeypatch):
    """These refusals must come before Ray (and Ray Data) start."""
    import engramflow.data.prefill.job as job

    def started(*a, **k):
        raise AssertionError("prefill-job started Ray before refusing")

    monkeypatch.setattr(job, "ensure_ray", started)


def prefill(capsys, ckpt, prompts, out):
    return cli(capsys, "prefill-job", "--checkpoint", ckpt, "--input", prompts, "--output", out, "--ids-column", "ids")


@pytest.mark.parametrize("damage,match", [
    (lambda d: edit_header(d / MODEL, lambda h: h[WQ_A].__setitem__("shape", [256, 64])),
     f"{WQ_A}: expected F8_E4M3 [64, 256], found F8_E4M3 [256, 64]"),
    (lambda d: edit_header(d / MODEL, lambda h: h.pop(WQ_A) and None), f"{WQ_A} is missing"),
    (lambda d: poke(d, E0["wkv.weight"], (0, 0), 0x7F), "E4M3 code 0x7F (NaN)"),
    (lambda d: set_config(d, o_groups=3), "'o_groups': must divide"),
    (lambda d: (d / "config.json").write_text(deep(200_000)), "nested too deeply"),
    (lambda d: edit_header(d / MODEL, set_entry(WQ_A, "data_offsets", ["0", "1"])), "'data_offsets' must be"),
], ids=["wrong shape", "missing tensor", "nan wkv", "heads", "deep config", "string offsets"])
def test_prefill_job_refuses_bad_checkpoints_on_the_driver(capsys, no_ray, v41_copy, prompts, tmp_path, damage, match):
    damage(v41_copy)
    out = tmp_path / "new" / "deeper" / "out.parquet"
    assert match in prefill(capsys, v41_copy, prompts, out)
    assert not (tmp_path / "new").exists()  # nothing made, nothing left behind


def test_prefill_job_checks_the_output_first(capsys, no_ray, tiny_ckpt, prompts, tmp_path):
    (tmp_path / "a_dir").mkdir()
    assert "is a directory" in prefill(capsys, tiny_ckpt, prompts, tmp_path / "a_dir")
    (tmp_path / "a_file").write_text("x")
    assert "is not a folder" in prefill(capsys, tiny_ckpt, prompts, tmp_path / "a_file" / "out.parquet")
    assert "cannot be written" in prefill(capsys, tiny_ckpt, prompts, "/proc/self/nope/out.parquet")
    assert (tmp_path / "a_file").read_text() == "x" and list((tmp_path / "a_dir").iterdir()) == []
    with pytest.raises(EngramflowError, match="is a directory"):
        from engramflow.data.prefill.job import prefill_job

        prefill_job(tiny_ckpt, prompts, tmp_path / "a_dir", ids_column="ids")


def test_prefill_job_replica_failure_is_one_line(v41_copy, prompts, tmp_path, join_env):
    """A problem only a replica finds (a NaN in a backbone weight, read at first use): the job
    ends with the replica's own message, one line, no traceback; no output file. (A fresh
    process that joins the session's Ray: RAY_ADDRESS.)"""
    poke(v41_copy, WQ_B, (1, 1), 0x7F)
    out = tmp_path / "o" / "out.parquet"
    r = subprocess.run([sys.executable, "-m", "engramflow.cli.app", "prefill-job", "--checkpoint", str(v41_copy),
                        "--input", str(prompts), "--output", str(out), "--ids-column", "ids"],
                       capture_output=True, text=True, timeout=110, env=join_env)
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 2, r.stderr[-3000:]
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    assert lines[-1].startswith("engramflow prefill-job: error:") and "E4M3 code 0x7F (NaN)" in lines[-1]
    assert not (tmp_path / "o").exists()


# -- end to end in a fresh process: the real stderr --------------------------------------------
@pytest.mark.parametrize("argv,damage,match", [
    (["inspect", "{d}"], lambda d: edit_header(
        d / MODEL, lambda h: h[WQ_A].__setitem__("data_offsets", h[WQ_B]["data_offsets"])), "overlap"),
    (["lookup", "{d}", "--layer", "0", "--ids", "1,2"], lambda d: (d / "config.json").write_text(deep(200_000)),
     "nested too deeply"),
    (["generate", "--checkpoint", "{d}", "--prompt", "x"],
     lambda d: edit_header(d / MODEL, set_entry(WQ_A, "data_offsets", [0.0, 16384.0])), "'data_offsets' must be"),
], ids=["inspect overlap", "lookup deep config", "generate float offsets"])
def test_subprocess_one_line(v41_copy, argv, damage, match):
    damage(v41_copy)
    r = subprocess.run([sys.executable, "-m", "engramflow.cli.app", *[a.replace("{d}", str(v41_copy)) for a in argv]],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and match in r.stderr, r.stderr[-2000:]
