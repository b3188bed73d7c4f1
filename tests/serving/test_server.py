"""The OpenAI-compatible server end to end: a real `tunix-rt serve` process driven by the official
`openai` client (raw HTTP only where the client cannot say what a test needs).

Every test shares the session's server (conftest.py): the default model (SmolLM2-135M-Instruct,
Q4_1) with MAX_MODEL_LEN=256, MAX_NUM_SEQS=4, MAX_WAITING=4, a 64 KiB body limit, an API key and
one CORS origin. Replies are greedy (temperature 0) unless sampling is the point, so a streamed
reply can be compared with the same request answered whole.

Tools: the server teaches this model (whose chat template has no tool support) to call tools with a
~120-token system prompt, and each tool's JSON adds ~90 tokens, so get_weather and add together
(~280 tokens) do not fit the 256-token window; each tool test offers one of them.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import re
import threading
import time

import httpx2 as httpx
import jsonschema
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

import tunix_rt
from tests.serving.conftest import API_KEY, MAX_BODY_BYTES, MAX_MODEL_LEN, MAX_NUM_SEQS, MAX_WAITING, ORIGIN

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("fast_compiles")]  # compile-bound (conftest.fast_compiles says when)

CAPACITY = MAX_NUM_SEQS + MAX_WAITING  # sequences in flight before 429
MODEL = "default"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
FOX = "The quick brown fox"
FOX_IDS = [504, 2365, 6354, 16438]  # FOX in the model's tokenizer (checked by echo below)

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 30},
                   "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"], "additionalProperties": False}}}
ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object",
    "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 1000},
                   "b": {"type": "integer", "minimum": 0, "maximum": 1000}},
    "required": ["a", "b"], "additionalProperties": False}}}
WEATHER_Q = [{"role": "user", "content": "What is the weather in Paris?"}]
ADD_Q = [{"role": "user", "content": "What is 2 plus 3?"}]
TOOL_TOKENS = 48  # a whole call (tags + JSON) needs ~30 tokens; the tools prompt leaves ~45 of the window


# -- helpers ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def client(server):
    return server.client(timeout=120)


def _url(server, path: str) -> str:
    return f"{server.base_url}{path}"


def scrape(server) -> dict[str, float]:
    """/metrics as {sample name: value}, summed over label sets (one model, so one set mostly)."""
    r = httpx.get(_url(server, "/metrics"), headers=server.headers(), timeout=60)
    assert r.status_code == 200, r.text
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(r.text):
        for sample in family.samples:
            if sample.name.endswith("_bucket"):
                continue
            values[sample.name] = values.get(sample.name, 0.0) + sample.value
    return values


def wait_idle(server, timeout: float = 15.0) -> dict[str, float]:
    """Poll /metrics until nothing runs or waits and the KV pool is empty; returns the last scrape."""
    deadline = time.monotonic() + timeout
    while True:
        m = scrape(server)
        idle = (m["tunix_rt:num_requests_running"] == 0 and m["tunix_rt:num_requests_waiting"] == 0
                and m["tunix_rt:kv_cache_usage_perc"] == 0)
        if idle:
            return m
        if time.monotonic() > deadline:
            pytest.fail(f"the engine did not become idle within {timeout}s: running "
                        f"{m['tunix_rt:num_requests_running']}, waiting {m['tunix_rt:num_requests_waiting']}, "
                        f"kv usage {m['tunix_rt:kv_cache_usage_perc']}")
        time.sleep(0.1)


def assert_envelope(body: dict, *, param: str | None = None, code: str | None = None) -> dict:
    """OpenAI's error shape: {"error": {"message", "type", "param", "code"}}; returns the inner dict."""
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"], err
    assert isinstance(err["type"], str) and err["type"], err
    if param is not None:
        assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    return err


def api_error(excinfo, status: int, **kw) -> dict:
    """The envelope behind an openai.APIStatusError, after checking its status."""
    err = excinfo.value
    assert err.status_code == status, (err.status_code, err.response.text)
    return assert_envelope(err.response.json(), **kw)


def raw_post(server, path: str, *, key: str | None = API_KEY, **kw) -> httpx.Response:
    headers = {"content-type": "application/json", **kw.pop("headers", {})}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    return httpx.post(_url(server, path), headers=headers, timeout=60, **kw)


def assert_valid_call(call, tools: list[dict]) -> dict:
    """A tool call names one of `tools` and its arguments (JSON text) pass that tool's schema."""
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    assert call.type == "function"
    assert call.id
    assert call.function.name in schemas, call
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, schemas[call.function.name])
    return args


def collect_chat_stream(stream) -> tuple[list, dict[int, str], dict[int, list[str]], dict[int, list[dict]]]:
    """(chunks, content by choice, finish reasons by choice, tool-call deltas by choice)."""
    chunks, content, finishes, tool_deltas = [], {}, {}, {}
    for chunk in stream:
        chunks.append(chunk)
        for choice in chunk.choices:
            if choice.delta.content:
                content[choice.index] = content.get(choice.index, "") + choice.delta.content
            if choice.delta.tool_calls:
                tool_deltas.setdefault(choice.index, []).extend(choice.delta.tool_calls)
            if choice.finish_reason is not None:
                finishes.setdefault(choice.index, []).append(choice.finish_reason)
    return chunks, content, finishes, tool_deltas


def assemble_tool_calls(deltas) -> list[dict]:
    """OpenAI's streamed tool calls, put together by index: the first delta of a call carries its id,
    type and name; later ones append to its arguments."""
    calls: dict[int, dict] = {}
    for d in deltas:
        if d.index not in calls:
            assert d.id and d.type == "function" and d.function and d.function.name, d
            calls[d.index] = {"id": d.id, "name": d.function.name, "arguments": d.function.arguments or ""}
        else:
            assert d.id is None or d.id == calls[d.index]["id"], d
            assert not (d.function and d.function.name), f"a later delta renames call {d.index}: {d}"
            calls[d.index]["arguments"] += (d.function.arguments or "") if d.function else ""
    assert sorted(calls) == list(range(len(calls))), f"tool call indexes are not 0..n-1: {sorted(calls)}"
    return [calls[i] for i in sorted(calls)]


def check_usage_chunk(chunks) -> None:
    """include_usage: every chunk but the last has usage null; the last has no choices, and usage."""
    *body, last = chunks
    assert all(c.usage is None for c in body), [c.usage for c in body if c.usage is not None]
    assert last.choices == []
    assert last.usage is not None
    assert last.usage.total_tokens == last.usage.prompt_tokens + last.usage.completion_tokens


# -- models, health ----------------------------------------------------------------------------


def test_models_lists_default_with_max_model_len(client):
    models = client.models.list()
    cards = {m.id: m for m in models.data}
    assert MODEL in cards, list(cards)
    card = cards[MODEL].model_dump()
    assert card["object"] == "model"
    assert card["max_model_len"] == MAX_MODEL_LEN
    assert card["root"] == MODEL and card["parent"] is None  # vLLM's fields: loaded from, base of


def test_version(server):
    r = httpx.get(_url(server, "/version"), headers=server.headers(), timeout=30)
    assert r.status_code == 200 and r.json() == {"version": tunix_rt.__version__}


# -- /tokenize, /detokenize, /tokenizer_info (vLLM's shapes) ------------------------------------------


def test_tokenizer_info(server):
    """What lm-evaluation-harness's remote tokenizer reads: the special tokens and the chat template."""
    r = httpx.get(_url(server, "/tokenizer_info"), headers=server.headers(), timeout=30)
    assert r.status_code == 200, r.text
    info = r.json()
    assert info["eos_token"] == "<|im_end|>" and info["model_max_length"] == MAX_MODEL_LEN
    assert info["vocab_size"] == 49152 and "<|im_start|>" in info["chat_template"]
    eos = raw_post(server, "/tokenize", json={"prompt": info["eos_token"], "add_special_tokens": False}).json()
    assert eos["count"] == 1


