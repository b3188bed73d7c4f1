"""IncrementalDetokenizer: streamed text equals decoding all ids at once, however the ids are chunked, and stop
strings cut it exactly (vLLM's semantics), with real tokenizers: the default model's byte-level BPE (partial UTF-8
characters in tokens) and a SentencePiece-style one (byte fallback, a decoder that strips the leading space)."""

from __future__ import annotations

import gguf
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tunix_rt.checkpoints.default_model import DefaultModelMissing, default_model_path
from tunix_rt.checkpoints.tokenizer import Tokenizer
from tunix_rt.engine.detokenizer import IncrementalDetokenizer

TEXTS = [
    "Hello world",
    "  leading spaces, and a trailing one ",
    " one leading space",
    "line one\nline two\n\n\tindented\n",
    "emoji 🦊🚀👍🏽 done",
    "🦊",
    "日本語 中文 한국어",
    "héllo wörld — ünïcödé ñ",
    "mixed: naïve café 東京 🍣\n  ok.",
]

HYPOTHESIS = settings(max_examples=60)

# --- tokenizers ----------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm() -> Tokenizer:
    """The default model's tokenizer: GGUF byte-level BPE (reading the file takes a few seconds, so once)."""
    try:
        path = default_model_path()
    except DefaultModelMissing as e:
        pytest.skip(str(e))
    return Tokenizer.from_gguf(gguf.GGUFReader(path))


# Pieces in merge order (a piece's score ranks its merge); characters not listed go through byte fallback.
_SP_PIECES = [
    "▁", *"abcdefghijklmnopqrstuvwxyzHTW,.!?é",
    "▁t", "he", "▁the", "ll", "llo", "ello", "▁h", "▁hello", "or", "ld", "orld", "▁w", "▁world", "en", "▁en", "▁end",
]
_SP_SPECIALS = ["<unk>", "<s>", "</s>", "<|im_end|>"]  # unk, then control tokens


@pytest.fixture(scope="module")
def sentencepiece(tmp_path_factory) -> Tokenizer:
    """A tiny SentencePiece BPE vocabulary (Llama-style GGUF metadata): Metaspace pre-tokenizer, byte fallback,
    and a decoder that strips the leading space; loaded the way a real checkpoint is."""
    path = tmp_path_factory.mktemp("gguf") / "sentencepiece.gguf"
    tokens = [*_SP_SPECIALS, *(f"<0x{b:02X}>" for b in range(256)), *_SP_PIECES]
    n_fixed = len(_SP_SPECIALS) + 256
    writer = gguf.GGUFWriter(path, arch="llama")
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * n_fixed + [-float(i) for i in range(len(_SP_PIECES))])
    writer.add_token_types([2, 3, 3, 3, *[6] * 256, *[1] * len(_SP_PIECES)])  # unknown, control, byte, normal
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Tokenizer.from_gguf(gguf.GGUFReader(path))


@pytest.fixture(scope="module", params=["smollm", "sentencepiece"])
def tokenizer(request) -> Tokenizer:
    return request.getfixturevalue(request.param)


# --- helpers -------------------------------------------------------------------------------------------------------


def _chunks(ids, sizes):
    """ids cut into consecutive chunks of the given sizes (cycled); one id at a time when sizes is empty."""
    sizes = list(sizes) or [1]
    out, i, k = [], 0, 0
    while i < len(ids):
        out.append(ids[i : i + sizes[k % len(sizes)]])
        i += sizes[k % len(sizes)]
        k += 1
    return out


def _stream(tok, ids, *, prompt=(), sizes=(), **kwargs):
    """Feed ids in chunks; return the detokenizer, what each add() returned, and what flush() returned. Checks on
    the way that streamed text never runs ahead of `text`."""
    det = IncrementalDetokenizer(tok, list(prompt), **kwargs)
    pieces, streamed = [], ""
    for chunk in _chunks(list(ids), sizes):
        pieces.append(det.add(chunk))
        streamed += pieces[-1]
        assert det.text.startswith(streamed)
    return det, pieces, det.flush()


