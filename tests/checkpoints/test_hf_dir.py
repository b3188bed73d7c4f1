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