def test_tokenize_a_prompt_and_back(server):
    r = raw_post(server, "/tokenize", json={"model": MODEL, "prompt": "Hello world", "return_token_strs": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["count"] == len(body["tokens"]) > 0 and body["max_model_len"] == MAX_MODEL_LEN
    assert len(body["token_strs"]) == body["count"] and body["token_strs"][-1].endswith("world")
    back = raw_post(server, "/detokenize", json={"model": MODEL, "tokens": body["tokens"]})
    assert back.status_code == 200 and back.json() == {"prompt": "Hello world"}
    # the ids the engine sees for the same prompt
    done = raw_post(server, "/v1/completions", json={"model": MODEL, "prompt": "Hello world", "max_tokens": 1}).json()
    assert done["usage"]["prompt_tokens"] == body["count"]


def test_tokenize_messages_renders_the_chat_template(server):
    messages = [{"role": "user", "content": "Hi there"}]
    body = raw_post(server, "/tokenize", json={"messages": messages}).json()
    text = raw_post(server, "/detokenize", json={"tokens": body["tokens"]}).json()["prompt"]
    assert text.endswith("<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n"), text
    chat = raw_post(server, "/v1/chat/completions", json={"messages": messages, "max_tokens": 1}).json()
    assert chat["usage"]["prompt_tokens"] == body["count"]
    # without the generation prompt, and with the last message left open for the model to continue
    closed = raw_post(server, "/tokenize", json={"messages": messages, "add_generation_prompt": False}).json()
    assert closed["count"] < body["count"]
    final = {"role": "assistant", "content": [{"type": "text", "text": "Sure,"}]}
    open_ = raw_post(server, "/tokenize", json={"messages": [*messages, final],
                                                "add_generation_prompt": False, "continue_final_message": True}).json()
    assert raw_post(server, "/detokenize", json={"tokens": open_["tokens"]}).json()["prompt"].endswith(
        "<|im_start|>assistant\nSure,")
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    with_tools = raw_post(server, "/tokenize", json={"messages": messages, "tools": tools}).json()
    assert with_tools["count"] > body["count"]  # the tools prompt, as chat completions renders it


@pytest.mark.parametrize("path, payload, param", [
    ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, None),
    ("/tokenize", {}, None),
    ("/tokenize", {"messages": [{"role": "user", "content": "b"}], "continue_final_message": True},
     "continue_final_message"),
    ("/tokenize", {"messages": [{"role": "user", "content": "b"}], "tools": [
        {"type": "function", "function": {"name": "f"}}, {"type": "function", "function": {"name": "f"}}]}, "tools"),
    ("/detokenize", {"tokens": [1, -1]}, "tokens"),
    ("/detokenize", {"tokens": [10**9]}, "tokens"),
])
def test_tokenize_bad_input_is_400(server, path, payload, param):
    r = raw_post(server, path, json=payload)
    assert r.status_code == 400, r.text
    assert_envelope(r.json(), param=param)


def test_tokenize_unknown_model_is_404(server):
    r = raw_post(server, "/tokenize", json={"model": "nonesuch", "prompt": "a"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_health_is_open_and_was_503_while_loading(server):
    r = httpx.get(_url(server, "/health"), timeout=30)  # no key
    assert r.status_code == 200
    assert r.json() == {"status": "ok"}
    codes = server.health_codes
    assert codes and codes[-1] == 200, codes
    assert 503 in codes[:-1], f"/health never answered 503 while the model loaded: {codes}"
    assert set(codes) <= {200, 503}, codes


# -- chat and completions ----------------------------------------------------------------------


@pytest.mark.accelerator_path
def test_chat_non_stream(client):
    r = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=16, temperature=0)
    assert r.object == "chat.completion"
    assert r.model == MODEL
    assert len(r.choices) == 1
    choice = r.choices[0]
    assert choice.index == 0
    assert choice.message.role == "assistant"
    assert choice.message.content and choice.message.content.strip()
    assert choice.message.tool_calls is None
    assert choice.finish_reason in {"stop", "length"}
    u = r.usage
    assert u.prompt_tokens > 0 and u.completion_tokens > 0
    assert u.prompt_tokens + u.completion_tokens == u.total_tokens
    assert u.completion_tokens <= 16
    if choice.finish_reason == "length":
        assert u.completion_tokens == 16


def test_chat_max_completion_tokens(client):
    r = client.chat.completions.create(model=MODEL, messages=QUESTION, max_completion_tokens=4, temperature=0)
    assert r.usage.completion_tokens <= 4
    assert r.choices[0].finish_reason in {"stop", "length"}
    assert r.choices[0].message.content
    # it wins over the deprecated max_tokens, as in OpenAI's API
    r2 = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=16, max_completion_tokens=4,
                                        temperature=0)
    assert r2.usage.completion_tokens <= 4
    assert r2.choices[0].message.content == r.choices[0].message.content
    assert r2.usage.total_tokens == r2.usage.prompt_tokens + r2.usage.completion_tokens


def test_completion_text_prompt(client):
    r = client.completions.create(model=MODEL, prompt=FOX, max_tokens=8, temperature=0)
    assert r.object == "text_completion"
    assert len(r.choices) == 1 and r.choices[0].index == 0
    assert r.choices[0].text
    assert r.choices[0].finish_reason in {"stop", "length"}
    assert r.usage.completion_tokens <= 8
    assert r.usage.prompt_tokens == len(FOX_IDS)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_completion_two_prompts(client):
    prompts = [FOX, "Once upon a time"]
    singles = [client.completions.create(model=MODEL, prompt=p, max_tokens=6, temperature=0) for p in prompts]
    r = client.completions.create(model=MODEL, prompt=prompts, max_tokens=6, temperature=0)
    assert [c.index for c in r.choices] == [0, 1]
    assert [c.text for c in r.choices] == [s.choices[0].text for s in singles]
    assert r.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in singles)
    assert r.usage.completion_tokens == sum(s.usage.completion_tokens for s in singles)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_completion_token_ids_and_echo(client):
    text = client.completions.create(model=MODEL, prompt=FOX, max_tokens=8, temperature=0)
    ids = client.completions.create(model=MODEL, prompt=FOX_IDS, max_tokens=8, temperature=0, echo=True)
    assert ids.usage.prompt_tokens == len(FOX_IDS)
    assert ids.choices[0].text.startswith(FOX), ids.choices[0].text  # the ids decode to FOX
    assert ids.choices[0].text == FOX + text.choices[0].text  # same prompt, same greedy reply
    echoed = client.completions.create(model=MODEL, prompt=FOX, max_tokens=8, temperature=0, echo=True)
    assert echoed.choices[0].text.startswith(FOX)
    assert echoed.choices[0].text == FOX + text.choices[0].text
    assert echoed.usage.completion_tokens == text.usage.completion_tokens


def test_completion_stop_string(client):
    full = client.completions.create(model=MODEL, prompt=FOX, max_tokens=16, temperature=0).choices[0].text
    words = [w.strip(".,;:!?\"'") for w in full.split()]
    words = [w for w in words[1:] if len(w) >= 3]  # after the first word, so some text comes before it
    assert words, f"no word to stop at in {full!r}"
    stop = words[0]
    r = client.completions.create(model=MODEL, prompt=FOX, max_tokens=16, temperature=0, stop=[stop])
    choice = r.choices[0]
    assert stop not in choice.text
    assert choice.finish_reason == "stop"
    assert choice.text == full[:full.index(stop)]
    assert r.usage.completion_tokens <= 16


# -- streaming ---------------------------------------------------------------------------------


