"""Tokenizer must give exactly transformers' ids, text and chat prompts, whether built from GGUF metadata or from
an HF directory; transformers is the reference, loaded here only."""

from __future__ import annotations

import io
import json

import gguf
import pytest

from tunix_rt.checkpoints.default_model import DefaultModelMissing, default_model_path
from tunix_rt.checkpoints.gguf_file import GGUFFile
from tunix_rt.checkpoints.gguf_loader import open_gguf
from tunix_rt.checkpoints.tokenizer import Tokenizer

TEXTS = [
    "Hello world",
    "  leading spaces, trailing  ",
    "héllo wörld — ünïcödé ñ 日本語 中文 한국어",
    "emoji 🦊🚀👍🏽 done",
    "def f(x):\n\tif x:\n        return 12345678\n\n\n",
    "numbers 3.14159 1,000,000 0x1F 12345678",
    "I'm you're they'll DON'T",
    "\n \n\n  \t x",
    "<|im_start|>user\nhi<|im_end|>\n",
    "a<|endoftext|>b<file_sep>c",
    "",
]
SYSTEM_AND_USER = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 2+2? Answer with <b>bold</b> & \"quotes\" 😀."},
]
USER_ONLY = SYSTEM_AND_USER[1:]  # SmolLM2's template then writes its default system prompt
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


def _hf_chat(hf, messages, **kwargs):
    return hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **kwargs)


def _hf_chat_ids(hf, messages, **kwargs):
    return list(hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False, **kwargs))


# --- the default model's GGUF (byte-level BPE, pre-tokenizer "smollm") ----------------------------------------


@pytest.fixture(scope="module")
def gguf_path():
    try:
        return default_model_path()
    except DefaultModelMissing as e:
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def gguf_reader(gguf_path):
    return open_gguf(gguf_path)


@pytest.fixture(scope="module")
def ours(gguf_reader):
    return Tokenizer.from_gguf(gguf_reader)


@pytest.fixture(scope="module")
def hf(gguf_path):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)


@pytest.mark.slow
@pytest.mark.parametrize("text", TEXTS)
def test_gguf_encode_matches_transformers(ours, hf, text):
    assert ours.encode(text) == hf.encode(text)
    assert ours.encode(text, add_special_tokens=False) == hf.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("text", TEXTS)
def test_gguf_decode_round_trips(ours, hf, text):
    ids = ours.encode(text)
    assert ours.decode(ids, skip_special_tokens=False) == text == hf.decode(ids)
    assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True)


def test_gguf_special_tokens_match_transformers(ours, hf):
    assert (ours.bos_token, ours.eos_token) == (hf.bos_token, hf.eos_token)
    assert (ours.bos_token_id, ours.pad_token_id) == (hf.bos_token_id, hf.pad_token_id)
    assert ours.eos_token_ids == [hf.eos_token_id]
    assert ours.add_bos_token is False  # SmolLM2 writes no BOS; its chat template starts turns itself
    assert ours.vocab_size == len(hf)


@pytest.mark.parametrize("messages", [SYSTEM_AND_USER, USER_ONLY], ids=["system+user", "user-only"])
@pytest.mark.parametrize("tools", [None, [WEATHER_TOOL]], ids=["no-tools", "tools"])
def test_gguf_chat_template_matches_transformers(ours, hf, messages, tools):
    text = ours.apply_chat_template(messages, tools=tools)
    assert text == _hf_chat(hf, messages, tools=tools)
    assert text.endswith("<|im_start|>assistant\n")
    assert ours.apply_chat_template(messages, tools=tools, tokenize=True) == _hf_chat_ids(hf, messages, tools=tools)


