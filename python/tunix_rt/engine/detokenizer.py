"""Incremental detokenization for streaming: the text each batch of generated ids adds, with stop strings.

Decoding each new token on its own is wrong: a byte-level BPE token can hold part of a UTF-8 character (it decodes
to "\ufffd" until the rest arrives), and SentencePiece-style decoders strip the leading space of a decode, so a
token's text depends on the tokens before it. So, as vLLM and TGI do, a short window of previous ids is decoded with
and without the new ids, and the difference is the new text ("prefix offset / read offset").

Stop strings follow vLLM: the output ends where the first stop string begins (or after it, with
include_stop_str_in_output), and a stop string may span token boundaries. Text that could still be the beginning of
a stop string is held back from what is streamed until it is known not to be one.
"""

from __future__ import annotations

from collections.abc import Sequence

# Prompt ids that prime the decode window, so the first generated token decodes as text that follows the prompt
# (e.g. keeps its leading space) while each decode stays short. vLLM and TGI use 5.
_PROMPT_CONTEXT = 5
_REPLACEMENT = "\ufffd"  # what an incomplete UTF-8 sequence decodes to


def held_prefix_length(text: str, markers: Sequence[str]) -> int:
    """Length of the longest end of `text` that is a proper beginning of one of `markers`: text a
    streamer must hold back until it knows whether a marker (stop string, tag) follows."""
    hold = 0
    for marker in markers:
        for k in range(min(len(marker) - 1, len(text)), hold, -1):
            if text.endswith(marker[:k]):
                hold = k
                break
    return hold


