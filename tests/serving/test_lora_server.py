"""Many LoRA adapters served by one `tunix-rt serve`: `--lora-modules`, the request's `model` picking the adapter,
/v1/models listing them with their parent, vLLM's runtime /v1/load_lora_adapter and /v1/unload_lora_adapter,
concurrent requests of different adapters answering as each does alone, an unload under load losing no request.
A tiny model with 2 adapter slots, so a third adapter waits for a slot."""

from __future__ import annotations

import concurrent.futures
import threading
import time

import httpx2 as httpx
import openai
import pytest

from tests.lora_adapters import random_adapter
from tests.models.hf_tiny import make_tiny_model_dir
from tests.serving.conftest import running_server
from tunix_rt.checkpoints.loader import load_model

pytestmark = pytest.mark.slow

PROMPT = [1, 40, 51, 62, 73, 84, 12]
GREEDY = dict(max_tokens=10, temperature=0)


def _adapter(base_dir, path, *, rank: int, seed: int):
    return random_adapter(load_model(base_dir).model, path, rank=rank, seed=seed)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_serve")
    make_tiny_model_dir(root / "base")
    make_tiny_model_dir(root / "other", hidden_size=48)
    paths = {f"a{i}": _adapter(root / "base", root / f"a{i}", rank=2 + 2 * i, seed=i) for i in range(3)}
    paths["big"] = _adapter(root / "base", root / "big", rank=16, seed=7)
    paths["other"] = _adapter(root / "other", root / "other_adapter", rank=2, seed=8)
    args = ["--model", root / "base", "--served-model-name", "base", "--max-num-seqs", 8,
            "--max-num-batched-tokens", 32, "--max-model-len", 256, "--max-loras", 2, "--max-lora-rank", 8,
            "--decode-steps", 1, "--max-waiting", 16,
            "--lora-modules", f"a0={paths['a0']}", f'{{"name": "a1", "path": "{paths["a1"]}"}}']
    with running_server(args, str(root / "serve.log")) as (base, _):
        yield base, paths


def _client(base):
    return openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=120)


def _complete(base, model, prompt=PROMPT, **kw):
    return _client(base).completions.create(model=model, prompt=prompt, **{**GREEDY, **kw})


def _post(base, path, body):
    return httpx.post(f"{base}{path}", json=body, timeout=60)


def _in_engine(base) -> float:
    """Sequences running or waiting in the server's engine (/metrics)."""
    metrics = httpx.get(f"{base}/metrics", timeout=30).text
    return sum(float(line.split()[-1]) for line in metrics.splitlines()
               if line.startswith(("tunix_rt:num_requests_running", "tunix_rt:num_requests_waiting")))


def _wait_idle(base):
    deadline = time.monotonic() + 15
    while True:
        metrics = httpx.get(f"{base}/metrics", timeout=30).text
        values = {line.split()[0]: float(line.split()[-1]) for line in metrics.splitlines()
                  if line.startswith(("tunix_rt:num_requests_running", "tunix_rt:kv_cache_usage_perc"))}
        if sum(values.values()) == 0:
            return
        assert time.monotonic() < deadline, values
        time.sleep(0.1)


def test_models_lists_the_adapters_with_their_parent(setup):
    base, paths = setup
    data = {m.id: m for m in _client(base).models.list().data}
    assert set(data) >= {"base", "a0", "a1"}
    assert data["base"].parent is None and data["a0"].parent == data["a1"].parent == "base"
    assert data["a0"].root == str(paths["a0"])


def test_each_adapter_answers_as_alone_when_mixed(setup):
    """Requests of the base and of each adapter at once (more adapters than slots: one waits for a slot) answer
    as each does alone; the reply names the adapter."""
    base, paths = setup
    r = _post(base, "/v1/load_lora_adapter", {"lora_name": "a2", "lora_path": str(paths["a2"])})
    assert r.status_code == 200 and "a2" in r.text, r.text
    names = ["base", "a0", "a1", "a2"]
    alone = {name: _complete(base, name) for name in names}
    assert len({r.choices[0].text for r in alone.values()}) == 4  # every adapter changes the model
    assert all(alone[name].model == name for name in names)
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        mixed = list(pool.map(lambda name: (name, _complete(base, name)), names * 2))
    for name, reply in mixed:
        assert reply.choices[0].text == alone[name].choices[0].text, name
    chat = _client(base).chat.completions.create(model="a1", messages=[{"role": "user", "content": "the"}],
                                                  **GREEDY)
    assert chat.model == "a1"
    _wait_idle(base)


