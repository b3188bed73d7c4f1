"""peft-layout LoRA adapters both ways, against HF peft itself: an adapter we save, loaded by
`PeftModel.from_pretrained` on the base model's HF directory, gives our log-probs; an adapter peft makes (ranks
and alphas per module, rsLoRA) loaded by us gives peft's. Adapters that do not fit are refused by name."""

from __future__ import annotations

import json
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

from tests.models.hf_tiny import make_hf_model, write_tiny_tokenizer
from tunix_rt.checkpoints.loader import load_model
from tunix_rt.checkpoints.peft_adapter import (
    AdapterError,
    adapter_targets,
    load_adapter,
    read_adapter_config,
    save_adapter,
)
from tunix_rt.models.lora import LoRALinear, apply_lora, merge_lora

pytestmark = pytest.mark.slow

torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")

TOKENS = np.random.default_rng(1).integers(0, 256, (2, 16))


def _logprobs(model, tokens=TOKENS) -> np.ndarray:
    positions = np.broadcast_to(np.arange(tokens.shape[1]), tokens.shape)
    return np.asarray(jax.nn.log_softmax(model(jnp.asarray(tokens), jnp.asarray(positions)), axis=-1))


def _hf_logprobs(hf, tokens=TOKENS) -> np.ndarray:
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor(np.asarray(tokens))).logits.float(), -1).numpy()


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3", "gemma2"])
def base(request, tmp_path_factory):
    src = tmp_path_factory.mktemp(f"{request.param}_base")
    hf = make_hf_model(request.param, src)
    write_tiny_tokenizer(src)
    return request.param, hf, src


def _randomise_adapters(model, seed=0):
    rng = np.random.default_rng(seed)
    for _, module in nnx.iter_modules(model):
        if isinstance(module, LoRALinear):
            module.lora_b.set_value(jnp.asarray(rng.normal(size=module.lora_b[...].shape) * 0.2, jnp.float32))


def test_our_adapter_loads_in_peft_with_our_logprobs(base, tmp_path):
    family, hf, src = base
    model = load_model(src).model
    apply_lora(model, rank=4, alpha=8.0, targets=("q_proj", "v_proj", "o_proj", "gate_proj", "down_proj"))
    _randomise_adapters(model)
    out = save_adapter(model, tmp_path / "adapter", base_model=str(src))
    config = json.loads((out / "adapter_config.json").read_text())
    assert (config["peft_type"], config["r"], config["lora_alpha"]) == ("LORA", 4, 8.0)
    assert config["target_modules"] == sorted(["q_proj", "v_proj", "o_proj", "gate_proj", "down_proj"])
    tuned = peft.PeftModel.from_pretrained(type(hf).from_pretrained(src, attn_implementation="eager").eval(), out)
    ours, theirs = _logprobs(model), _hf_logprobs(tuned)
    assert np.abs(ours - theirs).max() <= 1e-4, family
    assert np.abs(theirs - _hf_logprobs(hf)).max() > 1e-2  # the adapter changes the model
    # our own reload gives the same function bit for bit, and merged it is the same model
    again = load_model(src).model
    assert read_adapter_config(out)["r"] == 4 and load_adapter(again, out)["lora_alpha"] == 8.0
    np.testing.assert_array_equal(_logprobs(again), ours)
    assert np.abs(_logprobs(merge_lora(again)) - ours).max() <= 1e-4
    assert adapter_targets(out) == ("q_proj", "v_proj", "o_proj", "gate_proj", "down_proj")
    with pytest.raises(FileExistsError, match="--overwrite"):
        save_adapter(model, out)


@pytest.mark.parametrize("rslora", [False, True])
def test_a_peft_adapter_loads_with_peft_logprobs(base, tmp_path, rslora):
    """Made by peft: random A and B, a rank and an alpha of its own for one module, rsLoRA's scaling."""
    family, hf, src = base
    config = peft.LoraConfig(r=4, lora_alpha=16, target_modules=["q_proj", "k_proj", "up_proj", "down_proj"],
                             rank_pattern={"k_proj": 2}, alpha_pattern={"up_proj": 3}, use_rslora=rslora,
                             init_lora_weights=False, task_type="CAUSAL_LM")
    tuned = peft.get_peft_model(type(hf).from_pretrained(src, attn_implementation="eager").eval(), config)
    tuned.save_pretrained(tmp_path / "made_by_peft")
    model = load_model(src).model
    load_adapter(model, tmp_path / "made_by_peft")
    assert model.layers.locate(0)[0].attn.k_proj.lora_a[...].shape[-1] == 2
    assert np.abs(_logprobs(model) - _hf_logprobs(tuned.eval())).max() <= 1e-4, family


def test_a_bfloat16_peft_adapter_loads(base, tmp_path):
    """peft saves adapters in the training dtype, often bfloat16: they load as float32 values."""
    family, hf, src = base
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "down_proj"], init_lora_weights=False,
                             task_type="CAUSAL_LM")
    tuned = peft.get_peft_model(type(hf).from_pretrained(src, attn_implementation="eager").eval(), config)
    lora_params = [param for name, param in tuned.named_parameters() if "lora_" in name]
    with torch.no_grad():
        for param in lora_params:
            param.copy_(param.bfloat16().float())  # the values bf16 can hold: the reference runs in f32 on them
    want = _hf_logprobs(tuned.eval())
    for param in lora_params:
        param.data = param.data.bfloat16()
    tuned.save_pretrained(tmp_path / "bf16")
    model = load_model(src).model
    load_adapter(model, tmp_path / "bf16")
    assert np.abs(_logprobs(model) - want).max() <= 1e-4, family


