"""Many LoRA adapters in one engine: per-token adapter slots (models/multi_lora.py) and the engine's adapter
manager. Greedy outputs of 4 adapters and the base mixed in one engine with 2 slots (so adapters wait for and
evict each other) equal each request run alone, and equal an engine serving that one adapter as plain LoRA
layers; the prefix cache is keyed by adapter; adapters removed under load finish their requests; bad adapters
are refused by reason; nothing is held after aborts."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests.engine.idle import assert_idle
from tests.lora_adapters import random_adapter
from tunix_rt.checkpoints.peft_adapter import load_adapter
from tunix_rt.engine.engine import Engine
from tunix_rt.engine.errors import InvalidRequestError, LoRAAdapterError, UnknownLoRAAdapterError
from tunix_rt.engine.lora_manager import LoRARequest
from tunix_rt.engine.params import SamplingParams
from tunix_rt.models.config import FULL, ModelConfig, RopeConfig
from tunix_rt.models.decoder import Decoder
from tunix_rt.models.lora import ALL_TARGETS
from tunix_rt.models.multi_lora import MultiLoRALinear, set_adapter_ids, with_adapter_slots

pytestmark = pytest.mark.slow

SIZES = dict(max_model_len=64, max_num_seqs=8, max_num_batched_tokens=16, block_size=4, num_kv_blocks=64)
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, logprobs=0)


def _config(**kw) -> ModelConfig:
    base = dict(architecture="llama", vocab_size=97, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
                num_kv_heads=2, head_dim=8, rope=((FULL, RopeConfig(theta=10000.0)),))
    return ModelConfig(**{**base, **kw})


def _adapter(base: Decoder, path, *, rank: int, seed: int, targets=ALL_TARGETS):
    return random_adapter(nnx.clone(base), path, rank=rank, seed=seed, targets=targets)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    base = Decoder(_config(), rngs=nnx.Rngs(0))
    paths = [_adapter(base, root / f"a{i}", rank=(2, 4, 8, 3)[i], seed=i,
                      targets=ALL_TARGETS if i != 3 else ("q_proj", "down_proj")) for i in range(4)]
    engine = Engine(base, None, max_loras=2, max_lora_rank=8, **SIZES)
    for i, path in enumerate(paths):
        engine.add_lora(f"a{i}", path)
    return base, paths, engine, root


@pytest.fixture(autouse=True)
def _cleanup(setup):
    yield
    engine = setup[2]
    for rid in list(engine._requests):
        engine.abort(rid)


def test_slot_rows_are_their_adapters_and_base_rows_the_base():
    """A multi-adapter layer's rows: slot s's rows equal a LoRALinear of adapter s; a base row is the base layer's
    output bit for bit, and no row changes when another slot's weights do."""
    rng = np.random.default_rng(0)
    model = Decoder(_config(), rngs=nnx.Rngs(0))
    slots = with_adapter_slots(model, slots=3, rank=4)
    layer = slots.layers.unstacked(0).attn.q_proj  # layer 0 alone, out of the stacks
    assert isinstance(layer, MultiLoRALinear) and not isinstance(model.layers.locate(0)[0].attn.q_proj, MultiLoRALinear)
    a = rng.normal(size=layer.lora_a[...].shape).astype(np.float32)
    b = rng.normal(size=layer.lora_b[...].shape).astype(np.float32)
    layer.lora_a.set_value(jnp.asarray(a))
    layer.lora_b.set_value(jnp.asarray(b))
    x = jnp.asarray(rng.normal(size=(1, 6, 32)), jnp.float32)
    ids = jnp.asarray([-1, 0, 1, 2, 1, -1], jnp.int32)
    set_adapter_ids(layer, ids)
    out = np.asarray(layer(x))[0]
    plain = np.asarray(layer.base(x))[0]
    for row, slot in enumerate(np.asarray(ids)):
        want = plain[row] if slot < 0 else plain[row] + x[0, row] @ a[:, slot * 4:(slot + 1) * 4] @ b[slot * 4:(slot + 1) * 4]
        if slot < 0:
            np.testing.assert_array_equal(out[row], want)
        else:
            np.testing.assert_allclose(out[row], want, rtol=1e-5, atol=1e-5)
    layer.lora_a.set_value(jnp.asarray(a).at[:, 8:].set(7.0))  # slot 2's weights change
    again = np.asarray(layer(x))[0]
    np.testing.assert_array_equal(again[[0, 1, 2, 4, 5]], out[[0, 1, 2, 4, 5]])
    layer.lora_a.set_value(jnp.asarray(a).at[:, 8:].set(1e30))  # ... to values whose products overflow
    layer.lora_b.set_value(jnp.asarray(b).at[8:].set(1e30))
    again = np.asarray(layer(x))[0]
    np.testing.assert_array_equal(again[[0, 1, 2, 4, 5]], out[[0, 1, 2, 4, 5]])
    assert not np.isfinite(again[3]).all()


