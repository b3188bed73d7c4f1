"""Load test of `tunix-rt serve` on loopback: many concurrent streaming clients, then a disconnect storm.

Starts the server on the default model (or uses --url), runs --requests chat requests from
--clients concurrent streaming clients (the official openai client), and prints a table: failed
requests, time to first token p50/p99, aggregate generated tokens/s, and the server's KV usage and
running/waiting counts afterwards (all must be 0: no leaked blocks). Then --storm clients each drop
their stream after a few chunks, and the pool must again be empty.

    python benchmarks/serve_load.py                 # 64 clients, 500 requests
    python benchmarks/serve_load.py --quick         # 16 clients, 64 requests
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import time

import httpx2 as httpx
import openai
import server_process
from prometheus_client.parser import text_string_to_metric_families

TOPICS = ["the sea", "a library", "mountains", "rain", "a small robot", "bread", "the moon", "trains", "winter",
          "a garden", "music", "chess", "rivers", "coffee", "owls", "bridges"]


def start_server(args) -> tuple[subprocess.Popen, str]:
    return server_process.start(["--max-num-seqs", str(args.max_num_seqs), "--max-waiting", str(args.requests),
                                 "--max-model-len", "512"], log_prefix="serve-load-")


def engine_gauges(base: str) -> dict[str, float]:
    text = httpx.get(f"{base}/metrics", timeout=10).text
    wanted = {"tunix_rt:kv_cache_usage_perc", "tunix_rt:num_requests_running", "tunix_rt:num_requests_waiting",
              "tunix_rt:prefix_cache_hit_rate"}
    return {f.name: f.samples[0].value for f in text_string_to_metric_families(text) if f.name in wanted}


async def one_request(client: openai.AsyncOpenAI, i: int, max_tokens: int, drop_after: int | None):
    """(time to first token, completion tokens) of one streamed chat request; drop_after closes early."""
    start = time.perf_counter()
    ttft, tokens, chunks = None, 0, 0
    stream = await client.chat.completions.create(
        model="default", messages=[{"role": "user", "content": f"Write a short poem about {TOPICS[i % len(TOPICS)]}."}],
        max_tokens=max_tokens, temperature=0.7, seed=i, stream=True, stream_options={"include_usage": True},
        extra_body={"ignore_eos": True})
    try:
        async for chunk in stream:
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
            if chunk.choices and chunk.choices[0].delta.content and ttft is None:
                ttft = time.perf_counter() - start
            chunks += 1
            if drop_after is not None and chunks >= drop_after:
                break
    finally:
        await stream.close()
    return ttft, tokens


async def run_load(base: str, clients: int, requests: int, max_tokens: int, drop_after: int | None = None):
    client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=600)
    queue = iter(range(requests))
    results, failures = [], []

    async def worker():
        for i in queue:
            try:
                results.append(await one_request(client, i, max_tokens, drop_after))
            except Exception as e:  # noqa: BLE001 - counted and reported
                failures.append(f"request {i}: {type(e).__name__}: {e}")

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(clients)))
    wall = time.perf_counter() - start
    await client.close()
    return results, failures, wall


async def settle(base: str, timeout: float = 30.0) -> dict[str, float]:
    """The engine gauges once nothing runs (or after `timeout`)."""
    deadline = time.monotonic() + timeout
    while True:
        gauges = engine_gauges(base)
        idle = gauges["tunix_rt:num_requests_running"] == 0 and gauges["tunix_rt:num_requests_waiting"] == 0
        if idle or time.monotonic() > deadline:
            return gauges
        await asyncio.sleep(0.2)


def pct(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else values[0]


async def main_async(args, base: str) -> int:
    # Warm-up: compile the shapes a loaded server meets, so the table measures serving, not XLA.
    await run_load(base, args.clients, args.clients, args.max_tokens)
    results, failures, wall = await run_load(base, args.clients, args.requests, args.max_tokens)
    after = await settle(base)
    ttfts = [t for t, _ in results if t is not None]
    tokens = sum(n for _, n in results)
    print(f"\n## Load: {args.clients} concurrent streaming clients, {args.requests} requests, "
          f"{args.max_tokens} tokens each (default model, loopback)\n")
    print("| metric | value |\n|---|---|")
    print(f"| failed requests | {len(failures)} |")
    print(f"| TTFT p50 | {pct(ttfts, 50) * 1e3:.0f} ms |")
    print(f"| TTFT p99 | {pct(ttfts, 99) * 1e3:.0f} ms |")
    print(f"| aggregate generation | {tokens / wall:.1f} tok/s ({tokens} tokens in {wall:.1f} s) |")
    print(f"| after: KV usage / running / waiting | {after['tunix_rt:kv_cache_usage_perc']:.3f} / "
          f"{after['tunix_rt:num_requests_running']:.0f} / {after['tunix_rt:num_requests_waiting']:.0f} |")
    print(f"| prefix cache hit rate | {after['tunix_rt:prefix_cache_hit_rate']:.1%} |")
    for line in failures[:5]:
        print(f"  {line}", file=sys.stderr)

    storm_results, storm_failures, storm_wall = await run_load(base, args.storm, args.storm, 200, drop_after=3)
    after_storm = await settle(base)
    print(f"\n## Disconnect storm: {args.storm} clients drop their streams after 3 chunks\n")
    print("| metric | value |\n|---|---|")
    print(f"| client errors | {len(storm_failures)} |")
    print(f"| after: KV usage / running / waiting | {after_storm['tunix_rt:kv_cache_usage_perc']:.3f} / "
          f"{after_storm['tunix_rt:num_requests_running']:.0f} / {after_storm['tunix_rt:num_requests_waiting']:.0f} |")
    leaked = any(after[k] or after_storm[k] for k in ("tunix_rt:kv_cache_usage_perc", "tunix_rt:num_requests_running",
                                                     "tunix_rt:num_requests_waiting"))
    return 1 if failures or storm_failures or leaked else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", help="an already running server (default: start one on the default model)")
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--requests", type=int, default=500)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--storm", type=int, default=64, help="clients in the disconnect storm")
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--quick", action="store_true", help="16 clients, 64 requests, storm of 16")
    args = parser.parse_args()
    if args.quick:
        args.clients, args.requests, args.storm = 16, 64, 16
    proc = None
    base = args.url
    if base is None:
        proc, base = start_server(args)
    try:
        return asyncio.run(main_async(args, base))
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=30)


if __name__ == "__main__":
    sys.exit(main())
