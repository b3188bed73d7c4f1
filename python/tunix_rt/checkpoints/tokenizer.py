"""Tokenizer: a thin wrapper over a `tokenizers.Tokenizer`, built from an HF directory or from GGUF metadata.

Encoding, decoding and chat-template rendering follow transformers, so the runtime feeds a model the same ids
transformers would, without importing transformers (or torch) at run time.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as Backend

from tunix_rt.checkpoints import hf_dir

if TYPE_CHECKING:
    from tunix_rt.checkpoints.gguf_file import GGUFFile


class Tokenizer:
    """Text <-> ids and chat prompts, with the special-token facts the generation loop needs."""

    def __init__(
        self,
        backend: Backend,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        pad_token: str | None = None,
        extra_eos_token_ids: Iterable[int] = (),
        chat_template: str | None = None,
    ):
        self.backend = backend
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.pad_token = pad_token
        self.bos_token_id = self._token_id(bos_token)
        self.pad_token_id = self._token_id(pad_token)
        # Every id that ends generation, once each; None entries (ids a config leaves unset) are ignored.
        eos_ids = [self._token_id(eos_token), *extra_eos_token_ids]
        self.eos_token_ids = list(dict.fromkeys(i for i in eos_ids if i is not None))
        self.chat_template = chat_template
        # Asked of the backend rather than of a config flag, so it always agrees with what encode() does.
        self.add_bos_token = self.bos_token_id is not None and backend.encode("").ids[:1] == [self.bos_token_id]

    def _token_id(self, token: str | None) -> int | None:
        if token is None:
            return None
        token_id = self.backend.token_to_id(token)
        if token_id is None:
            raise ValueError(f"special token {token!r} is not in the tokenizer's vocabulary")
        return token_id

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can produce, added tokens included."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        # int() so numpy / jax integer arrays are accepted too.
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes a token stands for (for some tokens, part of a UTF-8 character): what OpenAI's
        logprobs `bytes` carry, so clients can join split characters back together."""
        piece = self.backend.id_to_token(int(token_id))
        if piece is None:
            return b""
        if int(token_id) in self._added_ids:
            return piece.encode()
        if self.byte_level:
            table = _byte_level_decoder()
            return bytes(table[c] for c in piece) if all(c in table for c in piece) else piece.encode()
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):  # SentencePiece byte fallback
            try:
                return bytes([int(piece[3:5], 16)])
            except ValueError:
                pass
        return piece.replace("\u2581", " ").encode()

    @functools.cached_property
    def _added_ids(self) -> frozenset[int]:
        return frozenset(self.backend.get_added_tokens_decoder())

    @functools.cached_property
    def byte_level(self) -> bool:
        """Whether tokens are written in GPT-2's byte-level alphabet (one character per byte)."""
        decoder = json.loads(self.backend.to_str()).get("decoder") or {}
        kinds = [d.get("type") for d in decoder.get("decoders", [decoder])]
        return "ByteLevel" in kinds

    def apply_chat_template(
        self,
        messages: list[dict],
        *,
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
        tokenize: bool = False,
        **template_kwargs,
    ) -> str | list[int]:
        """Render `messages` with the model's chat template, exactly as transformers' `apply_chat_template`."""
        if self.chat_template is None:
            raise ValueError(
                "this tokenizer has no chat template (none in chat_template.jinja, tokenizer_config.json "
                "or the GGUF's tokenizer.chat_template), so apply_chat_template cannot format messages"
            )
        # Like transformers: special tokens that are unset stay undefined, `documents` defaults to None, caller
        # kwargs override both, and keys set to None are dropped from messages (templates test for missing keys).
        variables = {"documents": None}
        special = {"bos_token": self.bos_token, "eos_token": self.eos_token}
        variables.update({name: value for name, value in special.items() if value is not None})
        variables.update(template_kwargs)
        messages = [{key: value for key, value in message.items() if value is not None} for message in messages]
        from tunix_rt.checkpoints.chat_template import compile_template

        text = compile_template(self.chat_template).render(
            messages=messages, tools=tools, add_generation_prompt=add_generation_prompt, **variables
        )
        # The template already writes BOS where the model wants it, so encode adds nothing more.
        return self.encode(text, add_special_tokens=False) if tokenize else text

    @classmethod
    def from_hf_dir(cls, path) -> Tokenizer:
        """Load the tokenizer of a transformers checkpoint directory (tokenizer.json and its config files)."""
        path = Path(path)
        tokenizer_file = path / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise ValueError(f"{path} has no tokenizer.json; only checkpoints with a fast tokenizer are supported")
        try:
            backend = Backend.from_file(str(tokenizer_file))
        except Exception as e:  # tokenizers raises a bare Exception for a file it cannot parse
            raise ValueError(f"{tokenizer_file} is not a readable tokenizer.json (corrupt or truncated?): {e}") from None
        config = _read_json(path / "tokenizer_config.json")
        # transformers reads special_tokens_map.json only for configs older than `added_tokens_decoder`, and then
        # lets it override the config.
        special = {} if "added_tokens_decoder" in config else _read_json(path / "special_tokens_map.json")

        def special_token(name: str) -> str | None:
            value = special.get(name, config.get(name))
            return value["content"] if isinstance(value, dict) else value

        template_file = path / "chat_template.jinja"
        if template_file.is_file():  # transformers now writes the template here, and prefers it to the config
            chat_template = template_file.read_text(encoding="utf-8")
        else:
            chat_template = _default_template(config.get("chat_template"))
        # generation_config.json lists the ids that end a turn (one int or a list), beyond the tokenizer's eos.
        generation_eos = _read_json(path / "generation_config.json").get("eos_token_id")
        return cls(
            backend,
            bos_token=special_token("bos_token"),
            eos_token=special_token("eos_token"),
            pad_token=special_token("pad_token"),
            extra_eos_token_ids=generation_eos if isinstance(generation_eos, list) else [generation_eos],
            chat_template=chat_template,
        )

    @classmethod
    def from_gguf(cls, reader: GGUFFile) -> Tokenizer:
        """Rebuild the tokenizer a GGUF file describes in its `tokenizer.*` metadata."""
        return cls.from_gguf_metadata({key: field.contents() for key, field in reader.fields.items()
                                       if key.startswith(("tokenizer.", "general."))})

    @classmethod
    def from_gguf_metadata(cls, fields: Mapping[str, Any]) -> Tokenizer:
        """The tokenizer GGUF metadata values (`tokenizer.*`, `general.architecture`) describe: a file's, or
        ones a writer is about to write."""
        meta = _GGUFTokenizerMetadata(fields)
        kind = meta.get("tokenizer.ggml.model")
        if kind == "gpt2":
            backend = _byte_level_backend(meta)
        elif kind == "llama":
            backend = _sentencepiece_backend(meta)
        else:
            raise ValueError(
                f"unsupported GGUF tokenizer model {kind!r} (tokenizer.ggml.model); supported: 'gpt2', 'llama'"
            )
        _add_special_tokens(backend, meta)
        bos, eos = meta.token("tokenizer.ggml.bos_token_id"), meta.token("tokenizer.ggml.eos_token_id")
        # llama.cpp adds BOS to sentencepiece vocabularies unless the file says otherwise.
        add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", kind == "llama")) and bos is not None
        add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False)) and eos is not None
        template, added = ["$A:0"], []
        if add_bos:
            template.insert(0, f"{bos}:0")
            added.append(bos)
        if add_eos:
            template.append(f"{eos}:0")
            added.append(eos)
        if added:
            backend.post_processor = processors.TemplateProcessing(
                single=" ".join(template), special_tokens=[(token, backend.token_to_id(token)) for token in added]
            )
        # End-of-turn / end-of-message tokens end generation too (Llama 3's <|eot_id|>, <|eom_id|>).
        turn_ends = [meta.token_id(f"tokenizer.ggml.{name}_token_id") for name in ("eot", "eom")]
        return cls(
            backend,
            bos_token=bos,
            eos_token=eos,
            pad_token=meta.token("tokenizer.ggml.padding_token_id"),
            extra_eos_token_ids=turn_ends,
            chat_template=meta.get("tokenizer.chat_template"),
        )