def test_mixed_adapters_equal_each_alone_and_a_plain_lora_engine(setup):
    base, paths, engine, _ = setup
    prompt = np.random.default_rng(9).integers(0, 97, 7).tolist()
    names = [None, "a0", "a1", "a2", "a3"]
    alone = [engine.generate([prompt], GREEDY, lora_request=name)[0] for name in names]
    mixed = engine.generate([prompt] * 5, GREEDY, lora_request=names)
    for a, m in zip(alone, mixed):
        assert a.token_ids == m.token_ids and a.logprobs == m.logprobs
    assert len({tuple(o.token_ids) for o in alone}) == 5  # every adapter changes the model
    plain = Engine(base, None, **SIZES)
    assert plain.generate([prompt], GREEDY)[0].token_ids == alone[0].token_ids
    for path, got in zip(paths, alone[1:]):
        model = nnx.clone(base)
        load_adapter(model, path)
        [want] = Engine(model, None, **SIZES).generate([prompt], GREEDY)
        assert want.token_ids == got.token_ids
        np.testing.assert_allclose(want.logprobs, got.logprobs, atol=1e-5)
    assert len(engine.loras.resident()) == 2
    assert_idle(engine)


def test_prefix_cache_is_keyed_by_adapter_and_its_version(setup):
    _, paths, engine, _ = setup
    prompt = np.random.default_rng(10).integers(0, 97, 13).tolist()
    params = SamplingParams(temperature=0.0, max_tokens=2)
    engine.generate([prompt], params, lora_request="a0")
    assert engine.generate([prompt], params, lora_request="a0")[0].num_cached_tokens == 12
    assert engine.generate([prompt], params, lora_request="a1")[0].num_cached_tokens == 0
    assert engine.generate([prompt], params)[0].num_cached_tokens == 0
    engine.remove_lora("a0")
    engine.add_lora("a0", paths[0])  # the same name, loaded again: a new version, nothing shared
    assert engine.generate([prompt], params, lora_request="a0")[0].num_cached_tokens == 0
    assert_idle(engine)


def test_an_adapter_removed_under_load_finishes_its_requests(setup):
    _, paths, engine, root = setup
    prompt = np.random.default_rng(11).integers(0, 97, 9).tolist()
    engine.add_lora("late", paths[1])
    [want] = engine.generate([prompt], GREEDY, lora_request="late")
    rid = engine.add_request(prompt, GREEDY, lora_request="late")
    queued = engine.add_request(prompt, GREEDY, lora_request="late")
    engine.step()
    engine.remove_lora("late")
    with pytest.raises(UnknownLoRAAdapterError, match="no adapter named 'late'"):
        engine.add_request(prompt, GREEDY, lora_request="late")
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    assert done[rid].token_ids == done[queued].token_ids == want.token_ids
    assert "late" not in engine.list_loras() and "late" not in engine.loras.resident()
    # aborts, waiting or running, give their holds back
    a = engine.add_request(prompt, GREEDY, lora_request="a1")
    engine.step()
    b = engine.add_request(prompt, GREEDY, lora_request=LoRARequest("on_demand", 7, str(paths[2])))
    assert "on_demand" in engine.list_loras()
    engine.abort(a)
    engine.abort(b)
    assert_idle(engine)


