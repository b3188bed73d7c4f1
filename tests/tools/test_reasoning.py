"""Reasoning read apart from the answer (tools/reasoning.py): the split of whole replies, the same split however
the reply is streamed, and a Qwen3-style template whose enable_thinking decides where the reply starts."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from tokenizers import Tokenizer as Backend
from tokenizers import models

from tunix_rt.checkpoints.tokenizer import Tokenizer
from tunix_rt.tools.chat import render_chat
from tunix_rt.tools.reasoning import ReasoningParser, split_reasoning
from tunix_rt.tools.tool_calls import ToolFormat


@pytest.mark.parametrize("prompt, reply, want", [
    ("", "<think>plan it</think>\n\nThe answer", ("plan it", "\n\nThe answer")),
    ("", "  \n<think>a</think>b", ("a", "b")),
    ("", "No thinking here", ("", "No thinking here")),
    ("", "x <think>late</think> y", ("", "x <think>late</think> y")),  # only an opening tag opens reasoning
    ("", "<think>cut off before the end", ("cut off before the end", "")),
    ("", "<thi", ("", "<thi")),
    ("<|im_start|>assistant\n<think>\n", "still thinking</think>done", ("still thinking", "done")),
    ("<|im_start|>assistant\n<think>\n", "<think>twice opened</think>", ("<think>twice opened", "")),
    ("<|im_start|>assistant\n<think>\n\n</think>\n\n", "Just the answer", ("", "Just the answer")),
])
def test_split(prompt, reply, want):
    assert split_reasoning(reply, prompt) == want


_PIECES = st.sampled_from(["<think>", "</think>", "<", "</", "<th", "</thi", "think", ">", " ", "\n", "a", "b c"])


@given(pieces=st.lists(_PIECES, max_size=12), cuts=st.lists(st.integers(1, 7), min_size=1, max_size=12),
       open_prompt=st.booleans())
def test_streaming_gives_the_whole_text_split(pieces, cuts, open_prompt):
    text = "".join(pieces)
    prompt = "assistant\n<think>\n" if open_prompt else "assistant\n"
    whole = split_reasoning(text, prompt)
    parser, reasoning, content, at, i = ReasoningParser(prompt), "", "", 0, 0
    while at < len(text):
        step = cuts[i % len(cuts)]
        delta = parser.feed(text[at:at + step])
        reasoning, content, at, i = reasoning + delta.reasoning, content + delta.content, at + step, i + 1
    tail = parser.finish()
    assert (reasoning + tail.reasoning, content + tail.content) == whole


QWEN3_LIKE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
              "{% if add_generation_prompt %}<|im_start|>assistant\n{% if enable_thinking is defined and not "
              "enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}")


def test_enable_thinking_reaches_the_template():
    tok = Tokenizer(Backend(models.WordLevel({"<unk>": 0}, unk_token="<unk>")), chat_template=QWEN3_LIKE)
    messages = [{"role": "user", "content": "hi"}]
    fmt = ToolFormat("hermes", native=False)
    thinking = render_chat(tok, messages, fmt, None)
    plain = render_chat(tok, messages, fmt, None, template_kwargs={"enable_thinking": False})
    assert thinking.endswith("<|im_start|>assistant\n") and plain.endswith("<think>\n\n</think>\n\n")
    assert split_reasoning("<think>hm</think>ok", thinking) == ("hm", "ok")
    assert split_reasoning("ok", plain) == ("", "ok")
