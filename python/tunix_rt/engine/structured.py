"""Structured outputs: a grammar (JSON schema, any JSON object, regex or Lark) enforced as a token mask.

llguidance compiles the grammar against the tokenizer's vocabulary; each step it computes, per
constrained sequence, a bitmask of the tokens that keep the output inside the grammar (bit v of
word v // 32 is token v), and the sampler sets every other token's logit to -inf. So a constrained
output always parses, whatever the model would have preferred, as in vLLM's structured outputs.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from tunix_rt.engine.errors import InvalidStructuredOutputError

if TYPE_CHECKING:
    import llguidance


def _llguidance():
    """llguidance, imported on the first constrained request: an engine that never sees one does not load it."""
    import llguidance
    import llguidance.numpy

    return llguidance


@dataclasses.dataclass(kw_only=True, frozen=True)
class StructuredOutputsParams:
    """Exactly one constraint (vLLM's names): `json` (a JSON schema, dict or JSON text),
    `json_object` (any JSON object), `regex`, or `grammar` (Lark, llguidance's dialect, which may
    embed schemas as `%json {...}`)."""

    json: dict | str | None = None
    json_object: bool = False
    regex: str | None = None
    grammar: str | None = None

    def __post_init__(self):
        given = [name for name in ("json", "regex", "grammar") if getattr(self, name) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise InvalidStructuredOutputError(
                "StructuredOutputsParams takes exactly one of json, json_object, regex, grammar; "
                f"got {given or 'none'}")
        if isinstance(self.json, str):
            try:
                object.__setattr__(self, "json", json.loads(self.json))
            except json.JSONDecodeError as e:
                raise InvalidStructuredOutputError(f"StructuredOutputsParams.json is not valid JSON: {e}") from None
        if self.json is True:  # the boolean schema that admits any JSON value
            object.__setattr__(self, "json", {})
        if self.json is False:
            raise InvalidStructuredOutputError(
                "StructuredOutputsParams.json is the schema `false`, which no output can satisfy")
        if self.json is not None and not isinstance(self.json, dict):
            raise InvalidStructuredOutputError(f"StructuredOutputsParams.json must be a JSON schema (an object), got "
                             f"{type(self.json).__name__}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise InvalidStructuredOutputError(f"StructuredOutputsParams.{name} must be a non-empty string")

    def grammar_text(self) -> str:
        """The constraint as llguidance's grammar text."""
        llguidance = _llguidance()
        if self.regex is not None:
            return llguidance.LLMatcher.grammar_from_regex(self.regex)
        if self.grammar is not None:
            return llguidance.LLMatcher.grammar_from_lark(self.grammar)
        schema = {"type": "object"} if self.json_object else self.json
        # Compact separators: flexible whitespace lets small models ramble in blank lines forever.
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})


class _TokenTable:
    """A tokenizer as llguidance.TokenizerWrapper reads it: each token's bytes, its special ids, and an encoder."""

    def __init__(self, tokenizer, eos_token_ids: Sequence[int]):
        self.tokens = [tokenizer.token_bytes(i) for i in range(tokenizer.vocab_size)]
        self.special_token_ids = sorted(tokenizer.backend.get_added_tokens_decoder())
        self.eos_token_id = eos_token_ids[0]
        self.bos_token_id = tokenizer.bos_token_id
        self._tokenizer = tokenizer

    def __call__(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False)


class GrammarCompiler:
    """Compiles constraints for one tokenizer; the vocabulary index is built once, on first use."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: Sequence[int]):
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._eos = list(eos_token_ids)
        self._index: llguidance.LLTokenizer | None = None
        self._executor: llguidance.LLExecutor | None = None

    def prepare(self) -> None:
        """Build the vocabulary index now (~0.3 s for 49k tokens) rather than on the first constrained request."""
        if self._tokenizer is None:
            raise InvalidStructuredOutputError("structured outputs need the engine's tokenizer")
        if self._index is None:
            llguidance = _llguidance()
            if not self._eos:
                raise InvalidStructuredOutputError(
                    "structured outputs need an end-of-sequence token to finish on; the tokenizer defines none")
            try:
                self._index = llguidance.LLTokenizer(self._tokenizer.backend.to_str(), n_vocab=self.vocab_size,
                                                     eos_token=self._eos)
            except ValueError:  # llguidance reads tokenizer.json's decoder itself, and not every one (Metaspace)
                self._index = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_TokenTable(self._tokenizer, self._eos)),
                                                     n_vocab=self.vocab_size, eos_token=self._eos)
            self._executor = llguidance.LLExecutor()

    def compile(self, params: StructuredOutputsParams) -> llguidance.LLMatcher:
        self.prepare()
        try:
            text = params.grammar_text()
        except ValueError as e:
            raise InvalidStructuredOutputError(f"structured outputs: the constraint does not compile: {e}") from None
        matcher = _llguidance().LLMatcher(self._index, text)
        if matcher.is_error():
            raise InvalidStructuredOutputError(
                f"structured outputs: the constraint does not compile: {matcher.get_error()}")
        return matcher

    def fill_masks(self, matchers: Sequence[tuple[llguidance.LLMatcher, int]], batch: int) -> np.ndarray:
        """(batch, ceil(V / 32)) int32 bitmasks: all ones (no constraint) except the given rows."""
        llguidance = _llguidance()
        masks = llguidance.numpy.allocate_token_bitmask(batch, self.vocab_size)
        llguidance.numpy.fill_next_token_bitmask_par(self._executor, list(matchers), masks)
        return masks
