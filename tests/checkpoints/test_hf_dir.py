"""HF directory reading: sharded safetensors with an index, generation config, tokenizer files."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.models.hf_tiny import make_hf_model
from tunix_rt.checkpoints import hf_dir
from tunix_rt.checkpoints.default_model import default_model_path
from tunix_rt.checkpoints.gguf_loader import open_gguf
from tunix_rt.checkpoints.loader import load_model
from tunix_rt.checkpoints.tokenizer import Tokenizer

torch = pytest.importorskip("torch")


@pytest.mark.slow
def test_sharded_checkpoint_loads_like_the_model(tmp_path):
    hf = make_hf_model("qwen3", tmp_path)
    hf.save_pretrained(tmp_path, max_shard_size="40KB")  # several shards + model.safetensors.index.json
    (tmp_path / "model.safetensors").unlink(missing_ok=True)
    shards = hf_dir.safetensors_files(tmp_path)
    assert len(shards) > 1 and (tmp_path / hf_dir.INDEX_FILE).is_file()
    Tokenizer.from_gguf(open_gguf(default_model_path())).backend.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7], "temperature": 0.6}))

    loaded = load_model(tmp_path)
    tokens = np.random.default_rng(0).integers(0, 256, (1, 20))
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor(tokens)).logits, -1).numpy()
    got = jax.nn.log_softmax(loaded.model(jnp.asarray(tokens), jnp.arange(20)[None]), -1)
    assert np.abs(np.asarray(got) - ref).max() <= 1e-4
    assert loaded.generation_config["temperature"] == 0.6
    assert 7 in loaded.tokenizer.eos_token_ids


def test_index_naming_a_missing_shard(tmp_path):
    make_hf_model("llama", tmp_path)
    (tmp_path / hf_dir.INDEX_FILE).write_text(json.dumps({"weight_map": {"a": "model-00001-of-00002.safetensors"}}))
    with pytest.raises(ValueError, match="missing"):
        hf_dir.safetensors_files(tmp_path)


def test_invalid_config_json(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        hf_dir.read_config(tmp_path)


def test_safetensors_reader_matches_the_package_and_refuses_bad_files(tmp_path):
    """hf_dir.SafetensorsFile (plain reads, no mapping) gives the safetensors package's arrays, every dtype a
    checkpoint holds; a truncated file, a header out of bounds or a malformed entry is a CheckpointError."""
    import ml_dtypes
    from safetensors.numpy import load_file, save_file

    from tunix_rt.checkpoints.errors import CheckpointError

    rng = np.random.default_rng(0)
    tensors = {"f32": rng.standard_normal((3, 5)).astype(np.float32), "f16": rng.standard_normal(4).astype(np.float16),
               "bf16": rng.standard_normal((2, 2)).astype(ml_dtypes.bfloat16), "i64": np.arange(6).reshape(2, 3),
               "empty": np.zeros((0, 4), np.float32), "scalar": np.array(1.5, np.float32)}
    path = tmp_path / "model.safetensors"
    save_file(tensors, path, metadata={"format": "np"})
    want, f = load_file(path), hf_dir.SafetensorsFile(path)
    assert sorted(f.tensors) == sorted(want)
    for name, array in want.items():
        got = f.read(name)
        assert got.dtype == array.dtype and got.shape == array.shape
        assert got.tobytes() == array.tobytes()
    raw = path.read_bytes()
    header_len = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + header_len])
    cases = {"truncated": raw[:-8], "no header": raw[:4],
             "huge header length": (10**12).to_bytes(8, "little") + raw[8:],
             "header not JSON": raw[:8] + b"{" * header_len + raw[8 + header_len:]}
    for key, change in (("dtype", "Q4"), ("shape", [3, 6]), ("data_offsets", [0, 10**9]), ("shape", [-1, 5]),
                        ("shape", [2**63, 2]), ("shape", [2**40, 2**40]), ("data_offsets", "0-60"), (None, [1, 2])):
        bad = json.loads(json.dumps(header))
        if key is None:
            bad["f32"] = change  # an entry that is no object
        else:
            bad["f32"][key] = change
        text = json.dumps(bad).encode().ljust(header_len)
        cases[f"bad {key} {change}"] = raw[:8] + text[:header_len] + raw[8 + header_len:] if len(text) <= header_len \
            else len(text).to_bytes(8, "little") + text + raw[8 + header_len:]
    for what, data in cases.items():
        path.write_bytes(data)
        with pytest.raises(CheckpointError, match="safetensors|malformed|truncated|header"):
            f = hf_dir.SafetensorsFile(path)
            for name in f.tensors:
                f.read(name)
    # a dtype numpy has none of is listed (the loader skips what it has no place for) and refused when read
    complex_header = json.loads(json.dumps(header))
    complex_header["f32"]["dtype"], complex_header["f32"]["shape"] = "C64", [3, 1]
    complex_header["f32"]["data_offsets"][1] = complex_header["f32"]["data_offsets"][0] + 24
    text = json.dumps(complex_header).encode()
    path.write_bytes(len(text).to_bytes(8, "little") + text + raw[8 + header_len:])
    f = hf_dir.SafetensorsFile(path)
    assert "f32" in f.tensors and f.read("i64").tolist() == [[0, 1, 2], [3, 4, 5]]
    with pytest.raises(CheckpointError, match="dtype tunix-rt does not read"):
        f.read("f32")


def test_tensors_come_a_stack_at_a_time():
    names = ["model.layers.1.mlp.up_proj.weight", "model.layers.0.mlp.up_proj.weight", "model.norm.weight",
             "model.layers.10.self_attn.q_proj.weight.qs", "model.layers.0.self_attn.q_proj.weight.scales",
             "model.layers.0.self_attn.q_proj.weight.qs", "model.layers.2.mlp.up_proj.weight"]
    assert sorted(names, key=hf_dir._stack_order) == [
        "model.layers.0.mlp.up_proj.weight", "model.layers.1.mlp.up_proj.weight", "model.layers.2.mlp.up_proj.weight",
        "model.layers.0.self_attn.q_proj.weight.qs", "model.layers.0.self_attn.q_proj.weight.scales",
        "model.layers.10.self_attn.q_proj.weight.qs", "model.norm.weight"]
    experts = [f"model.layers.{layer}.mlp.experts.{e}.{p}.weight" for layer in (0, 1) for e in (0, 1)
               for p in ("down_proj", "up_proj")]
    assert sorted(experts, key=hf_dir._stack_order) == [  # each projection's experts of every layer in a row
        f"model.layers.{layer}.mlp.experts.{e}.{p}.weight" for p in ("down_proj", "up_proj") for layer in (0, 1)
        for e in (0, 1)]
