"""GGUF export: the written file loads back as the model it came from (packed weights bitwise, logits of f32
exports exactly), its tokenizer encodes as the model's, llama.cpp reads what GGUF cannot say the way we compute
it or the export is refused, and the CLI never writes over what it did not write."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests.models.hf_tiny import make_tiny_model_dir
from tunix_rt.checkpoints.gguf_export import GGUFExportError, export_gguf
from tunix_rt.checkpoints.gguf_loader import open_gguf
from tunix_rt.checkpoints.loader import load_model
from tunix_rt.checkpoints.output_dir import OutputDirError
from tunix_rt.ops.quant import QuantizedTensor, dequantize, quantize

pytest.importorskip("transformers", reason="the tiny HF models are made with transformers (the parity extra)")

FAMILIES = {"llama": {}, "qwen2": {}, "qwen3": {}, "gemma2": dict(query_pre_attn_scalar=16), "gemma3_text": {},
            "qwen3_moe": {}}
TOKENS = np.array([[1, 40, 57, 5, 81, 99, 100, 23, 7, 64, 3, 90]], np.int32)


def _logits(model, tokens=TOKENS):
    positions = np.broadcast_to(np.arange(tokens.shape[1]), tokens.shape)
    return np.asarray(model(jnp.asarray(tokens), jnp.asarray(positions)), np.float32)


def _leaves(model) -> dict[str, object]:
    return {".".join(map(str, path)): var.get_value() for path, var in nnx.to_flat_state(nnx.state(model))}


def _file_tensors(path) -> dict[str, tuple[str, bytes]]:
    return {t.name: (t.tensor_type.name, np.asarray(t.data).tobytes()) for t in open_gguf(path).tensors}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def tiny(request, tmp_path_factory):
    family = request.param
    source = tmp_path_factory.mktemp(f"hf-{family}")
    make_tiny_model_dir(source, family, **FAMILIES[family])
    return family, load_model(source)


def test_f32_export_loads_back_as_the_same_model(tiny, tmp_path):
    family, loaded = tiny
    out = export_gguf(loaded.model, loaded.tokenizer, tmp_path / "m.gguf", quant="f32")
    back = load_model(out)
    eps = loaded.model.config.rms_norm_eps  # GGUF holds it as a float32
    assert back.model.config.rms_norm_eps == pytest.approx(eps, rel=1e-7)
    assert dataclasses.replace(back.model.config, rms_norm_eps=eps) == loaded.model.config, family
    np.testing.assert_allclose(_logits(back.model), _logits(loaded.model), rtol=1e-5, atol=1e-5)
    assert back.tokenizer.encode("the theme: 42!") == loaded.tokenizer.encode("the theme: 42!")
    assert back.tokenizer.chat_template == loaded.tokenizer.chat_template


@pytest.mark.parametrize("quant", ["q8_0", "q4_0", "q4_1"])
def test_quantized_export_round_trips_bitwise(tiny, quant, tmp_path):
    """Each matrix is packed by our quantizer; loading the file gives those blocks back, and exporting the loaded
    model again writes the same bytes (packed layers pass through unchanged)."""
    family, loaded = tiny
    first = export_gguf(loaded.model, loaded.tokenizer, tmp_path / "a.gguf", quant=quant)
    back = load_model(first)
    packed = {k: v for k, v in _leaves(back.model).items() if isinstance(v, QuantizedTensor)}
    assert packed and all(v.fmt == quant for v in packed.values()), family
    # one layer's blocks against quantize() of the original's float weight
    name = next(k for k in packed if "mlp" in k and "kernel" in k and "experts" not in k) if family != "qwen3_moe" \
        else next(k for k in packed if "attn" in k and "q_proj" in k)
    original = _leaves(loaded.model)[name]
    original = dequantize(original) if isinstance(original, QuantizedTensor) else jnp.asarray(original)
    expected, got = quantize(original[0], quant), jax.tree.map(lambda a: a[0], packed[name])
    np.testing.assert_array_equal(np.asarray(got.qs), np.asarray(expected.qs))
    np.testing.assert_array_equal(np.asarray(got.scales), np.asarray(expected.scales))
    second = export_gguf(back.model, back.tokenizer, tmp_path / "b.gguf", quant=quant, source=first)
    assert _file_tensors(second) == _file_tensors(first)
    want, got = _logits(loaded.model), _logits(back.model)  # a tiny random model: logits move with the codes
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < (0.05 if quant == "q8_0" else 0.4), family


def test_default_model_packed_layers_pass_through(tmp_path):
    """The default model (Q4_1) exported as q4_1: every tensor's bytes are the source file's, the tokenizer
    metadata is the source's."""
    src = load_model(None)
    out = export_gguf(src.model, src.tokenizer, tmp_path / "smol.gguf", quant="q4_1", source=src.source)
    source_tensors, written = _file_tensors(src.source), _file_tensors(out)
    assert set(written) <= set(source_tensors)
    same_type = [n for n in written if written[n][0] == source_tensors[n][0]]
    assert len(same_type) >= len(written) - 2  # any F16/F32 matrices of the source are rewritten in the export's type
    assert all(written[n] == source_tensors[n] for n in same_type if written[n][0] == "Q4_1")
    src_fields, out_fields = open_gguf(src.source).fields, open_gguf(out).fields
    for key in src_fields:
        if key.startswith("tokenizer."):
            assert out_fields[key].contents() == src_fields[key].contents(), key