def test_chat_stream_matches_non_stream(client):
    kw = dict(model=MODEL, messages=QUESTION, max_tokens=16, temperature=0)
    whole = client.chat.completions.create(**kw)
    stream = client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True})
    chunks, content, finishes, tools = collect_chat_stream(stream)
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert len({c.id for c in chunks}) == 1
    assert chunks[0].choices[0].delta.role == "assistant"
    assert content == {0: whole.choices[0].message.content}
    assert finishes == {0: [whole.choices[0].finish_reason]}
    assert tools == {}
    check_usage_chunk(chunks)
    assert chunks[-1].usage.model_dump() == whole.usage.model_dump()


@pytest.mark.accelerator_path
def test_completion_stream_matches_non_stream(client):
    kw = dict(model=MODEL, prompt=[FOX, "Once upon a time"], max_tokens=10, temperature=0)
    whole = client.completions.create(**kw)
    stream = client.completions.create(**kw, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text: dict[int, str] = {}
    finishes: dict[int, list[str]] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            text[choice.index] = text.get(choice.index, "") + choice.text
            if choice.finish_reason is not None:
                finishes.setdefault(choice.index, []).append(choice.finish_reason)
    assert text == {c.index: c.text for c in whole.choices}
    assert finishes == {c.index: [c.finish_reason] for c in whole.choices}
    check_usage_chunk(chunks)
    assert chunks[-1].usage.model_dump() == whole.usage.model_dump()


def test_stream_ends_with_usage_then_done(server):
    """On the wire: the usage chunk (no choices) is the last data before `data: [DONE]`."""
    body = {"model": MODEL, "messages": QUESTION, "max_tokens": 6, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", _url(server, "/v1/chat/completions"), json=body, headers=server.headers(),
                      timeout=60) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert events.count("[DONE]") == 1
    last = json.loads(events[-2])
    assert last["choices"] == [] and last["usage"]["completion_tokens"] <= 6
    assert all(json.loads(e)["usage"] is None for e in events[:-2])


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Count to five."}]}),
    ("/v1/completions", {"prompt": ["One, two,", "Red, green,"], "n": 2}),
])
def test_continuous_usage_stats_puts_the_usage_so_far_on_every_chunk(server, path, body):
    body = {"model": MODEL, **body, "max_tokens": 5, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    with httpx.stream("POST", _url(server, path), json=body, headers=server.headers(), timeout=60) as r:
        assert r.status_code == 200
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    usages = [c["usage"] for c in chunks]
    assert all(u is not None for u in usages)
    final = usages[-1]  # the closing usage chunk: the totals
    assert chunks[-1]["choices"] == [] and final["total_tokens"] == final["prompt_tokens"] + final["completion_tokens"]
    assert all(u["prompt_tokens"] == final["prompt_tokens"] for u in usages)
    counts = [u["completion_tokens"] for u in usages]
    assert counts == sorted(counts) and counts[-1] == final["completion_tokens"] > 0 and counts[0] < counts[-1]


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ("/v1/completions", {"prompt": "hi"}),
])
def test_stream_options_without_stream_is_400(server, path, body):
    r = raw_post(server, path, json={"model": MODEL, **body, "stream_options": {"include_usage": True}})
    assert r.status_code == 400
    assert_envelope(r.json(), param="stream_options")


# -- vLLM's structured_outputs ---------------------------------------------------------------------


def test_structured_outputs_choice_regex_json_and_grammar(client):
    kw = dict(model=MODEL, max_tokens=24, temperature=1.0, seed=5)
    choices = ["yes", "no", "it depends"]
    for seed in range(3):
        r = client.completions.create(prompt="Is the sky blue?", **{**kw, "seed": seed},
                                      extra_body={"structured_outputs": {"choice": choices}})
        assert r.choices[0].text in choices
    r = client.chat.completions.create(messages=QUESTION, **kw, extra_body={"structured_outputs": {"regex": "[0-9]{3}"}})
    assert re.fullmatch("[0-9]{3}", r.choices[0].message.content)
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "additionalProperties": False}
    r = client.chat.completions.create(messages=QUESTION, **{**kw, "max_tokens": 40},
                                       extra_body={"structured_outputs": {"json": schema}})
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)
    r = client.completions.create(prompt="Say it:", **kw,
                                  extra_body={"structured_outputs": {"grammar": 'start: "ab" | "cd"'}})
    assert r.choices[0].text in ("ab", "cd")


# -- /v1/responses ------------------------------------------------------------------------------------------

RESPONSES_WEATHER = {"type": "function", "name": "get_weather", "parameters": WEATHER["function"]["parameters"]}


def test_responses_text_as_chat_gives_it(client):
    """responses.create with a string input, and with instructions and message items, answers what chat does."""
    chat = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=12, temperature=0)
    r = client.responses.create(model=MODEL, input=QUESTION[0]["content"], max_output_tokens=12, temperature=0)
    assert r.status in ("completed", "incomplete") and r.model == MODEL and r.object == "response"
    assert r.output_text == chat.choices[0].message.content
    [item] = r.output
    assert item.type == "message" and item.role == "assistant" and item.content[0].type == "output_text"
    assert (r.usage.input_tokens, r.usage.output_tokens) == (chat.usage.prompt_tokens, chat.usage.completion_tokens)
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens and r.store is False
    if chat.choices[0].finish_reason == "length":
        assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    system = "Answer in one word."
    items = [{"role": "developer", "content": [{"type": "input_text", "text": system}]},
             {"type": "message", "role": "user", "content": QUESTION[0]["content"]}]
    with_items = client.responses.create(model=MODEL, input=items, max_output_tokens=12, temperature=0)
    by_instructions = client.responses.create(model=MODEL, instructions=system, input=QUESTION[0]["content"],
                                              max_output_tokens=12, temperature=0)
    chat = client.chat.completions.create(model=MODEL, max_tokens=12, temperature=0,
                                          messages=[{"role": "system", "content": system}, *QUESTION])
    assert with_items.output_text == chat.choices[0].message.content
    assert by_instructions.usage.input_tokens == chat.usage.prompt_tokens


def test_responses_function_call_round_trip(client):
    """A required function tool gives a function_call item; sent back with its function_call_output, the model
    answers in text. Streamed, the events give the same items, one closed before the next opens."""
    kw = dict(model=MODEL, tools=[RESPONSES_WEATHER], max_output_tokens=TOOL_TOKENS, temperature=0,
              parallel_tool_calls=False)
    r = client.responses.create(input=WEATHER_Q[0]["content"], tool_choice="required", **kw)
    calls = [item for item in r.output if item.type == "function_call"]
    assert calls and calls[0].name == "get_weather" and calls[0].call_id
    args = json.loads(calls[0].arguments)
    jsonschema.validate(args, WEATHER["function"]["parameters"])
    events = list(client.responses.create(input=WEATHER_Q[0]["content"], tool_choice="required", stream=True, **kw))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "response.function_call_arguments.delta" in kinds and "response.function_call_arguments.done" in kinds
    final = events[-1].response
    assert [(i.type, getattr(i, "name", None), getattr(i, "arguments", None)) for i in final.output] == \
        [(i.type, getattr(i, "name", None), getattr(i, "arguments", None)) for i in r.output]
    opened = [e.output_index for e in events if e.type == "response.output_item.added"]
    closed = [e.output_index for e in events if e.type == "response.output_item.done"]
    assert opened == closed == list(range(len(final.output)))
    follow = [{"role": "user", "content": WEATHER_Q[0]["content"]},
              {"type": "function_call", "call_id": calls[0].call_id, "name": "get_weather",
               "arguments": calls[0].arguments},
              {"type": "function_call_output", "call_id": calls[0].call_id, "output": "18 C and sunny"}]
    answer = client.responses.create(input=follow, tool_choice="none", **kw)
    assert answer.output_text and not [i for i in answer.output if i.type == "function_call"]


