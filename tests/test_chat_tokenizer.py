"""V4.1's special tokens are single ids with the tokenizer a checkpoint ships; synthetic
checkpoints ship one; the V4-series fallback is the one that splits them."""
import json

from engramflow.chat import tokens as T
from engramflow.chat import encode_chat, ChatOptions
from engramflow.io.token_map import load_tokenizer
from engramflow.io.tokenizer_file import V41_RENAMES, checkpoint_tokenizer_path, load_checkpoint_tokenizer, split_tokens


def test_synthetic_checkpoint_ships_a_tokenizer_with_single_id_specials(v41_small_preset):
    assert checkpoint_tokenizer_path(v41_small_preset) == v41_small_preset / "tokenizer.json"
    tok = load_checkpoint_tokenizer(v41_small_preset)
    assert split_tokens(tok, T.SPECIAL + [T.DSML]) == {}
    image_id = json.loads((v41_small_preset / "config.json").read_text())["image_token_id"]
    assert tok.token_to_id(T.IMAGE) == image_id
    assert set(V41_RENAMES.values()) <= set(T.SPECIAL)


def test_v4_fallback_splits_the_renamed_tokens():
    split = split_tokens(load_tokenizer(), T.SPECIAL)
    assert set(split) == {T.SYSTEM, T.IMAGE} and all(len(ids) > 1 for ids in split.values())


def test_an_encoded_prompt_keeps_every_special_token_whole(v41_small_preset):
    tok = load_checkpoint_tokenizer(v41_small_preset)
    prompt = encode_chat([{"role": "system", "content": "s"}, {"role": "user", "content": "hi"}],
                         ChatOptions(thinking=True))
    ids = tok.encode(prompt, add_special_tokens=False).ids
    for name in (T.BOS, T.SYSTEM, T.USER, T.ASSISTANT, T.THINK_START):
        assert ids.count(tok.token_to_id(name)) == 1
    assert tok.decode(ids, skip_special_tokens=False) == prompt  # nothing lost on the way back


def test_other_ids_unchanged(v41_small_preset):
    own, base = load_checkpoint_tokenizer(v41_small_preset), load_tokenizer()
    assert own.get_vocab_size() == base.get_vocab_size()
    text = "Hello, wörld! 12345 <｜User｜>x</think>"
    assert own.encode(text).ids == base.encode(text).ids
