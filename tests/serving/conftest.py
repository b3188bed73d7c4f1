"""One real `tunix-rt serve` process on the default model, shared by the server tests.

It listens on a free loopback port with an API key, a small engine (so compiles stay few), a
bounded queue and body limit small enough for tests to reach, and one CORS origin.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import subprocess
import sys
import time

import httpx2 as httpx
import pytest

from tests.ports import free_port
from tunix_rt.checkpoints.default_model import DefaultModelMissing, default_model_path

API_KEY = "test-key"
MAX_MODEL_LEN = 256
MAX_NUM_SEQS = 4
MAX_WAITING = 4
MAX_BODY_BYTES = 64 * 1024
ORIGIN = "http://allowed.example"


@dataclasses.dataclass(frozen=True)
class Server:
    base_url: str  # http://127.0.0.1:PORT
    api_key: str
    model: str
    health_codes: tuple[int, ...]  # /health answers seen while the server started
    log_path: str
    compiles_at_ready: float  # engine step programs compiled when /health first answered 200

    def client(self, **kw):
        import openai

        return openai.OpenAI(base_url=f"{self.base_url}/v1", api_key=self.api_key, max_retries=0, **kw)

    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"}


@contextlib.contextmanager
def running_server(args: list, log_path: str, env: dict | None = None):
    """`tunix-rt serve --port P <args>` until /health answers 200: yields (base URL, the /health codes seen);
    the process is stopped on exit."""
    port = free_port()
    cmd = [sys.executable, "-m", "tunix_rt.cli", "serve", "--port", str(port), *map(str, args)]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
    base = f"http://127.0.0.1:{port}"
    codes: list[int] = []
    deadline = time.monotonic() + 300
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"the server exited with {proc.returncode}:\n{open(log_path).read()[-4000:]}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the server did not become healthy:\n{open(log_path).read()[-4000:]}")
            try:
                code = httpx.get(f"{base}/health", timeout=5).status_code
                codes.append(code)
                if code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        yield base, tuple(codes)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    try:
        default_model_path()
    except DefaultModelMissing as e:
        pytest.skip(f"the server tests run the default model: {e}")
    log_path = str(tmp_path_factory.mktemp("serve") / "serve.log")
    args = ["--api-key", API_KEY, "--max-model-len", MAX_MODEL_LEN, "--max-num-seqs", MAX_NUM_SEQS,
            "--max-num-batched-tokens", "64", "--max-waiting", MAX_WAITING, "--max-body-bytes", MAX_BODY_BYTES,
            "--allowed-origins", ORIGIN, "--reasoning-parser", "qwen3"]
    # The warm-up compiles every plain step program before /health is ready; a compilation cache shared by the
    # session's servers (one per test worker) lets a second server load them.
    cache = tmp_path_factory.getbasetemp().parent / "serve_jax_cache"
    env = {"JAX_COMPILATION_CACHE_DIR": str(cache), "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
           "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}
    with running_server(args, log_path, env) as (base, codes):
        metrics = httpx.get(f"{base}/metrics", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30).text
        compiles = next(float(line.split()[-1]) for line in metrics.splitlines()
                        if line.startswith("tunix_rt:compiles_total"))
        yield Server(base, API_KEY, "default", codes, log_path, compiles)