def test_responses_stream_text_and_json_format(client):
    kw = dict(model=MODEL, input=QUESTION[0]["content"], max_output_tokens=12, temperature=0)
    whole = client.responses.create(**kw)
    events = list(client.responses.create(**kw, stream=True))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == whole.output_text == events[-1].response.output_text
    done = [e for e in events if e.type == "response.output_text.done"]
    assert done[0].text == whole.output_text and events[-1].response.usage.output_tokens == whole.usage.output_tokens
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"],
              "additionalProperties": False}
    r = client.responses.create(**{**kw, "max_output_tokens": 40},
                                text={"format": {"type": "json_schema", "name": "answer", "schema": schema}})
    jsonschema.validate(json.loads(r.output_text), schema)


@pytest.mark.parametrize("body, param", [
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"tools": [{"type": "web_search"}]}, "tools"),
    ({"input": [{"type": "input_image", "image_url": "x"}]}, "input"),
    ({"input": [{"role": "wizard", "content": "x"}]}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, "input"),
    ({"input": []}, "input"),
    ({"text": {"format": {"type": "yaml"}}}, "text"),
    ({"tool_choice": {"type": "mcp"}}, "tool_choice"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
])
def test_responses_bad_input_is_400(server, body, param):
    r = raw_post(server, "/v1/responses", json={"model": MODEL, "input": "hi", **body})
    assert r.status_code == 400, r.text
    assert_envelope(r.json(), param=param)


def test_responses_unknown_model_is_404(server):
    r = raw_post(server, "/v1/responses", json={"model": "nope", "input": "hi"})
    assert r.status_code == 404
    assert_envelope(r.json(), code="model_not_found")


# -- reasoning (the shared server runs --reasoning-parser qwen3) ----------------------------------------------


THINKING = r"<think>[a-z]{2,8}( [a-z]{2,8}){1,3}</think>[A-Z][a-z]{2,8}( [a-z]{2,8}){1,3}\."


def test_reasoning_goes_apart_from_the_content(client):
    """A reply that thinks (forced here by a regex) carries its <think> block as message.reasoning and
    reasoning_content, its answer as content; streamed, the same as reasoning deltas then content deltas; with
    include_reasoning false the reasoning is left out; a reply that does not think is all content."""
    kw = dict(model=MODEL, messages=QUESTION, max_tokens=48, temperature=0.8, seed=3)
    extra = {"structured_outputs": {"regex": THINKING}}
    whole = client.chat.completions.create(**kw, extra_body=extra).choices[0].message
    full = re.fullmatch(r"<think>(.*)</think>(.*)", f"<think>{whole.reasoning}</think>{whole.content}")
    assert full and re.fullmatch(THINKING, full.group(0)), whole
    assert whole.reasoning_content == whole.reasoning and "<think>" not in whole.content
    chunks = list(client.chat.completions.create(**kw, extra_body=extra, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    streamed_reasoning = "".join(getattr(d, "reasoning", None) or "" for d in deltas)
    streamed_content = "".join(d.content or "" for d in deltas)
    assert (streamed_reasoning, streamed_content) == (whole.reasoning, whole.content)
    last_reasoning = max(i for i, d in enumerate(deltas) if getattr(d, "reasoning", None))
    assert all(not d.content for d in deltas[:last_reasoning])  # reasoning first, then the answer
    quiet = client.chat.completions.create(**kw, extra_body={**extra, "include_reasoning": False}).choices[0].message
    assert quiet.content == whole.content and quiet.reasoning is None and quiet.reasoning_content is None
    plain = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=8, temperature=0)
    assert plain.choices[0].message.reasoning is None and plain.choices[0].message.content


def test_chat_template_kwargs(server, client):
    """vLLM's chat_template_kwargs reach the template (this one has no enable_thinking: the prompt is the same);
    the variables the server sets itself are refused."""
    kw = dict(model=MODEL, messages=QUESTION, max_tokens=2, temperature=0)
    a = client.chat.completions.create(**kw)
    b = client.chat.completions.create(**kw, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert a.usage.prompt_tokens == b.usage.prompt_tokens and a.choices[0].message.content == b.choices[0].message.content
    for path, body in (("/v1/chat/completions", {"model": MODEL, "messages": QUESTION, "max_tokens": 2}),
                       ("/tokenize", {"model": MODEL, "messages": QUESTION})):
        r = raw_post(server, path, json={**body, "chat_template_kwargs": {"add_generation_prompt": False}})
        assert r.status_code == 400, r.text
        assert_envelope(r.json(), param="chat_template_kwargs")


@pytest.mark.parametrize("path, structured", [
    ("/v1/completions", {"regex": "("}),
    ("/v1/completions", {"grammar": "start: nonesuch"}),
    ("/v1/completions", {"json": {"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}}),
    ("/v1/completions", {"json": "{not json"}),
    ("/v1/completions", {"choice": ["a"], "regex": "b"}),
    ("/v1/completions", {}),
    ("/v1/chat/completions", {"choice": []}),
])
def test_structured_outputs_that_do_not_compile_are_400(server, path, structured):
    body = {"model": MODEL, "max_tokens": 4, "structured_outputs": structured}
    body.update({"prompt": "x"} if path == "/v1/completions" else {"messages": QUESTION})
    r = raw_post(server, path, json=body)
    assert r.status_code == 400, r.text
    err = assert_envelope(r.json())
    assert err["param"] is None or err["param"].startswith("structured_outputs"), err


def test_structured_outputs_with_response_format_is_400(server):
    r = raw_post(server, "/v1/chat/completions", json={
        "model": MODEL, "messages": QUESTION, "response_format": {"type": "json_object"},
        "structured_outputs": {"regex": "a"}})
    assert r.status_code == 400
    assert_envelope(r.json(), param="structured_outputs")


# -- sampling ----------------------------------------------------------------------------------


def test_n2_with_seed_is_reproducible(client):
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Write a short poem about the sea."}],
              max_tokens=12, n=2, temperature=0.8, seed=1234)
    a = client.chat.completions.create(**kw)
    b = client.chat.completions.create(**kw)
    assert [c.index for c in a.choices] == [0, 1]
    assert [c.index for c in b.choices] == [0, 1]
    assert all(c.message.content for c in a.choices)
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]
    assert a.usage.completion_tokens <= 2 * 12
    assert a.usage.total_tokens == a.usage.prompt_tokens + a.usage.completion_tokens


# -- logprobs ----------------------------------------------------------------------------------


def test_chat_logprobs(client):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Say hi"}], max_tokens=12,
                                       temperature=0, logprobs=True, top_logprobs=3)
    entries = r.choices[0].logprobs.content
    assert len(entries) == r.usage.completion_tokens
    for e in entries:
        assert e.logprob <= 0
        assert len(e.top_logprobs) == 3
        tops = [t.logprob for t in e.top_logprobs]
        assert tops == sorted(tops, reverse=True)
        assert all(t <= 0 for t in tops)
        assert e.logprob == pytest.approx(tops[0], abs=1e-4)  # greedy: the chosen token is the top one
        assert e.bytes == list(e.token.encode())
    assert "".join(e.token for e in entries).startswith(r.choices[0].message.content)


def test_completion_logprobs(client):
    r = client.completions.create(model=MODEL, prompt=FOX, max_tokens=8, temperature=0, logprobs=2)
    choice = r.choices[0]
    assert choice.finish_reason == "length"  # so every token is part of the text (no EOS, no stop string)
    lp = choice.logprobs
    n = r.usage.completion_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n
    assert "".join(lp.tokens) == choice.text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(n)]
    assert all(x <= 0 for x in lp.token_logprobs)
    assert all(1 <= len(top) <= 2 for top in lp.top_logprobs)
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert max(top.values()) == pytest.approx(logprob, abs=1e-4)  # greedy
        assert token in top


def test_completion_logprobs_zero_holds_the_sampled_token(client):
    """logprobs=0: no alternatives, but each entry of top_logprobs holds the sampled token (vLLM, OpenAI legacy)."""
    r = client.completions.create(model=MODEL, prompt=FOX, max_tokens=4, temperature=1.0, seed=3, logprobs=0)
    lp = r.choices[0].logprobs
    assert lp.top_logprobs == [{token: logprob} for token, logprob in zip(lp.tokens, lp.token_logprobs)]


# -- tools -------------------------------------------------------------------------------------


def test_tool_choice_required(client):
    r = client.chat.completions.create(model=MODEL, messages=WEATHER_Q, tools=[WEATHER], tool_choice="required",
                                       max_tokens=TOOL_TOKENS, temperature=0)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.tool_calls
    for call in choice.message.tool_calls:
        assert_valid_call(call, [WEATHER])
    assert len({c.id for c in choice.message.tool_calls}) == len(choice.message.tool_calls)


def test_tool_choice_named(client):
    r = client.chat.completions.create(model=MODEL, messages=ADD_Q, tools=[ADD], max_tokens=TOOL_TOKENS,
                                       tool_choice={"type": "function", "function": {"name": "add"}}, temperature=0)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert len(choice.message.tool_calls) == 1
    call = choice.message.tool_calls[0]
    assert call.function.name == "add"
    args = assert_valid_call(call, [ADD])
    assert set(args) == {"a", "b"}


def test_tool_choice_named_must_be_a_tool(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=ADD_Q, tools=[ADD], max_tokens=8,
                                       tool_choice={"type": "function", "function": {"name": "get_weather"}})
    api_error(e, 400, param="tool_choice")


def test_tool_choice_auto(client):
    r = client.chat.completions.create(model=MODEL, messages=WEATHER_Q, tools=[WEATHER], tool_choice="auto",
                                       max_tokens=TOOL_TOKENS, temperature=0)
    choice = r.choices[0]
    if choice.message.tool_calls:
        assert choice.finish_reason == "tool_calls"
        for call in choice.message.tool_calls:
            assert_valid_call(call, [WEATHER])
    else:
        assert choice.finish_reason in {"stop", "length"}
        assert choice.message.content and choice.message.content.strip()
    assert r.usage.completion_tokens <= TOOL_TOKENS


def test_tool_choice_none(client):
    r = client.chat.completions.create(model=MODEL, messages=WEATHER_Q, tools=[WEATHER], tool_choice="none",
                                       max_tokens=16, temperature=0)
    choice = r.choices[0]
    assert choice.message.tool_calls is None
    assert choice.finish_reason in {"stop", "length"}
    assert choice.message.content


def test_tool_calls_stream_like_non_stream(client):
    kw = dict(model=MODEL, messages=WEATHER_Q, tools=[WEATHER], tool_choice="required", max_tokens=TOOL_TOKENS,
              temperature=0)
    whole = client.chat.completions.create(**kw)
    stream = client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True})
    chunks, content, finishes, deltas = collect_chat_stream(stream)
    calls = assemble_tool_calls(deltas.get(0, []))
    expected = [{"name": c.function.name, "arguments": c.function.arguments}
                for c in whole.choices[0].message.tool_calls]
    assert [{"name": c["name"], "arguments": c["arguments"]} for c in calls] == expected
    assert len({c["id"] for c in calls}) == len(calls)
    assert finishes == {0: ["tool_calls"]}
    assert (content.get(0) or None) == whole.choices[0].message.content
    check_usage_chunk(chunks)
    assert chunks[-1].usage.model_dump() == whole.usage.model_dump()
    for call in calls:
        jsonschema.validate(json.loads(call["arguments"]), WEATHER["function"]["parameters"])


