import numpy as np
import pytest
from tokenizers import Tokenizer, models

from engramflow.errors import EngramflowError
from engramflow.io.token_map import TokenMap, default_tokenizer_path


def test_v4_tokenizer_compresses_to_the_config_size(v4_token_map, v41_config):
    assert v4_token_map.vocab_size == v41_config.vocab_size == 129_280
    assert v4_token_map.compressed_vocab_size == v41_config.engram_compressed_vocab_size
    # first-seen order: compressed ids appear in increasing order of first use
    first = np.unique(v4_token_map.table, return_index=True)[1]
    assert (np.diff(first) > 0).all()


def test_v4_map_merges_case_and_leading_space_variants(v4_token_map):
    tok = Tokenizer.from_file(str(default_tokenizer_path()))
    ids = [tok.token_to_id(t) for t in ("Hello", "hello", "ĠHello", "Ġhello")]
    assert None not in ids
    assert len({int(v4_token_map.table[i]) for i in ids}) == 1


def _word_level(tmp_path, words):
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token=words[0]))
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    return path


def test_any_hf_tokenizer_json(tmp_path):
    words = ["[UNK]", "Hello", "hello", "HÉLLO", "world", "World", "Straße", "strasse", "\t"]
    tm = TokenMap.build(_word_level(tmp_path, words))
    # NFKC+NFD+StripAccents+Lowercase merge case and accents; ß stays ß (no case folding)
    assert tm.table.tolist() == [0, 1, 1, 1, 2, 2, 3, 4, 5]
    assert tm.compressed_vocab_size == 6


def test_round_trip_and_size_checks(tmp_path, v4_token_map, v41_config):
    path = tmp_path / "engram_token_map.bin"
    v4_token_map.save(path)
    assert path.stat().st_size == 4 * 129_280
    assert np.array_equal(np.fromfile(path, dtype="<u4"), v4_token_map.table)
    loaded = TokenMap.load(path, v41_config.vocab_size, v41_config.engram_compressed_vocab_size)
    assert np.array_equal(loaded.table, v4_token_map.table)
    with pytest.raises(EngramflowError, match="129280 entries but the vocabulary has 1000"):
        TokenMap.load(path, vocab_size=1000)
    with pytest.raises(EngramflowError, match="compresses to 99092 ids .*=5"):
        TokenMap.load(path, compressed_vocab_size=5)
    path.write_bytes(b"\0" * 7)
    with pytest.raises(EngramflowError, match="not a whole number"):
        TokenMap.load(path)
    with pytest.raises(EngramflowError, match="not found"):
        TokenMap.load(tmp_path / "nope.bin")


@pytest.mark.parametrize("ids,match", [
    ([1, 129_280], "token id 129280 at position 1 is out of range"),
    ([-1], "token id -1 at position 0"),
    ([1.5], "must be integers, got 1.5"),
    (["7"], "must be integers, got '7'"),
    ([True], "must be integers, got True"),
    ([[1, 2]], "1-D"),
])
def test_compress_rejects_bad_ids(v4_token_map, ids, match):
    with pytest.raises(EngramflowError, match=match):
        v4_token_map.compress(ids)