def test_unknown_adapter_is_404(setup):
    base, _ = setup
    with pytest.raises(openai.NotFoundError) as e:
        _complete(base, "nope")
    body = e.value.response.json()["error"]
    assert (body["code"], body["param"]) == ("model_not_found", "model")
    r = _post(base, "/v1/unload_lora_adapter", {"lora_name": "nope"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


@pytest.mark.parametrize("name, key, message", [
    ("a0", "a0", "already been loaded"),
    ("big", "big", "rank 16 .* over this engine's max_lora_rank 8"),
    ("other", "other", "do not fit .* another base"),
    ("missing", None, "not a peft adapter directory"),
])
def test_bad_adapters_are_400_naming_the_reason(setup, name, key, message, tmp_path):
    import re

    base, paths = setup
    path = str(paths[key]) if key else str(tmp_path)
    r = _post(base, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": path})
    assert r.status_code == 400, r.text
    assert re.search(message, r.json()["error"]["message"]), r.json()
    if name != "a0":
        assert name not in {m.id for m in _client(base).models.list().data}


def _poisoned(path, tmp_path, *, config=None, tensors=None):
    """A copy of adapter `path` with its config updated by `config` and its B weights set by `tensors`."""
    import json
    import shutil

    import numpy as np
    from safetensors.numpy import load_file, save_file

    out = tmp_path / "poisoned"
    shutil.copytree(path, out)
    if config:
        cfg = json.loads((out / "adapter_config.json").read_text())
        (out / "adapter_config.json").write_text(json.dumps({**cfg, **config}))
    if tensors is not None:
        weights = load_file(out / "adapter_model.safetensors")
        save_file({k: np.full_like(v, tensors) if "lora_B" in k else v for k, v in weights.items()},
                  out / "adapter_model.safetensors")
    return str(out)


@pytest.mark.parametrize("name, change, message", [
    ("nan", dict(tensors=float("nan")), "non-finite values"),
    ("inf", dict(tensors=float("inf")), "non-finite values"),
    ("huge", dict(tensors=1e8), "values beyond"),
    ("nan_alpha", dict(config={"lora_alpha": float("nan")}), "NaN is not a number JSON allows"),
    ("unknown_key", dict(config={"lora_magic": 1}), "unknown key"),
    ("backtracking", dict(config={"alpha_pattern": {r"(?:(?:[a-z_.0-9]|\w|.)+?){e<=2}(?:X|Y)": 2}}),
     "take more than 1 s"),
    ("../escape", {}, "adapter name '../escape' is not allowed"),
    ("x" * 200, {}, "is not allowed"),
])
def test_hostile_adapters_are_refused_and_harm_nobody(setup, name, change, message, tmp_path):
    """The hardening issue's cases: adapters with NaN/inf or absurd weights, NaN in the config, an unknown key,
    an alpha_pattern that backtracks without end, a name outside the rule: each a 400 naming the fault, /health
    answering meanwhile; the base model's and a good adapter's replies stay the same bit for bit."""
    import re

    base, paths = setup
    before = [_complete(base, model, logprobs=0) for model in ("base", "a0")]
    health = []
    stop = threading.Event()

    def probe():
        while not stop.is_set():
            t = time.monotonic()
            assert httpx.get(f"{base}/health", timeout=30).status_code == 200
            health.append(time.monotonic() - t)
            time.sleep(0.05)

    prober = threading.Thread(target=probe)
    prober.start()
    try:
        r = _post(base, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": _poisoned(paths["a1"], tmp_path,
                                                                                             **change)})
    finally:
        stop.set()
        prober.join()
    assert r.status_code == 400, r.text
    assert re.search(message, r.json()["error"]["message"]), r.json()
    assert health and max(health) < 1.0
    assert name not in {m.id for m in _client(base).models.list().data}
    after = [_complete(base, model, logprobs=0) for model in ("base", "a0")]
    for b, a in zip(before, after):
        assert (a.choices[0].text, a.choices[0].logprobs.token_logprobs) == \
            (b.choices[0].text, b.choices[0].logprobs.token_logprobs)


def test_unloading_under_load_loses_no_request(setup):
    """16 streams of an adapter (8 running, 8 queued in the engine) while it is unloaded: each finishes with
    all its tokens, as alone, some of them after the unload returned; new requests naming it are 404 from then on;
    loading it again serves it again; nothing is left held."""
    base, paths = setup
    assert _post(base, "/v1/load_lora_adapter", {"lora_name": "tmp", "lora_path": str(paths["a0"])}).status_code == 200
    want = _complete(base, "tmp", max_tokens=200).choices[0].text
    started, finished = threading.Semaphore(0), []

    def stream():
        chunks = _client(base).completions.create(model="tmp", prompt=PROMPT, stream=True, max_tokens=200,
                                                  temperature=0)
        started.release()
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        finished.append(time.monotonic())
        return text

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        futures = [pool.submit(stream) for _ in range(16)]
        for _ in range(8):  # the first 8 are running
            assert started.acquire(timeout=120)
        deadline = time.monotonic() + 60
        while _in_engine(base) < 16:  # and the other 8 wait in the engine's queue
            assert time.monotonic() < deadline and not any(f.done() for f in futures)
            time.sleep(0.01)
        r = _post(base, "/v1/unload_lora_adapter", {"lora_name": "tmp"})
        unloaded = time.monotonic()
        assert r.status_code == 200 and "removed" in r.text, r.text
        texts = [f.result() for f in futures]
    assert texts == [want] * 16
    assert max(finished) > unloaded  # requests were in flight through the unload
    with pytest.raises(openai.NotFoundError):
        _complete(base, "tmp")
    assert "tmp" not in {m.id for m in _client(base).models.list().data}
    assert _post(base, "/v1/load_lora_adapter", {"lora_name": "tmp", "lora_path": str(paths["a0"])}).status_code == 200
    assert _complete(base, "tmp", max_tokens=200).choices[0].text == want
    assert _post(base, "/v1/unload_lora_adapter", {"lora_name": "tmp"}).status_code == 200
    _wait_idle(base)


def test_serve_with_one_adapter_applied(setup, tmp_path):
    """`serve --lora PATH` (ServeOptions.lora): the served model is the base with that adapter, as `--lora` gives
    in-process; combined with --lora-modules it is refused."""
    import asyncio

    from serving.app import ServeOptions, build_state, load_engine
    from tunix_rt.checkpoints.peft_adapter import load_adapter
    from tunix_rt.cli import main
    from tunix_rt.engine.config import EngineConfig
    from tunix_rt.engine.engine import Engine
    from tunix_rt.engine.params import SamplingParams

    _, paths = setup
    base_dir = paths["a0"].parent / "base"
    options = ServeOptions(model=str(base_dir), lora=str(paths["a1"]),
                           engine=EngineConfig(max_num_seqs=2, max_num_batched_tokens=16, max_model_len=32))
    state = build_state(options)
    load_engine(state, options)
    params = SamplingParams(temperature=0.0, max_tokens=8)

    async def served():
        return [out async for out in state.engine.generate(PROMPT, params)][-1]

    try:
        got = asyncio.run(served())
    finally:
        state.engine.shutdown()
    loaded = load_model(base_dir)
    load_adapter(loaded.model, paths["a1"])
    [want] = Engine(loaded.model, loaded.tokenizer, max_num_seqs=2, max_model_len=32).generate([PROMPT], params)
    assert got.token_ids == want.token_ids
    assert main(["serve", "--model", str(base_dir), "--lora", str(paths["a1"]), "--lora-modules",
                 f"x={paths['a0']}"]) == 2