class IncrementalDetokenizer:
    """Turns the ids of one generated sequence into text as they arrive, and finds stop strings in that text.

    The text of the output ids is the text they add after the prompt: with a SentencePiece-style tokenizer and a
    prompt that ends in text, a first token like "▁Hello" gives " Hello" (as in vLLM), where decoding the output
    ids alone would strip that space. With an empty prompt, or one ending in skipped special tokens, the text is
    exactly `tokenizer.decode(output_ids)`.
    """

    def __init__(
        self,
        tokenizer,
        prompt_token_ids: Sequence[int],
        *,
        skip_special_tokens: bool = True,
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
    ):
        if isinstance(stop, str):  # one stop string, as vLLM accepts, not a sequence of one-character ones
            stop = (stop,)
        stop = tuple(dict.fromkeys(stop))
        for s in stop:
            if not isinstance(s, str):
                raise TypeError(f"`stop` must hold strings, got {s!r}")
        if "" in stop:
            raise ValueError("`stop` contains an empty string, which would match before any text")
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._stop = stop
        self._include_stop = include_stop_str_in_output
        # Chars of already searched text a new match can still start in: a match has at least one new char.
        self._overlap = max(map(len, stop), default=1) - 1

        # The decode window: ids[prefix_offset:read_offset] is text already returned (context for the decoder),
        # ids[read_offset:] is not yet turned into text. Ids before prefix_offset are dropped as we go.
        self._ids = [int(i) for i in prompt_token_ids[-_PROMPT_CONTEXT:]]
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._prefix_text = self._decode(self._ids)

        self._chunks: list[str] = []  # the text, in pieces joined on demand (appending to one str is quadratic)
        self._length = 0  # len(text)
        self._emitted = 0  # chars of text returned by add() / flush()
        self._tail = ""  # the last self._overlap chars of text: where a match completed by new text can start
        self._stop_reason: str | None = None
        self._flushed = False

    @property
    def text(self) -> str:
        """All output text decoded so far, text held back for a possible stop string included; after a stop
        match it ends where the stop string begins (or ends, with include_stop_str_in_output). Text from the
        latest ids that still ends in an incomplete UTF-8 character is not in it until the rest of that
        character arrives or flush() is called."""
        if len(self._chunks) > 1:
            self._chunks[:] = ["".join(self._chunks)]
        return self._chunks[0] if self._chunks else ""

    @property
    def stop_reason(self) -> str | None:
        """The stop string that ended the text, or None while none has matched."""
        return self._stop_reason

    def add(self, token_ids: Sequence[int], *, find_stops: bool = True) -> str:
        """Append generated ids; return the newly *emittable* text (may be '').

        Text is held back while it ends in an incomplete UTF-8 character or could be the start of a stop string.
        Once a stop string matched, the sequence is over and this returns ''. With find_stops=False (a request
        short of its min_tokens) the new text is not searched for stop strings and nothing is held back for them.
        """
        if self._stop_reason is not None:
            return ""
        if self._flushed:
            raise RuntimeError("add() after flush(): the sequence already ended")
        self._ids.extend(int(i) for i in token_ids)
        return self._append(self._new_text(final=False), find_stops)

    def flush(self) -> str:
        """At the end of the sequence (no stop matched): the text held back so far.

        An incomplete UTF-8 character is released as decoded ("\ufffd"), and text that could have begun a stop
        string is released, since no more text can complete it. Afterwards add() raises RuntimeError.
        """
        out = ""
        if self._stop_reason is None and not self._flushed:
            out = self._append(self._new_text(final=True))  # may still find a stop string in the last held text
        self._flushed = True
        out += self.text[self._emitted :]
        self._emitted = self._length
        return out

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)

    def _new_text(self, *, final: bool) -> str:
        """The text ids[read_offset:] add after the window's context; '' (and nothing consumed) while it is none
        or ends in an incomplete character, unless `final`."""
        if self._read_offset == len(self._ids):
            return ""
        window_text = self._decode(self._ids[self._prefix_offset :])
        # No growth: e.g. a skipped special token. Keep the ids in the window so the next decode sees them.
        if len(window_text) <= len(self._prefix_text) or (window_text.endswith(_REPLACEMENT) and not final):
            return ""
        new_text = window_text[len(self._prefix_text) :]
        # What was read becomes the context; older ids are no longer needed.
        del self._ids[: self._read_offset]
        self._prefix_offset, self._read_offset = 0, len(self._ids)
        self._prefix_text = self._decode(self._ids)
        return new_text

    def _append(self, new_text: str, find_stops: bool = True) -> str:
        """Add decoded text, look for stop strings in it, and return what can be emitted now."""
        if not new_text:
            return ""
        if not self._stop or not find_stops:  # emitted whole, with whatever was held back before it
            out = self.text[self._emitted:] + new_text if self._emitted < self._length else new_text
            self._chunks.append(new_text)
            self._length += len(new_text)
            self._emitted = self._length
            self._tail = ""  # unsearched text (before min_tokens) is never where a later match starts
            return out
        # Only the new text and the overlap before it are searched: linear over a long generation.
        region = self._tail + new_text
        base = self._length - len(self._tail)  # where region starts in text
        self._chunks.append(new_text)
        self._length += len(new_text)
        match = self._find_stop(region)
        if match is not None:
            start, stop = match
            end = base + start + (len(stop) if self._include_stop else 0)
            self._chunks[:] = [self.text[:end]]
            self._length = end
            self._stop_reason = stop
            hold = 0
        else:
            hold = held_prefix_length(region, self._stop)
            self._tail = region[-self._overlap :] if self._overlap else ""
        # Held text never exceeds the overlap, so what is not yet emitted lies inside region.
        out = region[self._emitted - base : self._length - base - hold]
        self._emitted += len(out)
        return out

    def _find_stop(self, region: str) -> tuple[int, str] | None:
        """The match that completes first (ties: the one starting first): the first a reader streaming the text
        could see, so the result does not depend on how the ids were chunked. Non-overlapping matches: the
        earliest in the text, whatever the order of `stop`."""
        best = None
        for stop in self._stop:
            start = region.find(stop)
            if start >= 0 and (best is None or (start + len(stop), start) < (best[0] + len(best[1]), best[0])):
                best = (start, stop)
        return best
