"""Rollout engine speed on the default model, side by side with its peers, in one run.

Usage: python benchmarks/engine.py [--tokens 64] [--repeats 3] [--quick]

Prints tokens/s (medians over repeats, compilation excluded by a warm-up pass; the engine, the reference and
llama.cpp's runs of a row alternate, so the host's drift weighs on them alike) for:
  decode at 1, 8, 32 and 64 concurrent streams, and prefill of a 512-token prompt, on
  - the engine (paged KV cache, continuous batching),
  - the reference generator (dense KV cache, one static batch),
  - llama.cpp through llama-cpp-python (2 threads, same GGUF) when it is installed (one stream), and
    llama.cpp's own batched decode at the same stream counts with --batched-bench PATH (its
    llama-batched-bench binary, built from the llama.cpp sources llama-cpp-python vendors: cmake -S
    vendor/llama.cpp -B build && cmake --build build --target llama-batched-bench);
then the prefix-cache hit rate for n=8 samples of one 400-token prompt and the number of programs
compiled while serving 200 requests of varied lengths after warm-up.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import time

import jax
import numpy as np
from peer_process import llama_last_logits

from tunix_rt.checkpoints.default_model import default_model_path
from tunix_rt.checkpoints.loader import load_model
from tunix_rt.engine.engine import Engine
from tunix_rt.engine.params import SamplingParams
from tunix_rt.engine.reference_generator import GenerationConfig, generate
from tunix_rt.ops._ffi import int8_matmul_kernels, isa_level

PREFILL_LEN = 512


def paired_rates(fns, repeats: int) -> list[float]:
    """Each fn() -> (tokens, seconds); the median tokens/s of each over `repeats` rounds after one warm-up round,
    the calls alternating within a round so that the host's drift (a shared machine's runs vary by 20 % and more
    from minute to minute) weighs on every column alike."""
    for fn in fns:
        fn()
    rates = [[] for _ in fns]
    for _ in range(repeats):
        for slot, fn in zip(rates, fns):
            tokens, seconds = fn()
            slot.append(tokens / seconds)
    return [statistics.median(r) for r in rates]


def prompts_for(vocab: int, count: int, length: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(100, vocab, size=length).tolist() for _ in range(count)]


def engine_decode(engine: Engine, streams: int, tokens: int, seed: int):
    """Decode tokens/s of `streams` concurrent requests, timed once every one has its first token."""
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    for p in prompts_for(engine.model.config.vocab_size, streams, 16, seed):
        engine.add_request(p, params)
    started = set()
    while len(started) < streams:
        started.update(out.request_id for out in engine.step())
    start, generated = time.perf_counter(), 0
    while engine.has_unfinished_requests():  # a multi-step decode brings several tokens per output
        generated += sum(len(out.delta_token_ids) for out in engine.step())
    return generated, time.perf_counter() - start


def engine_prefill(engine: Engine, seed: int):
    (prompt,) = prompts_for(engine.model.config.vocab_size, 1, PREFILL_LEN, seed)
    engine.reset_prefix_cache()
    start = time.perf_counter()
    engine.generate([prompt], SamplingParams(temperature=0, max_tokens=1))
    return PREFILL_LEN, time.perf_counter() - start


def reference_decode(model, streams: int, tokens: int, seed: int):
    prompts = prompts_for(model.config.vocab_size, streams, 16, seed)
    config = GenerationConfig(max_tokens=tokens)
    start = time.perf_counter()
    generate(model, prompts, GenerationConfig(max_tokens=1))
    prefill = time.perf_counter() - start
    start = time.perf_counter()
    generate(model, prompts, config)
    return streams * (tokens - 1), time.perf_counter() - start - prefill


def reference_prefill(model, seed: int):
    prompts = prompts_for(model.config.vocab_size, 1, PREFILL_LEN, seed)
    start = time.perf_counter()
    generate(model, prompts, GenerationConfig(max_tokens=1))
    return PREFILL_LEN, time.perf_counter() - start


def llama_cpp_runs(tokens: int, vocab: int):
    """llama.cpp's (decode, prefill) runs on the default model's GGUF, each -> (tokens, seconds); None when
    llama-cpp-python is not installed."""
    try:
        from llama_cpp import Llama
    except ImportError:
        return None
    llm = Llama(str(default_model_path()), n_threads=2, n_threads_batch=2, n_ctx=2048, n_batch=PREFILL_LEN,
                verbose=False)

    def decode():
        llm.reset()
        llm.eval(prompts_for(vocab, 1, 16, 0)[0])
        start = time.perf_counter()
        for _ in range(tokens):
            llm.eval([int(np.argmax(llama_last_logits(llm)))])
        return tokens, time.perf_counter() - start

    def prefill():
        llm.reset()
        (prompt,) = prompts_for(vocab, 1, PREFILL_LEN, 1)
        start = time.perf_counter()
        llm.eval(prompt)
        return PREFILL_LEN, time.perf_counter() - start

    return decode, prefill


def batched_bench_rates(binary: str, streams: tuple[int, ...], tokens: int) -> dict[int, float]:
    """llama.cpp's aggregate decode tokens/s at each stream count (llama-batched-bench: 16-token prompts, `tokens`
    generated per stream, 2 threads, the default model's GGUF)."""
    proc = subprocess.run([binary, "-m", str(default_model_path()), "-c", str(max(streams) * (16 + tokens) + 64),
                           "-b", str(PREFILL_LEN), "-ub", str(PREFILL_LEN), "-npp", "16", "-ntg", str(tokens),
                           "-npl", ",".join(map(str, streams)), "-t", "2", "-tb", "2", "--output-format", "jsonl"],
                          capture_output=True, text=True, timeout=1800, check=True)
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    return {int(r["pl"]): float(r["speed_tg"]) for r in rows}