def test_adapters_that_do_not_fit_are_refused(base, tmp_path):
    family, hf, src = base
    other = tmp_path / "other"
    other_hf = make_hf_model(family, other, hidden_size=48)
    tuned = peft.get_peft_model(other_hf, peft.LoraConfig(r=2, target_modules=["q_proj"], task_type="CAUSAL_LM"))
    tuned.save_pretrained(tmp_path / "other_adapter")
    model = load_model(src).model
    before = _logprobs(model)
    with pytest.raises(AdapterError, match=r"model\.layers\.0\.self_attn\.q_proj.*do not fit.*another base"):
        load_adapter(model, tmp_path / "other_adapter")
    deep = make_hf_model(family, tmp_path / "deep", num_hidden_layers=6)
    peft.get_peft_model(deep, peft.LoraConfig(r=2, target_modules=["v_proj"], task_type="CAUSAL_LM")).save_pretrained(
        tmp_path / "deep_adapter")
    with pytest.raises(AdapterError, match=r"layers\.\d\.self_attn\.v_proj, which this model has no"):
        load_adapter(model, tmp_path / "deep_adapter")
    np.testing.assert_array_equal(_logprobs(model), before)  # nothing applied
    assert not any(isinstance(m, LoRALinear) for _, m in nnx.iter_modules(model))
    good = tmp_path / "good"
    peft.get_peft_model(type(hf).from_pretrained(src), peft.LoraConfig(r=2, target_modules=["q_proj"],
                                                                     task_type="CAUSAL_LM")).save_pretrained(good)
    config = json.loads((good / "adapter_config.json").read_text())
    for change, message in [({"use_dora": True}, "use_dora"), ({"bias": "all"}, "bias 'all'"),
                            ({"modules_to_save": ["lm_head"]}, "modules_to_save"), ({"peft_type": "IA3"}, "IA3"),
                            ({"r": 0}, "r must be a positive number"),
                            ({"alpha_pattern": {"(": 2}}, "not a valid regular expression"),
                            ({"alpha_pattern": {"q_proj": "x"}}, r"alpha_pattern\['q_proj'\] must be a positive"),
                            ({"lora_alpha": float("nan")}, "NaN is not a number JSON allows"),
                            ({"lora_alpha": float("inf")}, "Infinity is not a number JSON allows"),
                            ({"lora_alpha": 1e9}, "lora_alpha must be a positive number up to 10000"),
                            ({"rank_pattern": {"q_proj": 4}}, "q_proj's lora_A has rank 2, but its config says r = 4"),
                            ({"alpha_pattern": {"x" * 2000: 2}}, "longer than 1024 characters"),
                            ({"lora_tricks": True, "zzz": 1}, "unknown key.*'lora_tricks', 'zzz'"),
                            ({"layer_replication": [[0, 1]]}, "layer_replication"),
                            ({"use_dora": False, "lora_bias": True}, "lora_bias")]:
        (good / "adapter_config.json").write_text(json.dumps({**config, **change}))
        with pytest.raises(AdapterError, match=message):
            load_adapter(model, good)
    # a pattern that backtracks for ever is stopped at its time limit, with the interpreter free meanwhile
    (good / "adapter_config.json").write_text(json.dumps(
        {**config, "alpha_pattern": {r"(?:(?:[a-z_.0-9]|\w|.)+?){e<=2}(?:X|Y)": 2}}))
    start = time.monotonic()
    with pytest.raises(AdapterError, match="patterns take more than 1 s to match"):
        load_adapter(model, good)
    assert time.monotonic() - start < 5
    # the (.*)*X, which froze a server under Python's re: the regex engine answers at once (no match)
    (good / "adapter_config.json").write_text(json.dumps({**config, "alpha_pattern": {"(.*)*X": 2}}))
    start = time.monotonic()
    load_adapter(load_model(src).model, good)
    assert time.monotonic() - start < 5
    (good / "adapter_config.json").write_text(json.dumps(config))
    weights = load_file(good / "adapter_model.safetensors")
    key = next(k for k in weights if "lora_B" in k)
    for value, message in [(np.nan, "lora_B has non-finite values"), (np.inf, "lora_B has non-finite values"),
                           (1e6, r"lora_B has values beyond ±10000")]:
        bad = dict(weights)
        bad[key] = np.full_like(weights[key], value)
        save_file(bad, good / "adapter_model.safetensors")
        with pytest.raises(AdapterError, match=message):
            load_adapter(model, good)
    save_file(weights, good / "adapter_model.safetensors")
    weights = (good / "adapter_model.safetensors").read_bytes()
    (good / "adapter_model.safetensors").write_bytes(weights[:len(weights) // 2])
    with pytest.raises(AdapterError, match="not a readable safetensors file"):
        load_adapter(model, good)
    (good / "adapter_model.safetensors").write_bytes(weights)
    load_adapter(model, good)
    with pytest.raises(AdapterError, match="already has a LoRA adapter"):
        load_adapter(model, good)
    with pytest.raises(AdapterError, match="not a peft adapter directory"):
        load_adapter(model, src)
    with pytest.raises(AdapterError, match="no LoRA adapters"):
        save_adapter(load_model(src).model, tmp_path / "none")
