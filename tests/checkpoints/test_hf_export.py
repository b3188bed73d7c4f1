"""HF-layout export: transformers and our loader both load what export_hf writes, to the same logits."""

from __future__ import annotations

import json

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from safetensors import safe_open

from tests.models.hf_tiny import FAMILIES, make_hf_model, write_tiny_tokenizer
from tunix_rt.checkpoints.hf_export import export_hf
from tunix_rt.checkpoints.loader import load_model
from tunix_rt.checkpoints.tokenizer import Tokenizer

pytestmark = pytest.mark.slow

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

SEQ = 24  # longer than the Gemma configs' sliding window (8)
STRINGS = ["the theme then", "Hi there!  <s>x</s> ü 🦊", "", "\tthe\nthe  "]


def _logits(model, tokens):
    positions = np.broadcast_to(np.arange(tokens.shape[1]), tokens.shape)
    return np.asarray(model(jnp.asarray(tokens), jnp.asarray(positions)))


def _hf_logits(hf, tokens):
    with torch.no_grad():
        return hf(torch.tensor(np.asarray(tokens))).logits.float().numpy()


def _same_tokenizer(a: Tokenizer, b: Tokenizer, strings):
    for s in strings:
        assert a.encode(s) == b.encode(s), s
        assert a.encode(s, add_special_tokens=False) == b.encode(s, add_special_tokens=False), s
        ids = a.encode(s)
        assert a.decode(ids, skip_special_tokens=False) == b.decode(ids, skip_special_tokens=False)
    assert (a.bos_token, a.eos_token, a.pad_token_id) == (b.bos_token, b.eos_token, b.pad_token_id)
    assert a.eos_token_ids == b.eos_token_ids and a.add_bos_token == b.add_bos_token
    assert a.chat_template == b.chat_template


TOKENS = np.random.default_rng(0).integers(0, 256, (2, SEQ))


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def exported(request, tmp_path_factory):
    src, dst = tmp_path_factory.mktemp(f"{request.param}_src"), tmp_path_factory.mktemp(f"{request.param}_hf")
    hf = make_hf_model(request.param, src)
    write_tiny_tokenizer(src)
    first = load_model(src)
    assert export_hf(first.model, first.tokenizer, first.hf_config, dst, generation_config=first.generation_config) == dst
    return request.param, hf, first, dst


def test_transformers_loads_the_export(exported):
    family, hf, _, dst = exported
    config = json.loads((dst / "config.json").read_text())
    assert config["architectures"] == [type(hf).__name__] and config["dtype"] == "float32"
    again = transformers.AutoModelForCausalLM.from_pretrained(dst, dtype=torch.float32, attn_implementation="eager").eval()
    assert type(again) is type(hf)
    theirs, ours = hf.state_dict(), again.state_dict()
    assert theirs.keys() == ours.keys()
    assert all(torch.equal(theirs[k], ours[k]) for k in theirs), family
    delta = np.abs(_hf_logits(again, TOKENS) - _hf_logits(hf, TOKENS)).max()
    assert delta <= 1e-5, f"{family}: max |delta logits| = {delta:.2e}"
    if family != "qwen2":  # transformers swaps in its Qwen2Tokenizer (Qwen's own pre-tokenizer) for model_type qwen2
        auto = transformers.AutoTokenizer.from_pretrained(dst)
        assert [auto(s)["input_ids"] for s in STRINGS] == [Tokenizer.from_hf_dir(dst).encode(s) for s in STRINGS]


def test_our_loader_reloads_the_export(exported):
    family, _, first, dst = exported
    again = load_model(dst)
    assert np.array_equal(_logits(again.model, TOKENS), _logits(first.model, TOKENS)), family
    _same_tokenizer(first.tokenizer, again.tokenizer, STRINGS)
    assert first.tokenizer.encode("the") == [1, first.tokenizer.backend.token_to_id("▁the")]  # BOS, merges
    messages = [{"role": "user", "content": "the"}]
    render = lambda loaded: loaded.tokenizer.apply_chat_template(messages, tokenize=True)
    assert render(again) == render(first)
    assert again.generation_config == {**first.generation_config, "eos_token_id": again.generation_config["eos_token_id"]}
    assert again.hf_config["tie_word_embeddings"] == first.model.config.tie_word_embeddings
    with safe_open(str(dst / "model.safetensors"), framework="numpy") as f:
        assert ("lm_head.weight" in f.keys()) != first.model.config.tie_word_embeddings


@pytest.mark.parametrize("exported", ["llama"], indirect=True)
def test_export_replaces_a_directory_only_when_told(exported, tmp_path):
    _, _, first, dst = exported
    before = {p.name: p.read_bytes() for p in dst.iterdir()}
    with pytest.raises(FileExistsError, match="non-empty directory.*--overwrite"):
        export_hf(first.model, first.tokenizer, first.hf_config, dst)
    assert {p.name: p.read_bytes() for p in dst.iterdir()} == before  # untouched
    (dst / "model.safetensors.index.json").write_text("{}")  # stale files that would shadow the new weights
    (dst / "model-00001-of-00002.safetensors").write_bytes(b"x")
    export_hf(first.model, first.tokenizer, first.hf_config, dst, overwrite=True)
    assert sorted(p.name for p in dst.iterdir()) == sorted(before)  # replaced as a whole: no stale file stays
    assert np.array_equal(_logits(load_model(dst).model, TOKENS[:1, :6]), _logits(first.model, TOKENS[:1, :6]))
    assert not [p for p in dst.parent.iterdir() if p.name.startswith(f".{dst.name}.")]  # no staging left behind
    with pytest.raises(FileExistsError, match="overlaps the input"):
        export_hf(first.model, first.tokenizer, first.hf_config, dst, overwrite=True, sources=[dst])
    (tmp_path / "file").write_text("mine")
    with pytest.raises(FileExistsError, match="not a directory"):
        export_hf(first.model, first.tokenizer, first.hf_config, tmp_path / "file")


