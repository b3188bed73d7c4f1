"""A `tunix-rt serve` process on a free loopback port for the benchmarks that drive the server."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time

import httpx2 as httpx


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(serve_args: list[str], log_prefix: str = "serve-") -> tuple[subprocess.Popen, str]:
    """Start `tunix-rt serve <serve_args>` and wait for /health; returns the process and its base URL. Exits
    with the log's path when the server dies or does not come up in 300 s."""
    port = _free_port()
    log = tempfile.NamedTemporaryFile("w", prefix=log_prefix, suffix=".log", delete=False)
    cmd = [sys.executable, "-m", "tunix_rt.cli", "serve", "--port", str(port), *serve_args]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            sys.exit(f"the server exited ({proc.returncode}); log: {log.name}")
        try:
            if httpx.get(f"{base}/health", timeout=5).status_code == 200:
                print(f"server up on {base} (log {log.name})", file=sys.stderr)
                return proc, base
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    proc.kill()
    sys.exit(f"the server did not come up in 300 s; log: {log.name}")