def peak_rss_gb(who: int) -> float:
    """Peak resident memory of this process (RUSAGE_SELF) or of its largest finished child, in GB (Linux: KiB)."""
    return resource.getrusage(who).ru_maxrss / 1024**2


def shared_prompt_hit_rate(engine: Engine) -> float:
    engine.reset_prefix_cache()
    before = engine.stats()
    (prompt,) = prompts_for(engine.model.config.vocab_size, 1, 400, 7)
    engine.generate([prompt], SamplingParams(n=8, temperature=1.0, seed=0, max_tokens=8))
    after = engine.stats()
    return (after.prefix_cache_hits - before.prefix_cache_hits) / (after.prefix_cache_queries - before.prefix_cache_queries)


def recompiles_after_warmup(engine: Engine, requests: int) -> tuple[int, int]:
    """Programs compiled by jax while serving `requests` mixed requests, after engine.warmup() and the same
    mix once."""
    compiles = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda name, *_, **__: compiles.append(name) if "backend_compile" in name else None)

    def serve(seed):
        rng = np.random.default_rng(seed)
        for i in range(requests):
            length = int(rng.integers(1, 300))
            engine.add_request(prompts_for(engine.model.config.vocab_size, 1, length, seed * 1000 + i)[0],
                               SamplingParams(temperature=float(rng.choice([0.0, 0.8])), seed=i,
                                              max_tokens=int(rng.integers(1, 33)), ignore_eos=True))
            if i % 3 == 0:
                engine.step()
        while engine.has_unfinished_requests():
            engine.step()

    # Warm every token bucket the mix can reach, then serve a fresh mix and count.
    engine.warmup()
    serve(1)
    warm = len(compiles)
    serve(2)
    return warm, len(compiles) - warm


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="1 and 8 streams only, 1 repeat, 50 mixed requests")
    ap.add_argument("--batched-bench", metavar="PATH", help="llama.cpp's llama-batched-bench binary")
    args = ap.parse_args()
    streams = (1, 8) if args.quick else (1, 8, 32, 64)
    repeats = 1 if args.quick else args.repeats
    loaded = load_model("default")
    model, vocab = loaded.model, loaded.model.config.vocab_size
    engine = Engine(model, loaded.tokenizer, max_num_seqs=64, max_num_batched_tokens=512, max_model_len=1024)
    int8 = int8_matmul_kernels() or {"gemv": "none", "gemm": "none"}
    print(f"default model (SmolLM2-135M-Instruct Q4_1), kernel tier {isa_level()} (int8 GEMV {int8['gemv']}, "
          f"GEMM {int8['gemm']}), {jax.device_count()} device(s), medians of {repeats}")

    llama = llama_cpp_runs(args.tokens, vocab)
    ll_decode = None
    print(f"{'':<28}{'engine tok/s':>14}{'reference':>12}{'llama.cpp':>12}{'eng/ref':>9}{'eng/llama':>11}", flush=True)

    def row(label, e, r, ll=None):
        print(f"{label:<28}{e:>14.1f}{r:>12.1f}{(f'{ll:.1f}' if ll else 'n/a'):>12}{e / r:>8.2f}x"
              f"{(f'{e / ll:.2f}x' if ll else 'n/a'):>11}", flush=True)

    decode = {}
    for s in streams:
        peer = [llama[0]] if llama and s == 1 else []
        decode[s], r, *ll = paired_rates([lambda: engine_decode(engine, s, args.tokens, s),
                                          lambda: reference_decode(model, s, args.tokens, s), *peer], repeats)
        if s == 1:
            ll_decode = ll[0] if ll else None
        row(f"decode, {s} stream{'s' if s > 1 else ''}", decode[s], r, ll_decode if s == 1 else None)
    e, r, *ll = paired_rates([lambda: engine_prefill(engine, 3), lambda: reference_prefill(model, 3),
                              *([llama[1]] if llama else [])], repeats)
    row(f"prefill, {PREFILL_LEN}-token prompt", e, r, ll[0] if ll else None)
    for s in streams[1:]:
        print(f"  aggregate decode, {s} streams: {decode[s] / decode[1]:.2f}x single-stream"
              + (f", {decode[s] / ll_decode:.2f}x one llama.cpp stream" if ll_decode else ""))
    if args.batched_bench:
        for s, rate in batched_bench_rates(args.batched_bench, streams, args.tokens).items():
            print(f"  llama.cpp batched decode, {s} stream{'s' if s > 1 else ''}: {rate:.1f} tok/s; ours "
                  f"{decode[s] / rate:.2f}x" + (f", {decode[s] / ll_decode:.2f}x one llama.cpp stream" if ll_decode else ""))
    if ll_decode is None:
        print("llama.cpp: not installed (pip install llama-cpp-python) - no peer column")
    print(f"peak RSS: this process (engine, reference and llama-cpp-python) {peak_rss_gb(resource.RUSAGE_SELF):.2f} GB"
          + (f", llama-batched-bench {peak_rss_gb(resource.RUSAGE_CHILDREN):.2f} GB" if args.batched_bench else ""))
    print(f"n=8 samples of one 400-token prompt: prefix-cache hit rate {shared_prompt_hit_rate(engine):.1%} "
          f"(7/8 of the prompt, block-rounded, is the most possible)")
    warm, after = recompiles_after_warmup(engine, 50 if args.quick else 200)
    print(f"compiles: {warm} during the warm-up mix, {after} while serving {50 if args.quick else 200} more "
          f"requests of varied lengths")


if __name__ == "__main__":
    main()