def test_tool_result_round_trip(client):
    messages = [
        *WEATHER_Q,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris", "unit": "celsius"})}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": json.dumps({"temperature": 21, "sky": "sunny"})},
    ]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0)
    assert r.choices[0].message.content
    assert r.choices[0].finish_reason in {"stop", "length"}


def test_assistant_tool_call_arguments_must_be_json(client):
    messages = [
        *WEATHER_Q,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "city=Paris"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees"},
    ]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8)
    api_error(e, 400, param="messages")


# -- structured output -------------------------------------------------------------------------


PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}


def test_response_format_json_schema(client):
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Invent a person. Reply in JSON."}], max_tokens=32,
        temperature=0, response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}})
    choice = r.choices[0]
    assert choice.finish_reason == "stop", choice
    value = json.loads(choice.message.content)
    jsonschema.validate(value, PERSON)


def test_response_format_json_object(client):
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Describe a cat as a JSON object."}], max_tokens=24,
        temperature=0, response_format={"type": "json_object"})
    choice = r.choices[0]
    content = choice.message.content
    assert content
    if choice.finish_reason == "length":  # cut off by max_tokens: still the start of an object
        assert content.lstrip().startswith("{"), content
    else:
        assert isinstance(json.loads(content), dict), content


# -- errors ------------------------------------------------------------------------------------


def test_malformed_json_is_400(server):
    r = raw_post(server, "/v1/chat/completions", content=b'{"model": "default", "messages": [')
    assert r.status_code == 400, r.text  # not FastAPI's 422
    assert_envelope(r.json())


@pytest.mark.parametrize("kwargs, param", [
    (dict(temperature=5), "temperature"),
    (dict(top_logprobs=2), "top_logprobs"),  # without logprobs
    (dict(n=0), "n"),
    (dict(logit_bias={"fifty": 5}), "logit_bias"),
    (dict(logit_bias={"50": 101}), "logit_bias"),
    (dict(extra_body={"prompt_logprobs": -1}), "prompt_logprobs"),
    (dict(extra_body={"prompt_logprobs": 21}), "prompt_logprobs"),
])
def test_invalid_parameter_is_400(client, kwargs, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=4, **kwargs)
    err = api_error(e, 400, param=param)
    assert err["type"] == "invalid_request_error"


@pytest.mark.parametrize("key", ["-1", "49152", "1e3", "abc", "--5", "\u00b2"])
def test_logit_bias_key_outside_the_vocabulary_is_400(client, key):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=FOX, max_tokens=4, logit_bias={key: 5})
    err = api_error(e, 400, param="logit_bias")
    assert repr(key) in err["message"] and "49152" in err["message"], err


def test_logit_bias_bans_and_forces_tokens(server, client):
    """-100 bans a token, +100 forces one (OpenAI's semantics), applied in the sampler on both endpoints; the
    logprobs reported stay the model's own (vLLM's raw logprobs)."""
    plain = client.completions.create(model=MODEL, prompt=FOX_IDS, max_tokens=4, temperature=0, logprobs=0)
    first = plain.choices[0].logprobs.tokens[0]
    ids = raw_post(server, "/tokenize", json={"prompt": first, "add_special_tokens": False}).json()["tokens"]
    assert len(ids) == 1, ids
    banned = client.completions.create(model=MODEL, prompt=FOX_IDS, max_tokens=4, temperature=0, logprobs=0,
                                       logit_bias={str(ids[0]): -100})
    assert banned.choices[0].logprobs.tokens[0] != first
    forced = client.completions.create(model=MODEL, prompt=FOX_IDS, max_tokens=3, temperature=0.8, seed=1,
                                       logprobs=0, logit_bias={"42": 100})
    text42 = raw_post(server, "/detokenize", json={"tokens": [42]}).json()["prompt"]
    assert forced.choices[0].text == text42 * 3
    assert all(lp < 0 for lp in forced.choices[0].logprobs.token_logprobs)  # not the biased distribution's ~0
    chat = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=2, temperature=0,
                                          logit_bias={"42": 100})
    assert chat.choices[0].message.content == text42 * 2