def test_template_features_match_transformers(ours, hf):
    """The jinja environment: tojson arguments and no HTML escaping, loop controls, trim/lstrip blocks,
    `{% generation %}`, the variables every render gets, and caller kwargs."""
    template = (
        "{%- for message in messages %}\n"
        "  {%- if loop.index > 2 %}{% break %}{% endif %}\n"
        "  {{ message | tojson(indent=2) }}|{{ message['content'] | tojson(separators=(',', ':')) }}\n"
        "{% endfor %}\n"
        "{% generation %}{{ bos_token }}{{ eos_token }}{{ greeting }}{% endgeneration %}\n"
        "{% if tools is none and documents is none %}none{% endif %}"
    )
    messages = [*SYSTEM_AND_USER, {"role": "assistant", "content": "4"}]
    mine = Tokenizer(ours.backend, bos_token=ours.bos_token, eos_token=ours.eos_token, chat_template=template)
    text = mine.apply_chat_template(messages, greeting="héllo")
    assert text == _hf_chat(hf, messages, chat_template=template, greeting="héllo")


def test_template_raise_exception_is_value_error(ours):
    mine = Tokenizer(ours.backend, chat_template="{{ raise_exception('roles must alternate') }}")
    with pytest.raises(ValueError, match="roles must alternate"):
        mine.apply_chat_template(USER_ONLY)


# --- an HF directory ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hf_dir(hf, tmp_path_factory):
    path = tmp_path_factory.mktemp("hf_tokenizer")
    hf.save_pretrained(path)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, 2]}))
    return path


@pytest.fixture(scope="module")
def hf_from_dir(hf_dir):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(hf_dir)


def test_hf_dir_matches_transformers(hf_dir, hf_from_dir):
    assert (hf_dir / "chat_template.jinja").is_file()  # the layout transformers writes now
    ours = Tokenizer.from_hf_dir(hf_dir)
    for text in TEXTS:
        assert ours.encode(text) == hf_from_dir.encode(text)
    for messages in (SYSTEM_AND_USER, USER_ONLY):
        assert ours.apply_chat_template(messages) == _hf_chat(hf_from_dir, messages)
        assert ours.apply_chat_template(messages, tokenize=True) == _hf_chat_ids(hf_from_dir, messages)
    assert ours.eos_token_ids == [2, 0]  # the tokenizer's eos first, then generation_config's, without repeats
    assert (ours.bos_token_id, ours.pad_token_id, ours.add_bos_token) == (1, 2, False)


def test_hf_dir_template_in_tokenizer_config(hf_dir, tmp_path):
    """Older checkpoints keep the template (or a list of named ones) in tokenizer_config.json."""
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((hf_dir / name).read_bytes())
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["chat_template"] = [{"name": "default", "template": "{{ messages[0]['content'] }}"}]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    ours = Tokenizer.from_hf_dir(tmp_path)
    assert ours.apply_chat_template(USER_ONLY) == USER_ONLY[0]["content"]
    assert ours.eos_token_ids == [2]


# --- tokenizer-only GGUF files written here --------------------------------------------------------------------