@functools.cache
def _byte_level_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet inverted: printable bytes stand for themselves, the others for
    the characters from U+0100 on, in byte order."""
    printable = {*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)}
    table, shifted = {}, 0
    for b in range(256):
        if b in printable:
            table[chr(b)] = b
        else:
            table[chr(256 + shifted)] = b
            shifted += 1
    return table


def _read_json(path: Path) -> dict:
    """An optional JSON object file of the checkpoint: {} when absent, one clear error when unreadable."""
    return hf_dir.read_json(path) if path.is_file() else {}


def _default_template(template) -> str | None:
    """tokenizer_config.json holds one template, or a list of named ones of which "default" is used."""
    if isinstance(template, list):
        return {entry["name"]: entry["template"] for entry in template}.get("default")
    return template


# --- GGUF -----------------------------------------------------------------------------------------------------

# llama.cpp's token types (tokenizer.ggml.token_type).
_CONTROL, _USER_DEFINED = 3, 4


class _GGUFTokenizerMetadata:
    """The `tokenizer.*` fields of a GGUF file, read once."""

    def __init__(self, fields: Mapping[str, Any]):
        self._fields = fields
        self.architecture = self.get("general.architecture")
        self.tokens: list[str] = self.get("tokenizer.ggml.tokens")
        if not self.tokens:
            raise ValueError("GGUF file has no tokenizer.ggml.tokens, so it carries no tokenizer")
        self.token_types: list[int] = self.get("tokenizer.ggml.token_type") or []

    def get(self, key: str, default: Any = None) -> Any:
        return self._fields.get(key, default)

    def token_id(self, key: str) -> int | None:
        """The id the field `key` holds; like llama.cpp, an id outside the vocabulary counts as unset."""
        token_id = self.get(key)
        return token_id if token_id is not None and 0 <= token_id < len(self.tokens) else None

    def token(self, key: str) -> str | None:
        """The token whose id the field `key` holds."""
        token_id = self.token_id(key)
        return None if token_id is None else self.tokens[token_id]


class _ByteLevelSplit(NamedTuple):
    """How a byte-level vocabulary cuts text into pieces before BPE, as its original tokenizer.json did."""

    regex: str | None  # pieces isolated first, before GPT-2's split (if on) and the byte mapping
    gpt2_regex: bool  # ByteLevel's built-in GPT-2 split
    nfc: bool
    ignore_merges: bool  # a piece that is a whole vocabulary entry is taken as is (tiktoken's rule)


_LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_REGEX = _LLAMA3_REGEX.replace(r"\p{N}{1,3}", r"\p{N}")

# Keyed by tokenizer.ggml.pre, llama.cpp's name for the pre-tokenizer (BYTE_LEVEL_PRE_NAMES: the names read).
_BYTE_LEVEL_SPLITS = {
    "default": _ByteLevelSplit(None, True, False, False),
    "gpt2": _ByteLevelSplit(None, True, False, False),
    "smollm": _ByteLevelSplit(r"\p{N}", True, False, False),  # GPT-2's split, but digits one by one
    "llama3": _ByteLevelSplit(_LLAMA3_REGEX, False, False, True),
    "llama-v3": _ByteLevelSplit(_LLAMA3_REGEX, False, False, True),
    "llama-bpe": _ByteLevelSplit(_LLAMA3_REGEX, False, False, True),
    "qwen2": _ByteLevelSplit(_QWEN2_REGEX, False, True, False),
    "deepseek-r1-qwen": _ByteLevelSplit(_QWEN2_REGEX, False, True, False),
}
BYTE_LEVEL_PRE_NAMES = tuple(_BYTE_LEVEL_SPLITS)


def _byte_level_backend(meta: _GGUFTokenizerMetadata) -> Backend:
    """Byte-level BPE (GPT-2, SmolLM, Llama 3, Qwen2): the file gives the vocabulary and the merges."""
    pre = meta.get("tokenizer.ggml.pre", "default")
    split = _BYTE_LEVEL_SPLITS.get(pre)
    if split is None:
        raise ValueError(
            f"unsupported GGUF byte-level pre-tokenizer {pre!r} (tokenizer.ggml.pre); "
            f"supported: {sorted(_BYTE_LEVEL_SPLITS)}"
        )
    merges = meta.get("tokenizer.ggml.merges")
    if merges is None:
        raise ValueError("GGUF byte-level tokenizer has no tokenizer.ggml.merges")
    backend = Backend(
        models.BPE(
            vocab=_vocab(meta.tokens),
            merges=[tuple(merge.split(" ", 1)) for merge in merges],
            ignore_merges=split.ignore_merges,
        )
    )
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=split.gpt2_regex)
    if split.regex is None:
        backend.pre_tokenizer = byte_level
    else:
        isolate = pre_tokenizers.Split(Regex(split.regex), behavior="isolated")
        backend.pre_tokenizer = pre_tokenizers.Sequence([isolate, byte_level])
    if split.nfc:
        backend.normalizer = normalizers.NFC()
    backend.decoder = decoders.ByteLevel()
    return backend


def _sentencepiece_backend(meta: _GGUFTokenizerMetadata) -> Backend:
    """SentencePiece BPE with byte fallback (Llama 2, Mistral, Gemma): pieces and scores, usually no merges."""
    tokens = meta.tokens
    gemma = meta.architecture in ("gemma", "gemma2", "gemma3")
    if gemma:
        # Gemma files store whitespace-run pieces with real spaces; the vocabulary spells them with "▁".
        tokens = meta.tokens = ["▁" * len(t) if " " in t and not t.strip() else t for t in tokens]
    merges = meta.get("tokenizer.ggml.merges")
    if merges is not None:
        merges = [tuple(merge.split(" ", 1)) for merge in merges]
    else:
        # Gemma's scores do not follow its merge order; the order of its pieces in the file does.
        scores = meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens)
        merges = _merges_from_ranks(tokens, range(len(tokens)) if gemma else [-s for s in scores])
    backend = Backend(
        models.BPE(
            vocab=_vocab(tokens),
            merges=merges,
            unk_token=meta.token("tokenizer.ggml.unknown_token_id"),
            fuse_unk=True,
            byte_fallback=True,
        )
    )
    prefix_space = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    if meta.architecture == "phi3":
        # Phi-3's tokenizer.json adds the prefix space with a normalizer, so text that already starts with a
        # space gets one more (Metaspace would not add it).
        backend.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    else:
        # "first": prefix only the start of the text, not text following a special token (transformers' choice).
        backend.pre_tokenizer = pre_tokenizers.Metaspace(
            replacement="▁", prepend_scheme="first" if prefix_space else "never", split=False
        )
    strip = [decoders.Strip(content=" ", left=1, right=0)] if prefix_space else []
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), *strip])
    return backend


def _vocab(tokens: list[str]) -> dict[str, int]:
    return {token: token_id for token_id, token in enumerate(tokens)}


def _merges_from_ranks(tokens: list[str], ranks) -> list[tuple[str, str]]:
    """BPE merges implied by a vocabulary: a pair merges as early as the piece it forms ranks (lower first).

    Ties go to the longer left part, then the longer right part, then file order -- transformers' order, so
    both pick the same merge when two apply.
    """
    ids = _vocab(tokens)
    ranked = []
    for position, (token, rank) in enumerate(zip(tokens, ranks)):
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in ids and right in ids:
                ranked.append((rank, -len(left), -len(right), position, left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def _add_special_tokens(backend: Backend, meta: _GGUFTokenizerMetadata) -> None:
    """Match control tokens (and the bos/eos/unk/pad tokens) whole as special tokens, user-defined ones as plain
    added tokens -- otherwise BPE would cut `<|im_start|>` into pieces."""
    named = {meta.token_id(f"tokenizer.ggml.{name}_token_id") for name in ("bos", "eos", "unknown", "padding")}
    try:  # a vocabulary's worth of types, compared in numpy rather than in a Python loop
        types = np.asarray(meta.token_types[: len(meta.tokens)], dtype=np.int64)
    except (TypeError, ValueError, OverflowError):
        raise ValueError("GGUF tokenizer.ggml.token_type is not an array of integers") from None
    marked = np.flatnonzero((types == _CONTROL) | (types == _USER_DEFINED)).tolist()
    special, plain = [], []
    for token_id in sorted({*marked, *named} - {None}):
        token = meta.tokens[token_id]
        token_type = int(types[token_id]) if token_id < len(types) else None
        if token_type == _CONTROL or token_id in named:
            special.append(AddedToken(token, special=True, normalized=False))
        elif token_type == _USER_DEFINED:
            plain.append(AddedToken(token, special=False, normalized=False))
    backend.add_special_tokens(special)
    backend.add_tokens(plain)
