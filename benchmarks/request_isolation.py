"""One client's heavy request must not stall the others: a plain request's latency on an idle server against
its latency while another client's long prompt (2.7K tokens, prompt_logprobs=20) runs, the prompt log-probs
request against a plain prefill of the same length, /health meanwhile, and how fast SIGTERM ends the server
under that load. Run on `tunix-rt serve` with its defaults (the default model), then, as the peer, the same
server with the long-prefill policy off (--long-prefill-token-threshold 0), which is what it did before.

    python benchmarks/request_isolation.py [--model default] [--long-tokens 2700] [--repeats 3]

Prints one table per server (medians, with the server's peak resident memory) and the ratios the hardening
issue asks for: concurrent / idle latency (<= 2x) and prompt log-probs / plain prefill (<= 2x).
"""

from __future__ import annotations

import argparse
import signal
import statistics
import threading
import time

import httpx2 as httpx
import numpy as np
from peer_process import peak_rss_gb
from server_process import start

SHORT = "Write one sentence about the sea."


def _complete(base: str, body: dict, timeout: float = 600) -> tuple[float, dict]:
    start_ = time.perf_counter()
    r = httpx.post(f"{base}/v1/completions", json={"model": "default", **body}, timeout=timeout)
    r.raise_for_status()
    return time.perf_counter() - start_, r.json()


def _plain(base: str) -> float:
    return _complete(base, {"prompt": SHORT, "max_tokens": 16, "temperature": 0})[0]


def _long_prompt(rng: np.random.Generator, n: int, vocab: int) -> list[int]:
    return rng.integers(100, vocab, n).tolist()  # fresh ids each time: no prefix-cache hit


def _wait_for_warm_up(base: str, timeout: float = 600) -> None:
    """Until the server's idle warm-up has compiled every program (tunix_rt:warmup_pending 0): a request sent
    during it waits for the compile in progress, which is not what an idle server's latency is."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = httpx.get(f"{base}/metrics", timeout=30).text
        if any(line.startswith("tunix_rt:warmup_pending") and float(line.split()[-1]) == 0.0
               for line in text.splitlines()):
            return
        time.sleep(1.0)
    raise SystemExit(f"the server was still warming up after {timeout:.0f} s")


def measure(serve_args: list[str], args) -> dict:
    proc, base = start(["--model", args.model, *serve_args, "--metrics-without-auth"], log_prefix="isolation-")
    _wait_for_warm_up(base)
    time.sleep(args.settle)
    try:
        vocab = httpx.get(f"{base}/tokenizer_info", timeout=30).json().get("vocab_size", 49152)
        rng = np.random.default_rng(0)
        for _ in range(2):  # warm: every program a plain and a scored request use
            _plain(base)
            _complete(base, {"prompt": _long_prompt(rng, 300, vocab), "max_tokens": 1, "prompt_logprobs": 20})
        idle = statistics.median(_plain(base) for _ in range(args.repeats * 3))
        prefill = statistics.median(_complete(base, {"prompt": _long_prompt(rng, args.long_tokens, vocab),
                                                     "max_tokens": 1})[0] for _ in range(args.repeats))
        scored = statistics.median(_complete(base, {"prompt": _long_prompt(rng, args.long_tokens, vocab),
                                                    "max_tokens": 1, "prompt_logprobs": 20})[0]
                                   for _ in range(args.repeats))
        # plain requests, one after another, while a scored long prompt runs
        under, health = [], []
        for _ in range(args.repeats):
            done = threading.Event()
            thread = threading.Thread(target=lambda: (_complete(base, {
                "prompt": _long_prompt(rng, args.long_tokens, vocab), "max_tokens": 1, "prompt_logprobs": 20}),
                done.set()))
            thread.start()
            time.sleep(0.5)
            while not done.is_set():
                under.append(_plain(base))
                t = time.perf_counter()
                httpx.get(f"{base}/health", timeout=30)
                health.append(time.perf_counter() - t)
            thread.join()
        # SIGTERM while a scored long prompt runs
        thread = threading.Thread(target=lambda: _complete_quietly(base, rng, args, vocab), daemon=True)
        thread.start()
        time.sleep(1.0)
        rss = peak_rss_gb(proc.pid)
        t = time.perf_counter()
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
            sigterm = time.perf_counter() - t
        except Exception:  # noqa: BLE001 - it did not end in a minute
            sigterm = float("inf")
        return dict(idle=idle, prefill=prefill, scored=scored, under=statistics.median(under),
                    under_mean=statistics.fmean(under), under_max=max(under),
                    n_under=len(under), health=max(health), sigterm=sigterm, rss=rss)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _complete_quietly(base, rng, args, vocab):
    try:
        _complete(base, {"prompt": _long_prompt(rng, args.long_tokens, vocab), "max_tokens": 1,
                         "prompt_logprobs": 20})
    except Exception:  # noqa: BLE001 - the server is being stopped under it
        pass


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--long-tokens", type=int, default=2700)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--settle", type=float, default=5.0,
                    help="seconds to wait, after the server's idle warm-up is done, before measuring")
    ap.add_argument("--thresholds", default="", help="also run with these --long-prefill-token-threshold values "
                                                      "(comma-separated)")
    args = ap.parse_args()
    runs = {"tunix-rt serve (defaults)": measure([], args)}
    for t in filter(None, args.thresholds.split(",")):
        runs[f"--long-prefill-token-threshold {t}"] = measure(["--long-prefill-token-threshold", t], args)
    runs["peer: long-prefill policy off"] = measure(["--long-prefill-token-threshold", "0"], args)
    print(f"\n{args.long_tokens}-token prompt with prompt_logprobs=20 beside plain 16-token completions "
          f"(medians of {args.repeats}+)")
    print(f"{'server':34s} {'idle s':>7s} {'under s':>8s} {'mean s':>7s} {'max s':>6s} {'ratio':>6s} {'prefill s':>9s} "
          f"{'scored s':>8s} {'ratio':>6s} {'/health':>8s} {'SIGTERM':>8s} {'peak RSS':>9s}")
    for name, m in runs.items():
        print(f"{name:34s} {m['idle']:7.3f} {m['under']:8.3f} {m['under_mean']:7.3f} {m['under_max']:6.2f} "
              f"{m['under'] / m['idle']:5.2f}x "
              f"{m['prefill']:9.2f} {m['scored']:8.2f} {m['scored'] / m['prefill']:5.2f}x {m['health']:7.3f}s "
              f"{m['sigterm']:7.2f}s {m['rss']:7.2f} GB")


if __name__ == "__main__":
    main()