def test_llama_cpp_query_scale_and_layer_pattern_are_checked(tmp_path):
    source = tmp_path / "hf"
    make_tiny_model_dir(source, "gemma2", query_pre_attn_scalar=24)
    loaded = load_model(source)
    with pytest.raises(GGUFExportError, match="query scale"):
        export_gguf(loaded.model, loaded.tokenizer, tmp_path / "g.gguf")
    assert not (tmp_path / "g.gguf").exists()


def test_bad_quant_and_targets_are_refused(tiny, tmp_path):
    _, loaded = tiny
    with pytest.raises(GGUFExportError, match="quant must be one of"):
        export_gguf(loaded.model, loaded.tokenizer, tmp_path / "x.gguf", quant="q5_k")
    target = tmp_path / "kept.gguf"
    target.write_bytes(b"user data")
    with pytest.raises(OutputDirError, match="exists"):
        export_gguf(loaded.model, loaded.tokenizer, target)
    assert target.read_bytes() == b"user data"
    first = export_gguf(loaded.model, loaded.tokenizer, tmp_path / "first.gguf")
    with pytest.raises(OutputDirError, match="is the input"):
        export_gguf(loaded.model, loaded.tokenizer, first, source=first, overwrite=True)
    assert not list(tmp_path.glob(".*partial*"))


def test_llama_cpp_reads_an_f32_export_as_we_do(tiny, tmp_path):
    """llama.cpp's log-probs of the exported file (token ids fed directly, its KV cache in f32 rather than its
    default f16, whose rounding alone moves them by ~1e-3) within 1e-3 of ours."""
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (benchmarks install it)")
    family, loaded = tiny
    out = export_gguf(loaded.model, loaded.tokenizer, tmp_path / "m.gguf", quant="f32")
    f32 = 0  # GGML_TYPE_F32
    llm = llama_cpp.Llama(str(out), n_ctx=64, n_threads=2, logits_all=True, verbose=False, type_k=f32, type_v=f32,
                          flash_attn=False)
    llm.eval(TOKENS[0].tolist())
    theirs = np.asarray(llm.scores[: TOKENS.shape[1]], np.float64)
    log_softmax = lambda x: x - np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1, keepdims=True)) - x.max(-1, keepdims=True)
    # ggml's CPU GELU (Gemma's MLP) rounds its input to f16 and reads an f16 table (GGML_GELU_FP16 in
    # ggml-cpu/vec.h), which alone moves these log-probs by up to 1.5e-3: our model takes the same rounding here,
    # so what is compared is how the file is read (then within 2.2e-4; the SiLU families 3.5e-6).
    mlps = [m for _, m in nnx.iter_modules(loaded.model) if hasattr(m, "act")] if family.startswith("gemma") else []
    saved = [m.act for m in mlps]
    for mlp in mlps:
        mlp.act = _ggml_gelu
    try:
        ours = _logits(loaded.model)[0].astype(np.float64)
    finally:
        for mlp, act in zip(mlps, saved):
            mlp.act = act
    np.testing.assert_allclose(log_softmax(theirs), log_softmax(ours), atol=1e-3, err_msg=family)


