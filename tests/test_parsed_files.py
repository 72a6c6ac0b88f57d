"""Objects built from a file are built once per process for the same bytes (io/parsed_files.py):
the real V4 tokenizer file, copied and rewritten on disk."""
import json
import shutil

import pytest

from engramflow.errors import EngramflowError
from engramflow.io import parsed_files
from engramflow.io.token_map import default_tokenizer_path, load_tokenizer


@pytest.fixture
def tokenizer_file(tmp_path):
    path = tmp_path / "tokenizer.json"
    shutil.copyfile(default_tokenizer_path(), path)
    return path


def test_the_same_bytes_are_parsed_once_under_any_name(tokenizer_file, tmp_path):
    first = load_tokenizer(tokenizer_file)
    assert load_tokenizer(tokenizer_file) is first
    other = tmp_path / "elsewhere.json"
    shutil.copyfile(tokenizer_file, other)
    assert load_tokenizer(other) is first  # the key is the bytes, not the name
    assert first.encode("The quick brown fox").ids == load_tokenizer().encode("The quick brown fox").ids


def test_a_rewritten_file_is_parsed_again_at_once(tokenizer_file):
    before = load_tokenizer(tokenizer_file)
    spec = json.loads(tokenizer_file.read_text(encoding="utf-8"))
    entry = next(e for e in spec["added_tokens"] if e["id"] == 128826)
    entry["content"] = "<|renamed|>"
    tokenizer_file.write_text(json.dumps(spec, ensure_ascii=False), encoding="utf-8")  # same second, same name
    after = load_tokenizer(tokenizer_file)
    assert after is not before
    assert after.token_to_id("<|renamed|>") == 128826 and before.token_to_id("<|renamed|>") is None


def test_a_bad_file_is_an_error_each_time_and_is_not_kept(tokenizer_file):
    good = tokenizer_file.read_bytes()
    tokenizer_file.write_bytes(good[: len(good) // 2])
    for _ in range(2):
        with pytest.raises(EngramflowError, match="cannot load tokenizer"):
            load_tokenizer(tokenizer_file)
    tokenizer_file.write_bytes(good)
    assert load_tokenizer(tokenizer_file).get_vocab_size() > 128_000
    with pytest.raises(EngramflowError, match="tokenizer file not found"):
        load_tokenizer(tokenizer_file.parent / "missing.json")


def test_kinds_keep_apart_and_the_oldest_goes_first(tmp_path):
    built = []

    def build(kind):
        return lambda path: built.append((kind, path.read_text())) or (kind, path.read_text())

    files = []
    for i in range(parsed_files.MAX_KEPT + 1):
        files.append(tmp_path / f"f{i}")
        files[-1].write_text(str(i))
    assert parsed_files.parsed(files[0], "a", build("a")) == ("a", "0")
    assert parsed_files.parsed(files[0], "b", build("b")) == ("b", "0")  # another kind: built for itself
    assert parsed_files.parsed(files[0], "a", build("a")) == ("a", "0") and len(built) == 2
    for f in files[1:]:  # MAX_KEPT newer entries push the oldest ("b", the first "a" used since) out
        parsed_files.parsed(f, "a", build("a"))
    n = len(built)
    parsed_files.parsed(files[0], "b", build("b"))
    assert len(built) == n + 1
    parsed_files.forget()
    parsed_files.parsed(files[-1], "a", build("a"))
    assert len(built) == n + 2