def _write_gguf(path, arch: str, tokenizer_model: str, tokens, arrays: dict | None = None, **fields) -> GGUFFile:
    """A GGUF with tokenizer metadata and the few hyperparameters transformers needs to load it; no tensors.
    `arrays`: raw array fields by key, of any item type."""
    writer = gguf.GGUFWriter(path, arch=arch)
    writer.add_block_count(1)
    writer.add_context_length(64)
    writer.add_embedding_length(8)
    writer.add_feed_forward_length(16)
    writer.add_head_count(2)
    writer.add_head_count_kv(2)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(4)
    writer.add_tokenizer_model(tokenizer_model)
    writer.add_token_list(tokens)
    for name, value in fields.items():
        getattr(writer, f"add_{name}")(value)
    for key, value in (arrays or {}).items():
        writer.add_array(key, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return open_gguf(path)


def _load_hf_gguf(path):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@pytest.fixture(scope="module")
def llama3_style(gguf_reader, tmp_path_factory):
    """The default model's first 5000 tokens under Llama 3's pre-tokenizer ("llama-bpe"), with add_bos_token and
    an end-of-turn token set.

    Its tokens are in merge order, so the merges that build them form a smaller vocabulary of their own; small,
    because reading a GGUF's token list is slow (seconds for 49k tokens).
    """
    path = tmp_path_factory.mktemp("gguf") / "llama_bpe.gguf"
    field = lambda key: gguf_reader.fields[key].contents()  # noqa: E731
    tokens = field("tokenizer.ggml.tokens")[:5000]
    kept = set(tokens)
    merges = [merge for merge in field("tokenizer.ggml.merges") if merge.replace(" ", "") in kept]
    reader = _write_gguf(
        path,
        "llama",
        "gpt2",
        tokens,
        tokenizer_pre="llama-bpe",
        token_types=field("tokenizer.ggml.token_type")[:5000],
        token_merges=merges,
        bos_token_id=1,
        eos_token_id=2,
        eot_token_id=0,
        add_bos_token=True,
        chat_template=field("tokenizer.chat_template"),
    )
    return Tokenizer.from_gguf(reader), _load_hf_gguf(path)


def test_gguf_llama3_pre_tokenizer_and_bos_match_transformers(llama3_style):
    ours, hf = llama3_style
    assert ours.add_bos_token
    assert ours.eos_token_ids == [2, 0]  # the end-of-turn token ends generation too
    for text in TEXTS:
        assert ours.encode(text) == hf.encode(text)
    assert ours.encode("x") == [ours.bos_token_id, *ours.encode("x", add_special_tokens=False)]
    # The rendered prompt is encoded without adding BOS again.
    assert ours.apply_chat_template(USER_ONLY, tokenize=True) == _hf_chat_ids(hf, USER_ONLY)


SENTENCEPIECE_CORPUS = [
    "hello world, the quick brown fox jumps over the lazy dog.",
    "Hello World! Tokenizers split text into pieces; héllo wörld.",
    "numbers 12345 and code: def f(x):\n    return x * 2",
    "the the the hello hello world world fox fox dog dog",
]
SENTENCEPIECE_TEXTS = [
    "hello world",
    "héllo wörld 12345",
    "tab\tnew\nline",
    "emoji 🦊 and ☃",  # not in the vocabulary: byte fallback
    "world\n\nthe end ",
    "  two spaces",
    " one space",
    "Hello<|im_start|>there <think> x",
    "<s>hi</s>",
]


@pytest.fixture(scope="module")
def sentencepiece_model():
    """A tiny SentencePiece BPE model (byte fallback, a control and a user-defined symbol), trained in ~20 ms."""
    spm = pytest.importorskip("sentencepiece")
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(SENTENCEPIECE_CORPUS * 20),
        model_writer=model,
        model_type="bpe",
        vocab_size=360,
        byte_fallback=True,
        character_coverage=1.0,
        control_symbols=["<|im_start|>"],
        user_defined_symbols=["<think>"],
        split_digits=True,
        allow_whitespace_only_pieces=True,
        remove_extra_whitespaces=False,
        normalization_rule_name="identity",
        minloglevel=2,
    )
    return spm.SentencePieceProcessor(model_proto=model.getvalue())


def _sentencepiece_gguf(path, sp, arch: str) -> GGUFFile:
    """Metadata as llama.cpp's converter writes it; Gemma files spell whitespace pieces with spaces, no prefix."""
    gemma = arch.startswith("gemma")
    pieces = [sp.id_to_piece(i) for i in range(sp.get_piece_size())]
    if gemma:
        pieces = [p.replace("▁", " ") if not p.strip("▁") else p for p in pieces]

    def token_type(i: int) -> int:
        if sp.is_unknown(i):
            return 2
        if sp.is_control(i):
            return 3
        if sp.is_byte(i):
            return 6
        return 4 if pieces[i] == "<think>" else 1

    return _write_gguf(
        path,
        arch,
        "llama",
        pieces,
        token_scores=[sp.get_score(i) for i in range(len(pieces))],
        token_types=[token_type(i) for i in range(len(pieces))],
        bos_token_id=sp.bos_id(),
        eos_token_id=sp.eos_id(),
        unk_token_id=sp.unk_id(),
        add_space_prefix=not gemma,
    )