@pytest.mark.parametrize("exported", ["llama"], indirect=True)
def test_unknown_variable_is_refused(exported, tmp_path):
    _, _, first, _ = exported
    model = nnx.clone(first.model)
    model.layers.locate(0)[0].attn.q_proj.lora_a = nnx.Param(jnp.zeros((64, 4)))
    with pytest.raises(ValueError, match=r"layers\.kinds\.0\.attn\.q_proj\.lora_a"):
        export_hf(model, first.tokenizer, first.hf_config, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_quantized_dir_exports_dequantized(tmp_path):
    from tunix_rt.checkpoints.quantized_dir import quantize_checkpoint

    make_hf_model("qwen3", tmp_path / "src")
    write_tiny_tokenizer(tmp_path / "src")
    quantize_checkpoint(tmp_path / "src", tmp_path / "q", "int4", 32)
    quantized = load_model(tmp_path / "q")
    assert "quantization_config" not in quantized.hf_config
    dst = export_hf(quantized.model, quantized.tokenizer, quantized.hf_config, tmp_path / "hf")
    assert "quantization_config" not in json.loads((dst / "config.json").read_text())
    tokens = TOKENS[:1, :12]  # more than 4 rows: the quantized matmul runs exact f32 products
    delta = np.abs(_logits(load_model(dst).model, tokens) - _logits(quantized.model, tokens)).max()
    assert delta <= 1e-5, f"max |delta logits| = {delta:.2e}"


# --- the default model: quantized GGUF weights, GGUF-built tokenizer ----------------------------------------


@pytest.fixture(scope="module")
def default_export(tmp_path_factory):
    from tunix_rt.checkpoints.default_model import DefaultModelMissing

    try:
        loaded = load_model("default")
    except DefaultModelMissing as e:
        pytest.skip(f"default model not installed: {e}")
    return loaded, export_hf(loaded.model, loaded.tokenizer, loaded.hf_config, tmp_path_factory.mktemp("default_hf"))


def test_default_model_export_reloads(default_export):
    from tunix_rt.models.quant_layers import dequantize_stacked
    from tunix_rt.ops.quant import QuantizedTensor

    loaded, dst = default_export
    again = load_model(dst)
    # The weights are the quantized ones, dequantized exactly.
    ours = dict(nnx.to_flat_state(nnx.state(again.model)))
    for path, var in nnx.to_flat_state(nnx.state(loaded.model)):
        value = var.get_value()
        if isinstance(value, QuantizedTensor):
            w = np.asarray(dequantize_stacked(value))
            if path[-1] == "table_t":
                path, w = (*path[:-1], "embedding"), w.T
            value = w
        assert np.array_equal(np.asarray(ours[path].get_value()), np.asarray(value)), path
    # Logits differ only by the quantized matmul's summation order (logits reach ~30).
    tokens = np.asarray([loaded.tokenizer.encode("The capital of France is Paris, and")])
    delta = np.abs(_logits(again.model, tokens) - _logits(loaded.model, tokens)).max()
    assert delta <= 5e-4, f"max |delta logits| = {delta:.2e}"


def test_default_model_tokenizer_round_trips(default_export):
    loaded, dst = default_export
    src, tok = loaded.tokenizer, Tokenizer.from_hf_dir(dst)
    strings = ["Hello world", "<|im_start|>user\nHi ünïcødé 🦊 12345<|im_end|>", "  two spaces\n\ttab", ""]
    _same_tokenizer(src, tok, strings)
    messages = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "2+2? ü"}]
    assert tok.apply_chat_template(messages) == src.apply_chat_template(messages)
    assert tok.apply_chat_template(messages, tokenize=True) == src.apply_chat_template(messages, tokenize=True)
    auto = transformers.AutoTokenizer.from_pretrained(dst)
    for s in strings[:3]:
        assert auto(s)["input_ids"] == src.encode(s), s
    config = json.loads((dst / "config.json").read_text())
    assert config["eos_token_id"] == src.eos_token_ids[0] and config["architectures"] == ["LlamaForCausalLM"]


def test_default_model_exports_bf16(default_export, tmp_path):
    loaded, f32_dir = default_export
    dst = export_hf(loaded.model, loaded.tokenizer, loaded.hf_config, tmp_path, dtype="bfloat16")
    with safe_open(str(dst / "model.safetensors"), framework="numpy") as f, \
            safe_open(str(f32_dir / "model.safetensors"), framework="numpy") as f32:
        assert f.metadata() == {"format": "pt"}
        assert set(f.keys()) == set(f32.keys()) and "lm_head.weight" not in f.keys()  # tied
        assert {f.get_tensor(n).dtype for n in f.keys()} == {np.dtype(ml_dtypes.bfloat16)}
        for name in ("model.embed_tokens.weight", "model.layers.3.mlp.down_proj.weight"):
            assert np.array_equal(f.get_tensor(name), f32.get_tensor(name).astype(ml_dtypes.bfloat16))
        embedding = f.get_tensor("model.embed_tokens.weight")
    assert json.loads((dst / "config.json").read_text())["dtype"] == "bfloat16"
    again = load_model(dst, dtype=jnp.bfloat16)
    assert again.model.embed.embedding[...].dtype == jnp.bfloat16
    assert np.array_equal(np.asarray(again.model.embed.embedding[...]), embedding)