def test_min_tokens_holds_back_the_stop(server, client):
    """vLLM's min_tokens: a stop token id that would end the reply at once waits until the reply has that many
    tokens; min_tokens over max_tokens is a 400 naming it."""
    plain = client.completions.create(model=MODEL, prompt=FOX_IDS, max_tokens=1, temperature=0, logprobs=0)
    first = plain.choices[0].logprobs.tokens[0]
    [stop_id] = raw_post(server, "/tokenize", json={"prompt": first, "add_special_tokens": False}).json()["tokens"]
    stopped = client.completions.create(model=MODEL, prompt=FOX_IDS, max_tokens=6, temperature=0,
                                        extra_body={"stop_token_ids": [stop_id]})
    assert stopped.choices[0].finish_reason == "stop" and stopped.usage.completion_tokens == 1
    held = client.completions.create(model=MODEL, prompt=FOX_IDS, max_tokens=6, temperature=0, logprobs=0,
                                     extra_body={"stop_token_ids": [stop_id], "min_tokens": 4})
    assert held.usage.completion_tokens >= 4 and first not in held.choices[0].logprobs.tokens[:4]
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=FOX_IDS, max_tokens=2, extra_body={"min_tokens": 3})
    assert "min_tokens" in api_error(e, 400, param="min_tokens")["message"]


def test_echo_with_logprobs_scores_the_prompt(client):
    """echo + logprobs (lm-evaluation-harness's log-likelihood requests): the prompt tokens' log-probs (the first
    null) then the completion's, in the legacy layout; they equal the log-probs the tokens get when sampled."""
    gen = client.completions.create(model=MODEL, prompt=FOX_IDS, max_tokens=5, temperature=0, logprobs=2)
    sampled = gen.choices[0].logprobs
    full_text = FOX + gen.choices[0].text
    prompt = client.completions.create(model=MODEL, prompt=FOX, max_tokens=0, echo=True).usage.prompt_tokens
    r = client.completions.create(model=MODEL, prompt=full_text, max_tokens=1, temperature=0, logprobs=2, echo=True)
    choice = r.choices[0]
    lp = choice.logprobs
    n_prompt = r.usage.prompt_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n_prompt + 1
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert "".join(lp.tokens[:n_prompt]) == full_text and choice.text.startswith(full_text)
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    if n_prompt == prompt + len(sampled.tokens):  # the text re-tokenised to the same ids
        assert lp.token_logprobs[prompt:n_prompt] == sampled.token_logprobs
        assert lp.top_logprobs[prompt:n_prompt] == sampled.top_logprobs
    for token, value, top in zip(lp.tokens[1:], lp.token_logprobs[1:], lp.top_logprobs[1:]):
        assert value < 0 and token in top and top[token] == value and len(top) <= 3
        assert max(top.values()) >= value
    # max_tokens 0 scores only; streamed, the echo chunk carries the prompt's log-probs
    only = client.completions.create(model=MODEL, prompt=full_text, max_tokens=0, logprobs=2, echo=True)
    assert only.choices[0].text == full_text and only.usage.completion_tokens == 0
    assert only.choices[0].finish_reason == "length"
    assert only.choices[0].logprobs.token_logprobs == lp.token_logprobs[:n_prompt]
    chunks = list(client.completions.create(model=MODEL, prompt=full_text, max_tokens=1, temperature=0, logprobs=2,
                                            echo=True, stream=True))
    streamed = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
    assert streamed[0].token_logprobs == lp.token_logprobs[:n_prompt]
    assert sum((s.token_logprobs for s in streamed), []) == lp.token_logprobs
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=FOX, max_tokens=0)
    api_error(e, 400, param="max_tokens")


def test_prompt_logprobs_field(server, client):
    """vLLM's prompt_logprobs: per prompt position the prompt token's entry (logprob, rank, decoded_token) and the
    top k, keyed by token id; per choice on /v1/completions, top level on chat; not with stream."""
    r = raw_post(server, "/v1/completions", json={"model": MODEL, "prompt": FOX_IDS, "max_tokens": 1,
                                                  "prompt_logprobs": 2, "logprobs": 1, "echo": True})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    entries = choice["prompt_logprobs"]
    assert len(entries) == len(FOX_IDS) and entries[0] is None
    for pos, entry in enumerate(entries[1:], 1):
        mine = entry[str(FOX_IDS[pos])]
        assert mine["logprob"] == choice["logprobs"]["token_logprobs"][pos]
        assert isinstance(mine["rank"], int) and mine["rank"] >= 1
        assert 2 <= len(entry) <= 3  # the top 2, and the prompt token when it is not among them
        by_rank = sorted(entry.values(), key=lambda e: e["rank"])
        assert [e["rank"] for e in by_rank][:2] == [1, 2]
        assert [e["logprob"] for e in by_rank] == sorted((e["logprob"] for e in by_rank), reverse=True)
    chat = raw_post(server, "/v1/chat/completions", json={"model": MODEL, "messages": QUESTION, "max_tokens": 1,
                                                          "prompt_logprobs": 0})
    assert chat.status_code == 200, chat.text
    body = chat.json()
    assert len(body["prompt_logprobs"]) == body["usage"]["prompt_tokens"]
    assert all(len(e) == 1 for e in body["prompt_logprobs"][1:])
    plain = raw_post(server, "/v1/chat/completions", json={"model": MODEL, "messages": QUESTION, "max_tokens": 1})
    assert plain.json()["prompt_logprobs"] is None
    for path, extra in (("/v1/completions", {"prompt": FOX}), ("/v1/chat/completions", {"messages": QUESTION})):
        r = raw_post(server, path, json={"model": MODEL, "max_tokens": 1, "stream": True, "prompt_logprobs": 1,
                                         **extra})
        assert r.status_code == 400, r.text
        assert_envelope(r.json(), param="prompt_logprobs")


def test_messages_missing_is_400(server):
    r = raw_post(server, "/v1/chat/completions", json={"model": MODEL, "max_tokens": 4})
    assert r.status_code == 400, r.text
    assert_envelope(r.json(), param="messages")


@pytest.mark.parametrize("path", ["/v1/models", "/metrics"])
@pytest.mark.parametrize("key", ["wrong-key", None])
def test_api_key_required(server, path, key):
    headers = {} if key is None else {"Authorization": f"Bearer {key}"}
    r = httpx.get(_url(server, path), headers=headers, timeout=30)
    assert r.status_code == 401, r.text
    assert_envelope(r.json())
    assert httpx.get(_url(server, "/health"), timeout=30).status_code == 200
    assert httpx.get(_url(server, "/health"), headers=headers, timeout=30).status_code == 200


def test_api_key_wrong_with_openai_client(server):
    bad = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="not-the-key", max_retries=0, timeout=30)
    with pytest.raises(openai.AuthenticationError) as e:
        bad.models.list()
    api_error(e, 401)
    with pytest.raises(openai.AuthenticationError) as e:
        bad.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=4)
    api_error(e, 401)


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="no-such-model", messages=QUESTION, max_tokens=4)
    api_error(e, 404, param="model")
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="no-such-model", prompt=FOX, max_tokens=4)
    api_error(e, 404, param="model")


def test_unknown_route_is_404(server):
    r = httpx.get(_url(server, "/v1/no-such-route"), headers=server.headers(), timeout=30)
    assert r.status_code == 404, r.text
    assert_envelope(r.json())
    r = raw_post(server, "/v1/no-such-route", json={})
    assert r.status_code == 404, r.text
    assert_envelope(r.json())


def _big_body() -> bytes:
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x" * MAX_BODY_BYTES}],
                       "max_tokens": 1}).encode()
    assert len(body) > MAX_BODY_BYTES
    return body


