"""Long prompts: paged attention's cost per query at long context, and one long prompt's chunked prefill.

Usage: python benchmarks/long_context.py [--contexts 1024,4096,16384,32768] [--prompt 32768] [--chunk 512]
                                         [--parts op,prefill]

op: 8 decode queries (one per sequence) over a context of C tokens each, in the default model's attention shape
(9 query heads, 3 KV heads, head_dim 64, f32 cache, blocks of 16), through the compiled op and through its
pure-JAX reference (which gathers each query's whole block-table row); per query: time, the K and V bytes it has
to read, and the rate it reads them at, beside this host's read bandwidth (XLA's max over 256 MB on all its
threads): the bound a decode query at long context approaches.
prefill: the default model prefills one prompt of --prompt random tokens through the engine in chunks of
--chunk tokens (max_num_batched_tokens): each chunk's time as the context grows, the whole prompt's tokens/s,
and the process's peak RSS against the KV pool's size (bounded memory: the pool, the weights and one chunk's
activations, whatever the prompt's length).
Medians of 5 (op) and the median chunk of each eighth of the prompt (prefill); 2 threads as the host gives them.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from tunix_rt.ops._ffi import isa_level
from tunix_rt.ops.paged_attention import paged_attention, paged_attention_reference

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16
QUERIES = 8


def _rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6


def memory_bandwidth() -> float:
    """Bytes per second read by XLA's max over 256 MB of f32 on this host's threads (median of 5): the rate a
    kernel that only reads memory approaches."""
    x = jnp.ones(64 << 20, jnp.float32)
    read = jax.jit(jnp.max)
    return x.nbytes / _median_seconds(read, x)


def _median_seconds(fn, *args, repeats: int = 5) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def op_rows(contexts: list[int], bandwidth: float) -> None:
    print(f"paged attention, {QUERIES} decode queries ({HEADS} heads, {KV_HEADS} KV heads, head_dim {HEAD_DIM}, f32 "
          f"cache, blocks of {BLOCK}); read bandwidth {bandwidth / 1e9:.1f} GB/s (XLA's max over 256 MB)")
    print(f"{'context':>8}{'op us/query':>14}{'reference':>12}{'op/ref':>8}{'KV MB/query':>13}{'op GB/s':>9}"
          f"{'of bound':>10}", flush=True)
    rng = np.random.default_rng(0)
    for context in contexts:
        per_seq = -(-context // BLOCK)
        blocks = QUERIES * per_seq + 1  # block 0 left unused
        k = jnp.asarray(rng.standard_normal((blocks, BLOCK, KV_HEADS, HEAD_DIM), np.float32))
        v = jnp.asarray(rng.standard_normal((blocks, BLOCK, KV_HEADS, HEAD_DIM), np.float32))
        tables = jnp.asarray(1 + np.arange(QUERIES * per_seq, dtype=np.int32).reshape(QUERIES, per_seq))
        q = jnp.asarray(rng.standard_normal((QUERIES, HEADS, HEAD_DIM), np.float32))
        seq = jnp.arange(QUERIES, dtype=jnp.int32)
        pos = jnp.full((QUERIES,), context - 1, jnp.int32)
        kw = dict(scale=HEAD_DIM**-0.5)
        op = jax.jit(lambda *a: paged_attention(*a, **kw))
        ref = jax.jit(lambda *a: paged_attention_reference(*a, **kw))
        args = (q, k, v, tables, seq, pos)
        np.testing.assert_allclose(np.asarray(op(*args)), np.asarray(ref(*args)), rtol=2e-4, atol=2e-5)
        t_op, t_ref = _median_seconds(op, *args) / QUERIES, _median_seconds(ref, *args) / QUERIES
        kv_bytes = 2 * context * KV_HEADS * HEAD_DIM * 4
        rate = kv_bytes / t_op
        print(f"{context:>8}{t_op * 1e6:>14.0f}{t_ref * 1e6:>12.0f}{t_ref / t_op:>7.1f}x{kv_bytes / 1e6:>13.2f}"
              f"{rate / 1e9:>9.1f}{rate / bandwidth:>9.0%}", flush=True)
        del k, v


def prefill_rows(prompt_len: int, chunk: int) -> None:
    from tunix_rt.checkpoints.loader import load_model
    from tunix_rt.engine.engine import Engine
    from tunix_rt.engine.params import SamplingParams

    loaded = load_model("default")
    model = loaded.model
    engine = Engine(model, loaded.tokenizer, max_model_len=prompt_len + 1, max_num_seqs=1,
                    max_num_batched_tokens=chunk, token_buckets=(chunk,), num_kv_blocks=-(-(prompt_len + 1) // 16))
    pool_gb = 2 * engine.runner.k.nbytes / 1e9
    prompt = np.random.default_rng(1).integers(100, model.config.vocab_size - 100, prompt_len).tolist()
    engine.generate([prompt[:chunk]], SamplingParams(max_tokens=1, temperature=0.0))  # compile the chunk's programs
    engine.reset_prefix_cache()
    rss_before = _rss_gb()
    engine.add_request(prompt, SamplingParams(max_tokens=1, temperature=0.0))
    steps = []  # (context after the step, seconds)
    start = time.perf_counter()
    done = 0
    while engine.has_unfinished_requests():
        t0 = time.perf_counter()
        engine.step()
        steps.append((min(prompt_len, (len(steps) + 1) * chunk), time.perf_counter() - t0))
        done = steps[-1][0]
    total = time.perf_counter() - start
    print(f"\nprefill of one {prompt_len}-token prompt, default model (max_position_embeddings "
          f"{model.config.max_position_embeddings}; positions past it extrapolate, which changes no cost), chunks of "
          f"{chunk}: {total:.1f} s = {prompt_len / total:.0f} tok/s; KV pool {pool_gb:.2f} GB; peak RSS "
          f"{rss_before:.2f} GB before the prompt, {_rss_gb():.2f} GB after")
    print(f"{'context':>8}{'s/chunk':>10}{'tok/s':>9}", flush=True)
    eighth = max(1, len(steps) // 8)
    for i in range(0, len(steps), eighth):
        part = steps[i:i + eighth]
        seconds = statistics.median(s for _, s in part)
        print(f"{part[-1][0]:>8}{seconds:>10.3f}{chunk / seconds:>9.0f}", flush=True)
    assert done == prompt_len


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", default="1024,4096,16384,32768")
    ap.add_argument("--prompt", type=int, default=32768)
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--parts", default="op,prefill")
    args = ap.parse_args()
    parts = set(args.parts.split(","))
    print(f"kernel tier {isa_level()}, {jax.device_count()} device(s)", flush=True)
    if "op" in parts:
        op_rows([int(c) for c in args.contexts.split(",")], memory_bandwidth())
    if "prefill" in parts:
        prefill_rows(args.prompt, args.chunk)


if __name__ == "__main__":
    main()