def _first_stop(text: str, stops) -> tuple[int, int, str] | None:
    """Brute-force reference: the stop occurrence that completes first (ties: the longer, i.e. earlier, one)."""
    for end in range(1, len(text) + 1):
        ending = [s for s in stops if text[:end].endswith(s)]
        if ending:
            stop = max(ending, key=len)
            return end - len(stop), end, stop
    return None


# --- streaming equals decoding everything at once ------------------------------------------------------------------


def test_decoding_each_token_alone_is_wrong(smollm, sentencepiece):
    """Why the window exists: per-token decodes break characters split over tokens and drop SentencePiece's
    spaces between words, so the tests below would catch a detokenizer that did that."""
    for tok, text in [(smollm, "emoji 🦊 done"), (sentencepiece, "hello wörld")]:
        ids = tok.encode(text, add_special_tokens=False)
        assert "".join(tok.decode([i]) for i in ids) != tok.decode(ids) == text


@pytest.mark.parametrize("text", TEXTS)
def test_one_id_at_a_time_equals_decode(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    det, pieces, rest = _stream(tokenizer, ids)
    expected = tokenizer.decode(ids)
    assert "".join(pieces) + rest == det.text == expected
    assert rest == ""  # every character was complete by the last id, and there are no stop strings
    assert not any("\ufffd" in piece for piece in pieces)  # partial characters are never streamed
    assert det.stop_reason is None


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("sizes", [(2,), (3, 1), (7,), (1000,)])
def test_chunks_equal_decode(tokenizer, text, sizes):
    ids = tokenizer.encode(text, add_special_tokens=False)
    det, pieces, rest = _stream(tokenizer, ids, sizes=sizes)
    assert "".join(pieces) + rest == det.text == tokenizer.decode(ids)


@HYPOTHESIS
@given(text=st.text(st.characters(exclude_categories=("Cs",)), max_size=40), sizes=st.lists(st.integers(1, 5)))
def test_any_text_any_chunking_equals_decode(tokenizer, text, sizes):
    ids = tokenizer.encode(text, add_special_tokens=False)
    det, pieces, rest = _stream(tokenizer, ids, sizes=sizes)
    assert "".join(pieces) + rest == det.text == tokenizer.decode(ids)


@pytest.fixture(scope="module")
def smollm_byte_ids(smollm) -> list[int]:
    """Tokens of single non-ASCII bytes (they decode alone to U+FFFD); byte-level vocabularies start with them."""
    return [i for i in range(1000) if smollm.decode([i]) == "\ufffd"]


@HYPOTHESIS
@given(data=st.data(), sizes=st.lists(st.integers(1, 4)), skip=st.booleans())
def test_arbitrary_ids_equal_decode(smollm, smollm_byte_ids, data, sizes, skip):
    """Ids a model might sample: stray bytes (invalid UTF-8), special tokens, anything in the vocabulary.

    Byte-level only: HF's ByteFallback decoder turns a whole run of byte tokens into U+FFFDs when any of them is
    invalid, so there a stray byte can change text already streamed (vLLM has the same limit).
    """
    assert len(smollm_byte_ids) > 100
    some_id = st.one_of(st.integers(0, smollm.vocab_size - 1), st.sampled_from(smollm_byte_ids), st.integers(0, 3))
    ids = data.draw(st.lists(some_id, max_size=20))
    det, pieces, rest = _stream(smollm, ids, sizes=sizes, skip_special_tokens=skip)
    assert "".join(pieces) + rest == det.text == smollm.decode(ids, skip_special_tokens=skip)


def test_partial_utf8_is_held_until_complete(smollm):
    ids = smollm.encode("🦊", add_special_tokens=False)
    assert len(ids) == 3  # the fox's four bytes span three tokens
    det = IncrementalDetokenizer(smollm, [])
    assert [det.add([ids[0]]), det.text, det.add([ids[1]]), det.text] == ["", "", "", ""]
    assert det.add([ids[2]]) == "🦊"
    assert det.text == "🦊"
    assert det.flush() == ""


def test_flush_releases_an_incomplete_character(smollm):
    ids = smollm.encode("ok 🦊", add_special_tokens=False)[:-1]  # the fox's last byte never comes
    det, pieces, rest = _stream(smollm, ids)
    assert "".join(pieces) == "ok"
    assert rest == smollm.decode(ids)[2:]
    assert rest.endswith("\ufffd") and rest.startswith(" ")
    assert det.text == smollm.decode(ids)
    with pytest.raises(RuntimeError, match="flush"):
        det.add([ids[0]])
    assert det.flush() == ""


def test_prompt_context_keeps_sentencepiece_leading_space(sentencepiece):
    """After prompt text, "▁world" means " world" (as vLLM streams it); at the start of the text the decoder
    strips that space, as decode(output_ids) does, and a prompt ending in special tokens counts as the start."""
    prompt = sentencepiece.encode("hello")
    out = sentencepiece.encode(" world", add_special_tokens=False)
    assert sentencepiece.decode(out) == "world"
    assert "".join(_stream(sentencepiece, out, prompt=prompt)[1]) == " world"
    assert "".join(_stream(sentencepiece, out, prompt=[sentencepiece.bos_token_id])[1]) == "world"
    assert "".join(_stream(sentencepiece, out)[1]) == "world"


@pytest.mark.parametrize("text", TEXTS)
def test_prompt_context_byte_level(smollm, text):
    """Byte-level tokens carry their own spaces: after any prompt the text is decode(output_ids)."""
    prompt = smollm.encode("<|im_start|>user\nSay something 🦊<|im_end|>\n<|im_start|>assistant\n")
    ids = smollm.encode(text, add_special_tokens=False)
    det, pieces, rest = _stream(smollm, ids, prompt=prompt, sizes=(2, 1))
    assert "".join(pieces) + rest == det.text == smollm.decode(ids)


# --- stop strings --------------------------------------------------------------------------------------------------

ANSWER = "The answer is 42. Done here.\nNext question"


@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize("sizes", [(), (3,), (100,)])
def test_stop_string_across_tokens(smollm, include, sizes):
    stop = "42. Done"
    ids = smollm.encode(ANSWER, add_special_tokens=False)
    assert not any(part in smollm.decode([i]) for i in ids for part in ("42", ". D"))  # spans four tokens
    det, pieces, rest = _stream(smollm, ids, sizes=sizes, stop=[stop], include_stop_str_in_output=include)
    expected = "The answer is 42. Done" if include else "The answer is "
    assert det.text == expected
    assert "".join(pieces) == expected  # released as soon as the match completes, nothing after it
    assert rest == ""
    assert det.stop_reason == stop
    assert det.add(smollm.encode(" more", add_special_tokens=False)) == ""
    assert det.text == expected


def test_nothing_after_the_stop_is_streamed(sentencepiece):
    text = "the end. hello world"
    ids = sentencepiece.encode(text, add_special_tokens=False)
    det = IncrementalDetokenizer(sentencepiece, [], stop=["d. h"])
    streamed = []
    for i in ids:
        streamed.append(det.add([i]))
        assert "the en".startswith("".join(streamed))
    assert "".join(streamed) == det.text == "the en"
    assert streamed[-1] == ""  # "world" came after the match
    assert det.stop_reason == "d. h"
    assert det.flush() == ""


def test_stops_are_not_searched_before_min_tokens(sentencepiece):
    """add(find_stops=False), as for a request short of its min_tokens: the text passes whole, and a stop string
    completed by later text that is searched still ends it."""
    ids = sentencepiece.encode("the end. the end. the end", add_special_tokens=False)
    det = IncrementalDetokenizer(sentencepiece, [], stop=["end"])
    half = len(ids) // 2
    streamed = "".join(det.add([i], find_stops=False) for i in ids[:half])
    assert det.stop_reason is None and streamed == det.text and "end" in streamed
    streamed += "".join(det.add([i]) for i in ids[half:])
    assert det.stop_reason == "end" and det.text == streamed == "the end. the "  # cut where the second one starts
    # a stop that ended inside the unsearched text is not found later through the held-over tail
    ids = sentencepiece.encode("x\ny\nz", add_special_tokens=False)
    det = IncrementalDetokenizer(sentencepiece, [], stop=["\n", "STOP"])
    first = next(i for i in range(1, len(ids) + 1) if "\n" in sentencepiece.decode(ids[:i]))
    streamed = "".join(det.add([i], find_stops=False) for i in ids[:first])
    streamed += "".join(det.add([i]) for i in ids[first:])
    assert det.stop_reason == "\n" and det.text == streamed == "x\ny"


def test_possible_stop_start_is_held_then_released(sentencepiece):
    """"STOP" at the end could still become "STOP!": it is held back from add() (but is in `text`), and flush()
    releases it when the sequence ends without the match."""
    ids = sentencepiece.encode("the end STOP", add_special_tokens=False)
    det = IncrementalDetokenizer(sentencepiece, [], stop=["STOP!"])
    streamed = "".join(det.add([i]) for i in ids)
    assert streamed == "the end "
    assert det.text == "the end STOP"
    assert det.stop_reason is None
    assert det.flush() == "STOP"
    assert det.text == "the end STOP"


def test_held_text_is_released_when_the_match_fails(smollm):
    ids = smollm.encode("4 42 42", add_special_tokens=False)
    assert [smollm.decode([i]) for i in ids] == ["4", " ", "4", "2", " ", "4", "2"]
    det = IncrementalDetokenizer(smollm, [], stop=["42!"])
    # "4" and "42" may still become "42!": held until the next text shows they do not.
    assert [det.add([i]) for i in ids] == ["", "4 ", "", "", "42 ", "", ""]
    assert det.text == "4 42 42"
    assert det.flush() == "42"
    assert det.stop_reason is None


@pytest.mark.parametrize("sizes", [(), (100,)])
def test_earliest_stop_wins_not_the_first_listed(smollm, sizes):
    ids = smollm.encode("hello world, goodbye", add_special_tokens=False)
    det, pieces, rest = _stream(smollm, ids, sizes=sizes, stop=["bye", "world", "lo w"])
    assert det.stop_reason == "lo w"
    assert "".join(pieces) + rest == det.text == "hel"


@pytest.mark.parametrize("sizes", [(), (2,), (100,)])
def test_stop_inside_a_longer_stop_matches_first(smollm, sizes):
    """With "abcd" and "bc", "bc" completes first, so it ends the text whether the ids come one by one or at once."""
    ids = smollm.encode("xx abcd yy", add_special_tokens=False)
    det, pieces, rest = _stream(smollm, ids, sizes=sizes, stop=["abcd", "bc"])
    assert det.stop_reason == "bc"
    assert "".join(pieces) + rest == det.text == "xx a"


def test_stop_found_in_text_held_for_an_incomplete_character(smollm):
    """Ids that end in a character whose last byte never arrives hold back all their text; flush() still finds
    the stop string in it and cuts there."""
    ids = smollm.encode("go STOP 🦊", add_special_tokens=False)[:-1]
    det = IncrementalDetokenizer(smollm, [], stop=["STOP"])
    assert det.add(ids) == ""
    assert det.text == "" and det.stop_reason is None
    assert det.flush() == "go "
    assert det.text == "go "
    assert det.stop_reason == "STOP"


def test_stop_spans_many_chunks_in_a_long_generation(smollm):
    """Near misses all along a long text, then the match: only new text plus an overlap is searched each step,
    which must still find a match that started several tokens back."""
    text = "STO ST S " * 300 + "STOP here"
    ids = smollm.encode(text, add_special_tokens=False)
    det, pieces, rest = _stream(smollm, ids, stop=["STOP", "never matches"])
    assert det.stop_reason == "STOP"
    assert "".join(pieces) + rest == det.text == "STO ST S " * 300


@HYPOTHESIS
@given(
    text=st.text(st.sampled_from("ab é🦊\n日"), max_size=30),
    stops=st.lists(st.text(st.sampled_from("ab é🦊\n日"), min_size=1, max_size=4), min_size=1, max_size=3),
    sizes=st.lists(st.integers(1, 4)),
    include=st.booleans(),
)
def test_stop_strings_match_brute_force(tokenizer, text, stops, sizes, include):
    ids = tokenizer.encode(text, add_special_tokens=False)
    full = tokenizer.decode(ids)
    match = _first_stop(full, stops)
    if match is None:
        expected, reason = full, None
    else:
        start, end, reason = match
        expected = full[: end if include else start]
    det, pieces, rest = _stream(tokenizer, ids, sizes=sizes, stop=stops, include_stop_str_in_output=include)
    streamed = ""
    for piece in pieces:
        streamed += piece
        assert expected.startswith(streamed)  # nothing past the stop, ever
    assert streamed + rest == det.text == expected
    assert det.stop_reason == reason
    if reason is not None and not include:
        assert not any(s in streamed for s in stops)


# --- special tokens and arguments ----------------------------------------------------------------------------------

TURN = "<|im_start|>assistant\nHi there<|im_end|>"


def test_special_tokens_kept_or_skipped(smollm):
    ids = smollm.encode(TURN)
    assert smollm.decode([ids[0]], skip_special_tokens=False) == "<|im_start|>"
    _, pieces, rest = _stream(smollm, ids, skip_special_tokens=False)
    assert "".join(pieces) + rest == TURN
    assert pieces[0] == "<|im_start|>" and pieces[-1] == "<|im_end|>"
    _, pieces, rest = _stream(smollm, ids)
    assert "".join(pieces) + rest == "assistant\nHi there"
    assert pieces[0] == "" and pieces[-1] == ""


def test_stop_string_made_of_a_special_token(smollm, sentencepiece):
    ids = smollm.encode(TURN)
    det, pieces, _ = _stream(smollm, ids, skip_special_tokens=False, stop=["<|im_end|>"])
    assert det.stop_reason == "<|im_end|>"
    assert "".join(pieces) == det.text == "<|im_start|>assistant\nHi there"
    ids = sentencepiece.encode("hello<|im_end|>world", add_special_tokens=False)
    det, pieces, rest = _stream(sentencepiece, ids, skip_special_tokens=False)
    assert "".join(pieces) + rest == "hello<|im_end|>world"
    det, pieces, rest = _stream(sentencepiece, ids)
    assert "".join(pieces) + rest == "helloworld"


def test_empty_stop_string_is_value_error(smollm):
    with pytest.raises(ValueError, match="`stop`"):
        IncrementalDetokenizer(smollm, [], stop=["ok", ""])


def test_one_stop_string_given_as_str(smollm):
    det, pieces, rest = _stream(smollm, smollm.encode("say lol", add_special_tokens=False), stop="lo")
    assert det.stop_reason == "lo"
    assert "".join(pieces) + rest == "say "


def test_numpy_ids(smollm):
    np = pytest.importorskip("numpy")
    prompt = np.asarray(smollm.encode("Question: hi"), dtype=np.int32)
    ids = np.asarray(smollm.encode(" Answer: 🦊", add_special_tokens=False), dtype=np.int32)
    det = IncrementalDetokenizer(smollm, prompt)
    assert det.add(ids[:2]) + det.add(ids[2:]) + det.flush() == " Answer: 🦊"