@pytest.mark.parametrize("arch", ["llama", "gemma2", "phi3"])
def test_sentencepiece_gguf_matches_transformers(sentencepiece_model, tmp_path, arch):
    path = tmp_path / f"{arch}.gguf"
    ours = Tokenizer.from_gguf(_sentencepiece_gguf(path, sentencepiece_model, arch))
    hf = _load_hf_gguf(path)
    assert ours.add_bos_token  # the llama tokenizer model adds BOS unless the file says not to
    for text in SENTENCEPIECE_TEXTS:
        ids = ours.encode(text)
        assert ids == hf.encode(text), text
        assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True)
        assert ours.decode(ids, skip_special_tokens=False) == hf.decode(ids)


def test_sentencepiece_gguf_matches_sentencepiece(sentencepiece_model, tmp_path):
    """Where transformers follows SentencePiece (no leading space, no special tokens in the text), so do we."""
    sp = sentencepiece_model
    ours = Tokenizer.from_gguf(_sentencepiece_gguf(tmp_path / "llama.gguf", sp, "llama"))
    for text in SENTENCEPIECE_TEXTS[:5]:
        assert ours.encode(text) == [sp.bos_id(), *sp.encode(text)], text
        assert ours.decode(ours.encode(text)) == text


def test_missing_chat_template_is_value_error(sentencepiece_model, tmp_path):
    ours = Tokenizer.from_gguf(_sentencepiece_gguf(tmp_path / "llama.gguf", sentencepiece_model, "llama"))
    assert ours.chat_template is None
    with pytest.raises(ValueError, match="no chat template"):
        ours.apply_chat_template(USER_ONLY)


def test_unsupported_tokenizer_model_is_value_error(tmp_path):
    reader = _write_gguf(tmp_path / "bert.gguf", "bert", "bert", ["[PAD]", "[UNK]", "hello"])
    with pytest.raises(ValueError, match="'bert'"):
        Tokenizer.from_gguf(reader)


def test_unsupported_pre_tokenizer_is_value_error(tmp_path):
    reader = _write_gguf(
        tmp_path / "pre.gguf", "llama", "gpt2", ["a", "b", "ab"], tokenizer_pre="not-a-pre", token_merges=["a b"]
    )
    with pytest.raises(ValueError, match="'not-a-pre'"):
        Tokenizer.from_gguf(reader)


def test_token_types_that_are_not_integers_are_value_error(tmp_path):
    reader = _write_gguf(tmp_path / "types.gguf", "llama", "gpt2", ["a", "b", "ab"], token_merges=["a b"],
                         arrays={"tokenizer.ggml.token_type": ["normal", "control", "normal"]})
    with pytest.raises(ValueError, match="token_type is not an array of integers"):
        Tokenizer.from_gguf(reader)


def test_control_and_user_defined_tokens_are_matched_whole(tmp_path):
    """Control tokens (and the named bos/eos ones) become special tokens, user-defined ones plain added tokens;
    ids past the types' end are normal, as llama.cpp reads a short type array."""
    tokens = ["a", "b", "ab", "<s>", "<ctl>", "<user>", "<late>"]
    types = [gguf.TokenType.NORMAL] * 3 + [gguf.TokenType.NORMAL, gguf.TokenType.CONTROL, gguf.TokenType.USER_DEFINED]
    reader = _write_gguf(tmp_path / "types.gguf", "llama", "gpt2", tokens, token_merges=["a b"], token_types=types,
                         bos_token_id=3)
    ours = Tokenizer.from_gguf(reader)
    added = {t.content: t.special for t in ours.backend.get_added_tokens_decoder().values()}
    assert added == {"<s>": True, "<ctl>": True, "<user>": False}
