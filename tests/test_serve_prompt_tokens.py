"""serve/prompt_tokens.py and chat/pieces.py with the real tokenizers: a prompt without
special-token text keeps exactly the ids of its whole text (every golden prompt of the official
encoder, with the synthetic V4.1 tokenizer and the V4 fallback); client text that spells special
tokens becomes plain text in every field; the image placeholder in text is refused."""
import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from engramflow.chat import ChatOptions, encode_chat
from engramflow.chat import tokens as T
from engramflow.chat.encoder import encode_chat_pieces
from engramflow.chat.messages import ChatError
from engramflow.chat.pieces import joined
from engramflow.io.token_map import default_tokenizer_path
from engramflow.io.tokenizer_file import v41_tokenizer_json
from engramflow.serve.prompt_tokens import PromptTokenizer
from injection_cases import INJECTED, PLACEHOLDER_PARAMS, role_cases
from prompt_oracle import expected_ids

GOLDEN = json.loads((Path(__file__).parent / "data" / "chat_golden.json").read_text(encoding="utf-8"))
SPECS = {"v41": v41_tokenizer_json, "v4_fallback": lambda: default_tokenizer_path().read_text(encoding="utf-8")}


@pytest.fixture(scope="module", params=sorted(SPECS))
def spec(request):
    return SPECS[request.param]()


@pytest.fixture(scope="module")
def tok(spec):
    return Tokenizer.from_str(spec)


@pytest.fixture(scope="module", params=["written_out_again", "from_its_file"])
def pt(tok, spec, request):
    """Both ways the plain-text copy is made: from the tokenizer, or (a server) from its file."""
    return PromptTokenizer(tok, spec if request.param == "from_its_file" else None)


def _options(req: dict) -> ChatOptions:
    return ChatOptions(thinking=req["thinking"], reasoning_effort=req.get("reasoning_effort"), tools=req.get("tools"))


def test_golden_prompts_keep_their_exact_ids(tok, pt):
    for case in GOLDEN["encode"]:
        req = case["request"]
        pieces = encode_chat_pieces(req["messages"], _options(req))
        assert joined(pieces) == case["prompt"]
        assert pt.ids(pieces) == tok.encode(case["prompt"], add_special_tokens=False).ids, case["name"]


@pytest.mark.parametrize("role", sorted(role_cases("x")))
def test_special_tokens_in_every_field_are_plain_text(tok, pt, role):
    messages, tools, thinking = role_cases(INJECTED)[role]
    options = ChatOptions(thinking=thinking, tools=tools)
    got = pt.ids(encode_chat_pieces(messages, options))
    assert got == expected_ids(tok, messages, options, INJECTED)
    naive = tok.encode(encode_chat(messages, options), add_special_tokens=False).ids
    assert len(naive) < len(got)  # read with special tokens parsed, the text would have forged structure
    forged = {tok.token_to_id(t) for t in (T.EOS, T.SYSTEM, T.USER)} - {None}
    structural = tok.encode(encode_chat(role_cases("plain words")[role][0], options), add_special_tokens=False).ids
    for tid in forged:  # no special id beyond those the format itself writes
        assert got.count(tid) <= structural.count(tid)


@pytest.mark.parametrize("role", sorted(PLACEHOLDER_PARAMS))
def test_image_placeholder_written_as_text_is_refused(role):
    messages, tools, thinking = role_cases(f"see {T.IMAGE} here")[role]
    with pytest.raises(ChatError) as e:
        encode_chat_pieces(messages, ChatOptions(thinking=thinking, tools=tools))
    assert e.value.param == PLACEHOLDER_PARAMS[role] and "image_url" in str(e.value)


def test_image_parts_are_slots_with_the_configured_id(pt):
    msgs = [{"role": "user", "content": [{"type": "text", "text": "a"},
                                         {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}},
                                         {"type": "text", "text": "b"}]}]
    pieces = encode_chat_pieces(msgs, ChatOptions(thinking=False))
    ids = pt.ids(pieces, image_id=129264)
    assert ids.count(129264) == 1
    with pytest.raises(ValueError):
        pt.ids(pieces)  # a slot needs the checkpoint's placeholder id


def test_text_ids_release_the_gil_on_long_text(pt):
    """A long run is tokenized by encode_batch (the GIL released): the same ids as encode."""
    text = "plain words, " * 2000
    assert pt.text_ids(text) == pt.plain.encode(text, add_special_tokens=False).ids