def _ggml_gelu(x):
    """ggml's CPU GELU: the input rounded to f16, the tanh GELU of it rounded to f16; x itself past +-10."""
    y = jax.nn.gelu(x.astype(jnp.float16).astype(jnp.float32), approximate=True)
    y = y.astype(jnp.float16).astype(jnp.float32)
    return jnp.where(x <= -10.0, 0.0, jnp.where(x >= 10.0, x, y))


@pytest.mark.parametrize("quant", ["q8_0", "q4_0"])
def test_llama_cpp_greedy_equals_ours_on_the_default_model(quant, tmp_path):
    """The default model exported as q8_0 / q4_0: llama.cpp's first 16 greedy tokens equal our engine's on the
    same file. Prompts whose continuations have clear margins: on open-ended ones the two part at near-ties
    after a few tokens (llama.cpp keeps its KV cache in f16 and multiplies the output head by int8
    activations; the engine keeps f32 and an exact head), which says nothing about how the file is read."""
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (benchmarks install it)")
    from tunix_rt.engine.engine import Engine
    from tunix_rt.engine.params import SamplingParams

    src = load_model(None)
    out = export_gguf(src.model, src.tokenizer, tmp_path / f"smol-{quant}.gguf", quant=quant, source=src.source)
    ours = load_model(out)
    prompts = [ours.tokenizer.encode(text) for text in ("def fibonacci(n):\n", "1, 2, 3, 4, 5,")]
    engine = Engine(ours.model, ours.tokenizer, max_model_len=128, max_num_seqs=2)
    results = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    llm = llama_cpp.Llama(str(out), n_ctx=128, n_threads=2, verbose=False)
    for prompt, result in zip(prompts, results):
        theirs = []
        for token in llm.generate(prompt, temp=0.0, top_k=1, reset=True):
            theirs.append(int(token))
            if len(theirs) == 16:
                break
        assert list(result.token_ids) == theirs, ours.tokenizer.decode(prompt)


def test_cli_writes_a_gguf_and_refuses_other_names(tmp_path, capsys):
    from tests.train.test_train_cli import cli

    source = tmp_path / "hf"
    make_tiny_model_dir(source, "qwen3")
    out = tmp_path / "tiny.gguf"
    assert cli("export", "--model", source, "--format", "gguf", "--quant", "q8_0", "--output", out) == 0
    assert {v.fmt for v in _leaves(load_model(out).model).values() if isinstance(v, QuantizedTensor)} == {"q8_0"}
    assert cli("export", "--model", source, "--format", "gguf", "--output", tmp_path / "tiny.bin") == 2
    assert "must name a .gguf file" in capsys.readouterr().err
    assert cli("export", "--model", source, "--format", "gguf", "--output", out) == 2  # exists: --overwrite
    assert cli("export", "--model", out, "--format", "gguf", "--output", out, "--overwrite") == 2  # its own input