def test_bad_adapters_are_refused_by_reason(setup, tmp_path):
    base, paths, engine, _ = setup
    with pytest.raises(LoRAAdapterError, match="already loaded") as e:
        engine.add_lora("a1", paths[1])
    assert e.value.code == "lora_adapter_exists"
    big = _adapter(base, tmp_path / "big", rank=16, seed=5)
    with pytest.raises(LoRAAdapterError, match="rank 16 .*over this engine's max_lora_rank 8"):
        engine.add_lora("big", big)
    other = _adapter(Decoder(_config(hidden_size=48), rngs=nnx.Rngs(1)), tmp_path / "other", rank=2, seed=6)
    with pytest.raises(LoRAAdapterError, match="do not fit.*another base"):
        engine.add_lora("other", other)
    with pytest.raises(LoRAAdapterError, match="not a peft adapter directory"):
        engine.add_lora("nothing", tmp_path)
    with pytest.raises(UnknownLoRAAdapterError, match="no adapter named 'nope'") as e:
        engine.add_request([1, 2, 3], GREEDY, lora_request="nope")
    assert (e.value.code, e.value.param) == ("model_not_found", "model")
    with pytest.raises(UnknownLoRAAdapterError):
        engine.remove_lora("nope")
    assert not {"big", "other", "nothing"} & set(engine.list_loras())
    with_lora = nnx.clone(base)
    load_adapter(with_lora, paths[0])
    with pytest.raises(ValueError, match="a model with LoRA layers cannot take adapter slots"):
        Engine(with_lora, None, max_loras=2, **SIZES)
    with pytest.raises(RuntimeError, match="update_weights on an engine with adapter slots"):
        engine.update_weights(base)
    plain = Engine(base, None, **SIZES)
    with pytest.raises(InvalidRequestError, match="max_loras > 0"):
        plain.add_request([1, 2, 3], GREEDY, lora_request="a0")
    with pytest.raises(InvalidRequestError, match="no adapter slots"):
        plain.add_lora("a0", paths[0])
    assert_idle(engine)


def test_an_adapter_whose_numbers_overflow_harms_no_other_request(setup):
    """A registered adapter whose weights pass as finite but overflow to inf / NaN in the model: its requests
    end with finish_reason 'error' and leave nothing in the prefix cache; base and other adapters' requests in
    the same steps equal, bit for bit, those of an engine that never saw it."""
    base, paths, _, _ = setup
    prompts = [np.random.default_rng(20 + i).integers(0, 97, 11).tolist() for i in range(3)]
    clean = Engine(base, None, max_loras=2, max_lora_rank=8, **SIZES)
    clean.add_lora("a0", paths[0])
    want = clean.generate(prompts[:2], GREEDY, lora_request=[None, "a0"])
    engine = Engine(base, None, max_loras=2, max_lora_rank=8, **SIZES)
    engine.add_lora("a0", paths[0])
    bad = engine.read_lora("bad", paths[1])
    bad.weights = {name: (a, b * np.float32(1e30)) for name, (a, b) in bad.weights.items()}
    engine.register_lora(bad)
    got = engine.generate(prompts + [prompts[0]], GREEDY, lora_request=[None, "a0", "bad", "bad"])
    for w, g in zip(want, got[:2]):
        assert (g.token_ids, g.logprobs, g.finish_reason) == (w.token_ids, w.logprobs, w.finish_reason)
    assert [g.finish_reason for g in got[2:]] == ["error", "error"] and got[2].token_ids == []
    again = engine.generate([prompts[2]], GREEDY, lora_request="bad")[0]
    assert again.finish_reason == "error" and again.num_cached_tokens == 0  # its blocks were never kept
    after = engine.generate(prompts[:2], GREEDY, lora_request=[None, "a0"])
    assert [(o.token_ids, o.logprobs) for o in after] == [(w.token_ids, w.logprobs) for w in want]
    assert_idle(engine)
    nan = engine.read_lora("nan", paths[1])
    nan.weights = {name: (a, np.full_like(b, np.nan)) for name, (a, b) in nan.weights.items()}
    with pytest.raises(LoRAAdapterError, match="'nan' has non-finite weights"):
        engine.register_lora(nan)


def test_adapter_names_and_their_number_are_bounded(setup):
    base, paths, _, _ = setup
    engine = Engine(base, None, max_loras=1, max_lora_rank=8, max_cpu_loras=2, **SIZES)
    for name in ["", "../up", "-x", "a" * 129, "new\nline", "nul\0", "<b>", "sp ace", 7]:
        with pytest.raises(LoRAAdapterError, match="is not allowed"):
            engine.add_lora(name, paths[0])
    engine.add_lora("org/adapter-1.v2:latest", paths[0])
    engine.add_lora("a" * 128, paths[1])
    with pytest.raises(LoRAAdapterError, match=r"2 adapters are loaded, this engine's limit \(max_cpu_loras 2\)"):
        engine.add_lora("third", paths[2])
    engine.remove_lora("a" * 128)
    engine.add_lora("third", paths[2])
