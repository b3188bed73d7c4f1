"""Reasoning in a reply, read apart from its answer: the `<think> ... </think>` block of chat templates that think
(Qwen3, DeepSeek-R1 and the models RL trains to reason), as vLLM's reasoning parsers read it.

A reply is reasoning from its start when the rendered prompt ends inside an open `<think>` (DeepSeek-R1's
template, Qwen3's thinking variants), or when the reply itself opens with `<think>` (Qwen3); otherwise it is all
answer. Reasoning runs to `</think>`; what follows is the answer. A reply cut off before `</think>` is reasoning
throughout (it was still thinking). Streamed text is read as it comes and gives the same split as the whole
text: a tail that may be the start of a tag waits for the next delta.
"""

from __future__ import annotations

import dataclasses

from tunix_rt.engine.detokenizer import held_prefix_length

START, END = "<think>", "</think>"
PARSERS = ("deepseek_r1", "qwen3")  # vLLM's names; both read the same tags (see the module docstring)


@dataclasses.dataclass
class ReasoningDelta:
    reasoning: str = ""
    content: str = ""


class ReasoningParser:
    def __init__(self, prompt: str = ""):
        self._state = "thinking" if prompt.rstrip().endswith(START) else "opening"
        self._buf = ""

    def feed(self, text: str) -> ReasoningDelta:
        self._buf += text
        out = ReasoningDelta()
        while True:
            if self._state == "opening":  # may the reply still open with <think>?
                stripped = self._buf.lstrip()
                if stripped.startswith(START):
                    self._buf, self._state = stripped[len(START):], "thinking"
                    continue
                if START.startswith(stripped):
                    return out  # all whitespace, or a prefix of the tag so far: wait
                self._state = "answer"
            if self._state == "thinking":
                i = self._buf.find(END)
                if i >= 0:
                    out.reasoning += self._buf[:i]
                    self._buf, self._state = self._buf[i + len(END):], "answer"
                    continue
                keep = held_prefix_length(self._buf, (END,))
                out.reasoning += self._buf[:len(self._buf) - keep]
                self._buf = self._buf[len(self._buf) - keep:]
                return out
            out.content += self._buf
            self._buf = ""
            return out

    def finish(self) -> ReasoningDelta:
        """The held tail: reasoning while still thinking, else answer."""
        tail, self._buf = self._buf, ""
        if self._state == "thinking":
            return ReasoningDelta(reasoning=tail)
        return ReasoningDelta(content=tail)


def split_reasoning(text: str, prompt: str = "") -> tuple[str, str]:
    """(reasoning, answer) of a whole reply."""
    parser = ReasoningParser(prompt)
    a, b = parser.feed(text), parser.finish()
    return a.reasoning + b.reasoning, a.content + b.content
