"""Ctrl-C on `tunix-rt serve`, as a terminal sends it: while the model loads and compiles, and once it serves.
Either way the server stops with exit status 130 and one line, no traceback, and no abort from a compile cut
short at exit. A tiny model keeps the warm-up short; its tokenizer is one llguidance cannot read by itself.
Also here: the server's persistent compilation cache (--compile-cache-dir)."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import httpx2 as httpx
import pytest

from tests.models.hf_tiny import make_tiny_model_dir
from tests.ports import free_port
from tests.terminal import python_from_a_terminal

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny") / "model"
    make_tiny_model_dir(path)
    return path


def start(model, port: int, log_path, cache) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_")}  # the server's own cache settings
    with open(log_path, "w") as log:
        return subprocess.Popen(python_from_a_terminal("-u", "-m", "tunix_rt.cli", "serve", "--model", str(model),
                                                       "--port", str(port), "--max-num-seqs", "2",
                                                       "--max-num-batched-tokens", "32", "--compile-cache-dir", str(cache)),
                                stdout=log, stderr=subprocess.STDOUT, env=env)


def wait_for(proc: subprocess.Popen, log_path, ready, what: str) -> None:
    deadline = time.monotonic() + 300
    while not ready():
        assert proc.poll() is None, f"the server exited with {proc.returncode} before {what}:\n{log_path.read_text()}"
        assert time.monotonic() < deadline, f"no {what} in 300 s:\n{log_path.read_text()}"
        time.sleep(0.1)


def interrupt(proc: subprocess.Popen, log_path) -> str:
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = log_path.read_text()
    assert proc.returncode == 130, text
    assert "Traceback" not in text and "terminate called" not in text, text
    assert text.strip().splitlines()[-1] == "tunix-rt serve: interrupted", text
    return text


def test_ctrl_c_while_the_model_compiles(model, tmp_path):
    log_path = tmp_path / "serve.log"
    proc = start(model, free_port(), log_path, tmp_path / "cache")
    wait_for(proc, log_path, lambda: "compiling" in log_path.read_text(), "compile")
    text = interrupt(proc, log_path)
    assert "serving" not in text  # it stopped before it was ready


def test_ctrl_c_once_serving(model, tmp_path):
    log_path, port, cache = tmp_path / "serve.log", free_port(), tmp_path / "cache"
    proc = start(model, port, log_path, cache)

    def healthy() -> bool:
        try:
            return httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200
        except httpx.TransportError:
            return False

    wait_for(proc, log_path, healthy, "/health 200")
    reply = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=60,
                       json={"model": str(model), "prompt": "the", "max_tokens": 2, "temperature": 0})
    assert reply.status_code == 200, reply.text
    interrupt(proc, log_path)
    assert f"compilation cache: {cache}" in log_path.read_text() and any(cache.iterdir())  # the warm-up's programs


def test_the_compile_cache_keeps_a_configured_one_and_turns_off(tmp_path):
    import jax

    from tunix_rt.engine.compile_cache import use_compile_cache

    names = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs")
    saved = {name: jax.config._read(name) for name in names}
    try:
        jax.config.update("jax_compilation_cache_dir", None)
        assert use_compile_cache("") is None and use_compile_cache(None) is None
        assert jax.config.jax_compilation_cache_dir is None
        assert use_compile_cache(str(tmp_path / "made" / "here")) == str(tmp_path / "made" / "here")
        assert (tmp_path / "made" / "here").is_dir() and jax.config.jax_persistent_cache_min_compile_time_secs == 0
        jax.config.update("jax_compilation_cache_dir", str(tmp_path / "users"))  # JAX_COMPILATION_CACHE_DIR's
        assert use_compile_cache(str(tmp_path / "ours")) == str(tmp_path / "users")
        assert not (tmp_path / "ours").exists()
    finally:
        for name, value in saved.items():
            jax.config.update(name, value)