def test_body_too_large_with_content_length(server):
    r = raw_post(server, "/v1/chat/completions", content=_big_body())
    assert r.status_code == 413, r.text
    assert_envelope(r.json())


def test_body_too_large_chunked(server):
    body = _big_body()

    def chunks():
        for i in range(0, len(body), 4096):
            yield body[i:i + 4096]

    r = raw_post(server, "/v1/chat/completions", content=chunks())
    assert r.request.headers.get("transfer-encoding") == "chunked"
    assert "content-length" not in r.request.headers
    assert r.status_code == 413, r.text
    assert_envelope(r.json())


def test_body_at_the_limit_is_served(server):
    small = json.dumps({"model": MODEL, "prompt": FOX, "max_tokens": 1}).encode()
    padded = small + b" " * (MAX_BODY_BYTES - len(small))  # JSON allows trailing whitespace
    r = raw_post(server, "/v1/completions", content=padded)
    assert r.status_code == 200, r.text
    r = raw_post(server, "/v1/completions", content=padded + b" ")
    assert r.status_code == 413, r.text
    assert_envelope(r.json())


def test_body_too_large_with_openai_client(client):
    with pytest.raises(openai.APIStatusError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x" * MAX_BODY_BYTES}],
                                       max_tokens=1)
    api_error(e, 413)


@pytest.mark.parametrize("stream", [False, True])
def test_prompt_over_context_window_is_400(client, stream):
    long = "hello " * (MAX_MODEL_LEN + 50)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": long}], max_tokens=4,
                                       stream=stream)
    err = api_error(e, 400)
    assert f"This model's maximum context length is {MAX_MODEL_LEN} tokens. However, your request has" in err["message"]
    assert "input tokens" in err["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=long, max_tokens=4, stream=stream)
    err = api_error(e, 400)
    assert f"This model's maximum context length is {MAX_MODEL_LEN} tokens. However, your request has" in err["message"]
    assert "input tokens" in err["message"]


LONG_STREAM = dict(model=MODEL, messages=[{"role": "user", "content": "Tell me a long story."}], max_tokens=200,
                   temperature=0.8, stream=True, extra_body={"ignore_eos": True})


def test_queue_full_is_429(server, client):
    client.chat.completions.create(**{**LONG_STREAM, "stream": False, "max_tokens": 2, "n": 4})  # compile batch 4
    wait_idle(server)
    first = client.chat.completions.create(**LONG_STREAM, n=MAX_NUM_SEQS)  # all running
    second: dict = {}

    def queued():  # answers (with headers) only once it runs, so it is waited for in a thread
        try:
            second["stream"] = client.chat.completions.create(**LONG_STREAM, n=MAX_WAITING)
        except Exception as e:  # noqa: BLE001 - reported below
            second["error"] = e

    thread = threading.Thread(target=queued)
    try:
        next(iter(first))
        thread.start()
        deadline = time.monotonic() + 30
        while scrape(server)["tunix_rt:num_requests_waiting"] < MAX_WAITING:
            assert time.monotonic() < deadline, "the second stream was never queued"
            time.sleep(0.02)
        assert CAPACITY == MAX_NUM_SEQS + MAX_WAITING
        with pytest.raises(openai.RateLimitError) as e:
            client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=2)
        api_error(e, 429)
        with pytest.raises(openai.RateLimitError):
            client.completions.create(model=MODEL, prompt=FOX, max_tokens=2, stream=True)
    finally:
        first.close()
        thread.join(60)
        if "stream" in second:
            second["stream"].close()
    assert "error" not in second, second
    wait_idle(server)
    r = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=2)  # room again
    assert r.choices[0].message.content is not None


# -- metrics -----------------------------------------------------------------------------------


def test_metrics_names_and_growth(server, client):
    r = httpx.get(_url(server, "/metrics"), headers=server.headers(), timeout=30)
    assert r.status_code == 200
    for name in ("tunix_rt:num_requests_running", "tunix_rt:num_requests_waiting", "tunix_rt:kv_cache_usage_perc",
                 "tunix_rt:prefix_cache_hit_rate", "tunix_rt:num_preemptions_total", "tunix_rt:prompt_tokens_total",
                 "tunix_rt:generation_tokens_total", "tunix_rt:time_to_first_token_seconds_bucket",
                 "tunix_rt:inter_token_latency_seconds_bucket", "tunix_rt:compiles_total"):
        assert name in r.text, name
    before = scrape(server)
    out = client.completions.create(model=MODEL, prompt=FOX, max_tokens=5, temperature=0)
    after = scrape(server)
    assert (after["tunix_rt:generation_tokens_total"] - before["tunix_rt:generation_tokens_total"]
            == out.usage.completion_tokens)
    assert (after["tunix_rt:prompt_tokens_total"] - before["tunix_rt:prompt_tokens_total"]
            == out.usage.prompt_tokens)
    ttft = "tunix_rt:time_to_first_token_seconds_count"
    assert after[ttft] == before[ttft] + 1
    assert (after["tunix_rt:inter_token_latency_seconds_count"]
            == before["tunix_rt:inter_token_latency_seconds_count"] + out.usage.completion_tokens - 1)
    assert 0 <= after["tunix_rt:prefix_cache_hit_rate"] <= 1
    e2e = "tunix_rt:e2e_request_latency_seconds_count"
    assert after[e2e] == before[e2e] + 1
    assert after["tunix_rt:request_success_total"] == before["tunix_rt:request_success_total"] + 1


def test_the_engine_compiles_its_step_programs_before_it_is_ready(server, client):
    """/health turns 200 only once the engine has compiled what a lone request needs, so early requests with short
    client timeouts never wait for a compile (tests/engine: warmup(max_rows=1)); the batched steps' programs
    compile while the engine is idle, and once they have, plain requests, alone or together, compile nothing."""
    assert server.compiles_at_ready > 0  # before any request was sent
    deadline = time.monotonic() + 600
    while scrape(server)["tunix_rt:warmup_pending"] and time.monotonic() < deadline:
        time.sleep(0.5)
    before = scrape(server)
    assert before["tunix_rt:warmup_pending"] == 0 and before["tunix_rt:compiles_total"] > server.compiles_at_ready
    client.completions.create(model=MODEL, prompt=FOX, max_tokens=3, temperature=0.7, seed=1)
    client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        list(pool.map(lambda i: client.completions.create(model=MODEL, prompt=FOX, max_tokens=4, temperature=i / 2,
                                                            seed=i), range(3)))
    assert scrape(server)["tunix_rt:compiles_total"] == before["tunix_rt:compiles_total"]


def test_metrics_prefix_cache_hits(server, client):
    messages = [{"role": "user", "content": "Repeat after me: " + "one two three four five six seven eight. " * 3}]
    client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1, temperature=0)
    before = scrape(server)
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1, temperature=0)
    after = scrape(server)
    assert r.usage.prompt_tokens > 32
    queried = after["tunix_rt:prefix_cache_queries_total"] - before["tunix_rt:prefix_cache_queries_total"]
    hits = after["tunix_rt:prefix_cache_hits_total"] - before["tunix_rt:prefix_cache_hits_total"]
    assert queried >= r.usage.prompt_tokens - 1
    assert hits >= 16  # at least one whole block of the repeated prompt came from the cache
    assert hits <= queried


# -- disconnects -------------------------------------------------------------------------------


def test_disconnect_frees_the_request(server, client):
    before = wait_idle(server)
    stream = client.chat.completions.create(**LONG_STREAM)
    it = iter(stream)
    next(it)
    next(it)
    assert scrape(server)["tunix_rt:kv_cache_usage_perc"] > 0
    stream.close()
    after = wait_idle(server, timeout=5)
    generated = after["tunix_rt:generation_tokens_total"] - before["tunix_rt:generation_tokens_total"]
    assert generated < LONG_STREAM["max_tokens"], "the stream was generated to the end after its client left"


