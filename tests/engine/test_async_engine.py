"""AsyncEngine: concurrent streams from an event loop give what the synchronous engine gives;
a stream closed early aborts its request and frees its blocks; a failing step fails every stream."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest
from flax import nnx

from tunix_rt.engine.async_engine import AsyncEngine
from tunix_rt.engine.engine import Engine
from tunix_rt.engine.params import SamplingParams
from tunix_rt.models.config import FULL, ModelConfig, RopeConfig
from tunix_rt.models.decoder import Decoder

pytestmark = pytest.mark.usefixtures("fast_compiles")  # compile-bound (conftest.fast_compiles says when)

GREEDY = SamplingParams(temperature=0.0, max_tokens=6)


def _engine(model) -> Engine:
    return Engine(model, max_model_len=64, max_num_seqs=8, max_num_batched_tokens=16, block_size=4, num_kv_blocks=64)


def _model() -> Decoder:
    cfg = ModelConfig(architecture="llama", vocab_size=97, hidden_size=32, intermediate_size=48, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=8, rope=((FULL, RopeConfig(theta=10000.0)),))
    return Decoder(cfg, rngs=nnx.Rngs(3))


@pytest.fixture(scope="module")
def engines():
    """(a synchronous engine for expected outputs, the engine the AsyncEngine owns, the AsyncEngine):
    once an AsyncEngine runs an engine, only its thread may step it."""
    model = _model()
    owned = _engine(model)
    async_engine = AsyncEngine(owned)
    yield _engine(model), owned, async_engine
    async_engine.shutdown()


def _prompts():
    rng = np.random.default_rng(0)
    return [rng.integers(0, 97, size=n).tolist() for n in (5, 13, 2)]


async def _collect(async_engine, prompt, params):
    return [out async for out in async_engine.generate(prompt, params)]


@pytest.mark.slow
def test_concurrent_streams_match_the_sync_engine(engines):
    sync, engine, async_engine = engines
    want = [o.token_ids for o in sync.generate(_prompts(), GREEDY)]

    async def main():
        return await asyncio.gather(*(_collect(async_engine, p, GREEDY) for p in _prompts()))

    streams = asyncio.run(main())
    for outs, expected in zip(streams, want):
        assert [t for o in outs for t in o.delta_token_ids] == expected
        assert outs[-1].finished and outs[-1].token_ids == expected
    assert all(g.pool.num_free == g.pool.num_blocks for g in engine.kv.groups)


def test_n_samples_all_arrive(engines):
    _, _, async_engine = engines
    outs = asyncio.run(_collect(async_engine, _prompts()[0], SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=4)))
    finished = sorted(o.index for o in outs if o.finished)
    assert finished == [0, 1, 2]


def test_closing_a_stream_early_aborts_it(engines):
    _, engine, async_engine = engines

    async def main():
        stream = async_engine.generate(_prompts()[1], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
        first = await stream.__anext__()
        await stream.aclose()  # what the server does when a client disconnects
        return first

    first = asyncio.run(main())
    assert not first.finished
    # The abort is applied by the engine's thread before its next step (the request would run 40 steps).
    deadline = time.monotonic() + 10
    while engine.has_unfinished_requests() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not engine.has_unfinished_requests()
    assert all(g.pool.num_free == g.pool.num_blocks for g in engine.kv.groups)


def test_a_failing_step_fails_the_stream_and_leaves_the_engine_usable(engines, monkeypatch):
    sync, engine, async_engine = engines

    def boom(*args, **kwargs):
        raise RuntimeError("kernel exploded")

    with monkeypatch.context() as m:
        m.setattr(engine.runner, "execute", boom)
        with pytest.raises(RuntimeError, match="kernel exploded"):
            asyncio.run(_collect(async_engine, _prompts()[0], GREEDY))
    assert not engine.has_unfinished_requests()
    assert all(g.pool.num_free == g.pool.num_blocks for g in engine.kv.groups)
    outs = asyncio.run(_collect(async_engine, _prompts()[0], GREEDY))
    assert outs[-1].token_ids == sync.generate([_prompts()[0]], GREEDY)[0].token_ids


def test_stats_and_bad_requests(engines):
    _, _, async_engine = engines
    assert async_engine.stats().num_running == 0

    async def bad():
        return await _collect(async_engine, [], GREEDY)

    with pytest.raises(ValueError, match="empty"):
        asyncio.run(bad())


def test_idle_warm_up_compiles_the_rest_and_yields_to_requests(engines):
    """warm_up_when_idle (a server, after warmup(max_rows=1)): a request that comes while the thread compiles is
    served as the synchronous engine serves it, the warm-up goes on once the engine is idle again and ends with
    every warm-up program compiled; a shutdown in the middle stops it between two compiles."""
    sync = engines[0]
    engine = _engine(_model())
    engine.warmup(max_rows=1)
    async_engine = AsyncEngine(engine, warm_up_when_idle=True)
    try:
        assert async_engine.warming_up
        outs = asyncio.run(_collect(async_engine, _prompts()[1], GREEDY))
        assert outs[-1].token_ids == sync.generate([_prompts()[1]], GREEDY)[0].token_ids
        deadline = time.monotonic() + 300
        while async_engine.warming_up and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not async_engine.warming_up
        assert asyncio.run(async_engine.call(lambda e: e.warmup())) == 0  # nothing was left
    finally:
        async_engine.shutdown()

    stopped = AsyncEngine(_engine(_model()), warm_up_when_idle=True)
    start = time.monotonic()
    stopped.shutdown()
    assert time.monotonic() - start < 60 and not stopped._thread.is_alive()