def test_byte_level_tokenizer_is_converted_with_llama_cpps_pre_tokenizer_name(tmp_path):
    """A model directory with SmolLM2's tokenizer.json (no GGUF to copy from): the file gets the vocabulary,
    merges and `smollm` pre-tokenizer the original GGUF has."""
    import json

    from tests.models.hf_tiny import make_hf_model

    default = load_model(None)
    source = tmp_path / "hf"
    make_hf_model("llama", source, vocab_size=default.tokenizer.vocab_size, tie_word_embeddings=True)
    default.tokenizer.backend.save(str(source / "tokenizer.json"))
    (source / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": default.tokenizer.bos_token, "eos_token": default.tokenizer.eos_token}))
    loaded = load_model(source)
    out = export_gguf(loaded.model, loaded.tokenizer, tmp_path / "m.gguf")
    written, original = open_gguf(out).fields, open_gguf(default.source).fields
    assert written["tokenizer.ggml.model"].contents() == "gpt2"
    assert written["tokenizer.ggml.pre"].contents() == original["tokenizer.ggml.pre"].contents() == "smollm"
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.bos_token_id",
                "tokenizer.ggml.eos_token_id"):
        assert written[key].contents() == original[key].contents(), key
    text = "Numbers 12345 and CamelCase words: naïve café."
    assert load_model(out).tokenizer.encode(text) == default.tokenizer.encode(text)


def test_lora_run_exports_merged_and_llama_cpp_reads_it(tmp_path):
    """A LoRA adapter on the default model, exported by the CLI as f32 GGUF: the file holds the merged model
    (our loader's logits equal the merged model's), and llama.cpp (where installed) reads it within 1e-3."""
    from tests.lora_adapters import random_adapter
    from tests.train.test_train_cli import cli
    from tunix_rt.checkpoints.peft_adapter import load_adapter
    from tunix_rt.models.lora import merge_lora

    base = load_model(None)
    adapter = random_adapter(base.model, tmp_path / "adapter", rank=4, seed=3, scale=0.05)
    out = tmp_path / "merged.gguf"
    assert cli("export", "--lora", adapter, "--format", "gguf", "--output", out) == 0
    merged = load_model(None).model
    load_adapter(merged, adapter)
    merged = merge_lora(merged)
    tokens = np.asarray([load_model(None).tokenizer.encode("The quick brown fox jumps over the lazy dog.")], np.int32)
    want = _logits(merged, tokens)
    np.testing.assert_allclose(_logits(load_model(out).model, tokens), want, rtol=1e-5, atol=1e-4)
    assert np.abs(want - _logits(load_model(None).model, tokens)).max() > 0.1  # the adapter changed the model
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (benchmarks install it)")
    llm = llama_cpp.Llama(str(out), n_ctx=64, n_threads=2, logits_all=True, verbose=False, type_k=0, type_v=0)
    llm.eval(tokens[0].tolist())
    theirs = np.asarray(llm.scores[: tokens.shape[1]], np.float64)
    log_softmax = lambda x: x - np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1, keepdims=True)) - x.max(-1, keepdims=True)
    np.testing.assert_allclose(log_softmax(theirs), log_softmax(want[0].astype(np.float64)), atol=1e-3)


def test_an_adapters_base_is_never_written_over(tiny, tmp_path, capsys):
    """`--model ADAPTER_DIR` reads the base its adapter_config names: exporting onto that base file is refused
    even with --overwrite, and the base is left as it was."""
    from tests.train.test_train_cli import cli
    from tunix_rt.checkpoints.peft_adapter import save_adapter
    from tunix_rt.models.lora import apply_lora

    _, loaded = tiny
    base = export_gguf(loaded.model, loaded.tokenizer, tmp_path / "base.gguf")
    before = base.read_bytes()
    model = load_model(base).model
    apply_lora(model, rank=2, alpha=4.0, seed=0)
    adapter = save_adapter(model, tmp_path / "adapter", base_model=str(base))
    assert cli("export", "--model", adapter, "--format", "gguf", "--output", base, "--overwrite") == 2
    assert "is the input" in capsys.readouterr().err
    assert base.read_bytes() == before
    out = tmp_path / "merged.gguf"  # elsewhere it is written, with the base's own tokenizer metadata
    assert cli("export", "--model", adapter, "--format", "gguf", "--output", out) == 0
    assert open_gguf(out).fields["tokenizer.ggml.tokens"].contents() == \
        open_gguf(base).fields["tokenizer.ggml.tokens"].contents()
