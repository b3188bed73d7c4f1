"""`tunix-rt quantize` output: an HF directory with packed linear weights that --model accepts."""

from __future__ import annotations

import json
import subprocess
import sys

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.models.hf_tiny import make_hf_model
from tunix_rt.checkpoints import hf_dir
from tunix_rt.checkpoints.default_model import default_model_path
from tunix_rt.checkpoints.errors import CheckpointError
from tunix_rt.checkpoints.gguf_loader import open_gguf
from tunix_rt.checkpoints.loader import load_model
from tunix_rt.checkpoints.quantized_dir import quantize_checkpoint
from tunix_rt.checkpoints.tokenizer import Tokenizer
from tunix_rt.checkpoints.weights import build_decoder
from tunix_rt.models.quant_layers import QuantLinear

pytest.importorskip("torch")


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    src = tmp_path_factory.mktemp("src")
    make_hf_model("qwen2", src)
    Tokenizer.from_gguf(open_gguf(default_model_path())).backend.save(str(src / "tokenizer.json"))
    return src


def _logprobs(model, tokens):
    pos = jnp.arange(tokens.shape[1])[None].repeat(tokens.shape[0], 0)
    return np.asarray(jax.nn.log_softmax(model(jnp.asarray(tokens), pos), -1))


@pytest.mark.slow
def test_q4_0_checkpoint_equals_ggml_round_trip(source, tmp_path):
    """Independent reference: the float model whose linear weights went through gguf.quants' Q4_0."""
    out = tmp_path / "q4"
    summary = quantize_checkpoint(source, out, "q4_0")
    assert summary["quantized"] == 2 * 7 and summary["bytes"] < summary["source_bytes"]
    assert json.loads((out / "config.json").read_text())["quantization_config"]["format"] == "q4_0"
    loaded = load_model(out)
    assert isinstance(loaded.model.layers.locate(1)[0].mlp.down_proj, QuantLinear)

    def ggml_round_trip():
        for name, w in hf_dir.iter_tensors(source):
            if name.endswith("_proj.weight"):
                w = gguf.quants.dequantize(gguf.quants.quantize(np.asarray(w, np.float32), gguf.GGMLQuantizationType.Q4_0),
                                           gguf.GGMLQuantizationType.Q4_0)
            yield name, w

    reference = build_decoder(hf_dir.read_config(source), ggml_round_trip())
    tokens = np.random.default_rng(0).integers(0, 256, (2, 24))  # 48 rows: the exact GEMM path
    np.testing.assert_allclose(_logprobs(loaded.model, tokens), _logprobs(reference, tokens), atol=1e-4)
    dequantized = load_model(out, dequantize=True).model
    assert not isinstance(dequantized.layers.locate(1)[0].mlp.down_proj, QuantLinear)
    np.testing.assert_allclose(_logprobs(dequantized, tokens), _logprobs(reference, tokens), atol=1e-4)


def test_int8_group64_through_the_cli(source, tmp_path):
    out = tmp_path / "i8"
    proc = subprocess.run([sys.executable, "-m", "tunix_rt.cli", "quantize", "--model", str(source), "--format", "int8",
                           "--group-size", "64", "--output", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "12 weights quantized to int8" in proc.stdout  # down_proj's K = 96 does not split into groups of 64
    assert "2 linear weight(s) left in float" in proc.stdout and "down_proj" in proc.stdout
    qt = load_model(out).model.layers.locate(0)[0].attn.q_proj.kernel.get_value()
    assert (qt.fmt, qt.group, qt.shape) == ("int8", 64, (64, 64))


def test_bad_requests(source, tmp_path):
    quantize_checkpoint(source, tmp_path / "q", "q8_0")
    with pytest.raises(CheckpointError, match="already quantized"):
        quantize_checkpoint(tmp_path / "q", tmp_path / "again", "q4_0")
    with pytest.raises(ValueError, match="group_size for int4"):
        quantize_checkpoint(source, tmp_path / "g", "int4", 48)
    with pytest.raises(ValueError, match="fmt must be one of"):
        quantize_checkpoint(source, tmp_path / "f", "q5_k")
    with pytest.raises(CheckpointError, match="HF model directory"):
        quantize_checkpoint(default_model_path(), tmp_path / "gg", "q4_0")


def test_non_finite_scales_in_a_file_are_rejected(source, tmp_path):
    from safetensors.numpy import load_file, save_file

    out = tmp_path / "q"
    quantize_checkpoint(source, out, "q4_0")
    tensors = load_file(out / "model.safetensors")
    name = "model.layers.0.mlp.up_proj.weight.scales"
    tensors[name] = tensors[name].copy()
    tensors[name][3, 0] = np.float16(np.inf)
    save_file(tensors, out / "model.safetensors")
    with pytest.raises(ValueError, match="up_proj.weight has non-finite scales"):
        load_model(out)