def test_disconnect_storm(server, client):
    before = wait_idle(server)
    errors: list[BaseException] = []
    read = []

    def one():
        try:
            stream = client.chat.completions.create(**LONG_STREAM)
            with contextlib.closing(stream):
                it = iter(stream)
                next(it)
                next(it)
                read.append(2)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=one) for _ in range(CAPACITY)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    assert len(read) == CAPACITY
    after = wait_idle(server, timeout=10)
    generated = after["tunix_rt:generation_tokens_total"] - before["tunix_rt:generation_tokens_total"]
    assert generated < CAPACITY * LONG_STREAM["max_tokens"] / 2
    # every place in the queue came back: a request for the whole capacity is admitted
    r = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=2, n=CAPACITY)
    assert [c.index for c in r.choices] == list(range(CAPACITY))


def test_client_gone_while_queued_is_aborted(server, client):
    """A streaming client that gives up while its request still waits for a slot: once the request
    is scheduled the server sees nobody is there, aborts it and gives its place back."""
    wait_idle(server)
    first = client.chat.completions.create(**LONG_STREAM, n=MAX_NUM_SEQS)  # every slot busy
    try:
        next(iter(first))
        body = {"model": MODEL, "messages": LONG_STREAM["messages"], "max_tokens": 200, "stream": True,
                "ignore_eos": True}
        with pytest.raises(httpx.ReadTimeout):
            with httpx.stream("POST", _url(server, "/v1/chat/completions"), json=body, headers=server.headers(),
                              timeout=httpx.Timeout(30, read=1.0)):
                pass
    finally:
        # Until `first` goes, every token is its own (the abandoned request waits for a slot); count from here,
        # so `first`'s tokens, as many as the machine's speed allows, do not blur the check.
        before = scrape(server)
        first.close()
    after = wait_idle(server, timeout=10)
    generated = after["tunix_rt:generation_tokens_total"] - before["tunix_rt:generation_tokens_total"]
    # `first` may finish the step in flight (at most MAX_NUM_SEQS tokens a step) before its abort lands.
    assert generated < body["max_tokens"], f"{generated} tokens: the abandoned request ran to the end"
    r = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=2, n=CAPACITY)
    assert len(r.choices) == CAPACITY


def test_non_stream_client_gone_is_aborted(server, client):
    before = wait_idle(server)
    impatient = server.client(timeout=1.0)
    with pytest.raises(openai.APITimeoutError):
        impatient.chat.completions.create(**{**LONG_STREAM, "stream": False})
    after = wait_idle(server, timeout=10)
    generated = after["tunix_rt:generation_tokens_total"] - before["tunix_rt:generation_tokens_total"]
    assert generated < LONG_STREAM["max_tokens"], f"{generated} tokens: the abandoned request ran to the end"


# -- CORS --------------------------------------------------------------------------------------


def test_cors_preflight(server):
    headers = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST",
               "Access-Control-Request-Headers": "authorization, content-type"}
    r = httpx.options(_url(server, "/v1/chat/completions"), headers=headers, timeout=30)  # no key: preflights have none
    assert r.status_code == 200, r.text
    assert r.headers.get("access-control-allow-origin") == ORIGIN
    assert "POST" in r.headers.get("access-control-allow-methods", "")
    other = httpx.options(_url(server, "/v1/chat/completions"),
                          headers={**headers, "Origin": "http://other.example"}, timeout=30)
    assert "access-control-allow-origin" not in other.headers
    # a simple request from the allowed origin carries the header too
    r = httpx.get(_url(server, "/v1/models"), headers={**server.headers(), "Origin": ORIGIN}, timeout=30)
    assert r.status_code == 200
    assert r.headers.get("access-control-allow-origin") == ORIGIN


# -- edge cases that were bugs once ----------------------------------------------------------------


def test_more_sequences_than_capacity_is_400(server, client):
    wait_idle(server)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=2, n=CAPACITY + 1)
    api_error(e, 400, param="n")


def test_bad_response_format_schema_names_response_format(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=MODEL, messages=QUESTION, max_tokens=4,
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}})
    api_error(e, 400, param="response_format")


def test_chat_logprobs_bytes_rebuild_multibyte_text(client):
    messages = [{"role": "user", "content": "I love pizza 🍕🍕🍕 and"}]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0, logprobs=True)
    content = r.choices[0].message.content
    assert "🍕" in content  # the greedy reply of this prompt: emoji split over several tokens each
    joined = bytes(b for entry in r.choices[0].logprobs.content for b in entry.bytes)
    assert joined.decode("utf-8", errors="ignore") == content.replace("\ufffd", "")


def test_required_tool_choice_leaks_no_markup(client):
    r = client.chat.completions.create(model=MODEL, messages=WEATHER_Q, tools=[WEATHER], tool_choice="required",
                                       max_tokens=TOOL_TOKENS, temperature=0)
    choice = r.choices[0]
    assert choice.message.tool_calls
    assert "<tool_call>" not in (choice.message.content or ""), choice.message.content


# -- review findings ------------------------------------------------------------------------------


def test_masked_top_logprobs_stay_finite_json(server):
    """Under a grammar, masked tokens have logprob -inf: the reply must still be strict JSON (vLLM's -9999)."""
    body = {"model": MODEL, "messages": QUESTION, "max_tokens": 4, "temperature": 0, "logprobs": True,
            "top_logprobs": 20, "response_format": {"type": "json_object"}}
    for stream in (False, True):
        r = raw_post(server, "/v1/chat/completions", json={**body, "stream": stream})
        assert r.status_code == 200, r.text
        payloads = [line[6:] for line in r.text.splitlines() if line.startswith("data: {")] if stream else [r.text]
        values = []

        def reject(constant):
            raise AssertionError(f"{constant} in the reply")

        for payload in payloads:
            data = json.loads(payload, parse_constant=reject)
            for choice in data["choices"]:
                for entry in (choice.get("logprobs") or {}).get("content") or []:
                    values += [entry["logprob"], *(t["logprob"] for t in entry["top_logprobs"])]
        assert values and all(v is not None and -9999.0 <= v <= 0 for v in values)
        assert -9999.0 in values  # fewer than 20 tokens may start a JSON object


def test_forced_tool_with_defs_and_local_refs(client):
    """Tool schemas with $defs (as pydantic writes them) still compile when the call is forced."""
    tool = {"type": "function", "function": {"name": "book", "parameters": {  # small: the window is 256 tokens
        "$defs": {"C": {"enum": ["Paris", "Rome"]}}, "type": "object", "properties": {"city": {"$ref": "#/$defs/C"}},
        "required": ["city"]}}}
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Book Paris."}],
                                       tools=[tool], tool_choice={"type": "function", "function": {"name": "book"}},
                                       max_tokens=TOOL_TOKENS, temperature=0)
    [call] = r.choices[0].message.tool_calls
    assert_valid_call(call, [tool])


def test_explicit_nulls_mean_defaults(server):
    r = raw_post(server, "/v1/completions", json={"model": MODEL, "prompt": "Hello", "max_tokens": 2, "n": None,
                                                  "stream": None, "logprobs": None, "echo": None, "temperature": 0})
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 1


def test_non_string_dialect_is_400(server):
    schema = {"$schema": 5, "type": "object"}
    r = raw_post(server, "/v1/chat/completions", json={
        "model": MODEL, "messages": QUESTION, "max_tokens": 2,
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format", r.text
    r = raw_post(server, "/v1/chat/completions", json={
        "model": MODEL, "messages": QUESTION, "max_tokens": 2,
        "tools": [{"type": "function", "function": {"name": "f", "parameters": schema}}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools", r.text
