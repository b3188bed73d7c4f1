"""The hybrid KV-cache manager on a Gemma-3-shaped model: KV bytes held and decode speed, sliding-window blocks
freed (the default) against every layer keeping all its blocks (disable_hybrid_kv_cache_manager), same run.

Usage: python benchmarks/hybrid_kv.py [--cases 1x32768,1x8192,8x8192] [--tokens 32] [--window 512]

The model: Gemma 3's layer pattern (five sliding-window layers of --window to one global layer, twice: 12
layers), random weights at a small width (hidden 256, 4 query heads, 1 KV head of 64, f32), so that a 32K
context fits this host many times over. Per case (streams x context tokens): each stream's random prompt of
that length is prefilled (chunks of 512; the first streams decode meanwhile), then --tokens steps in which
every stream decodes are timed; printed per mode: the prefill's seconds (until every stream has its first
token), decode tokens/s over those steps (the engine's multi-step decode loops, as a user gets them), the most
KV bytes the engine held in them (blocks in use counted per
layer, from its block manager), the KV pool's size and the peak RSS; then the ratio of KV bytes held and
whether the streams' first tokens agree. The kernel tier is printed.
"""

from __future__ import annotations

import argparse
import resource
import time

import numpy as np
from flax import nnx

from tunix_rt.engine.engine import Engine
from tunix_rt.engine.params import SamplingParams
from tunix_rt.engine.runner import ModelRunner
from tunix_rt.models.config import FULL, SLIDING, ModelConfig, RopeConfig
from tunix_rt.models.decoder import Decoder
from tunix_rt.ops._ffi import isa_level


def gemma3_shaped(window: int, max_len: int) -> Decoder:
    cfg = ModelConfig(architecture="gemma3_text", vocab_size=4096, hidden_size=256, intermediate_size=1024, num_layers=12,
                      num_heads=4, num_kv_heads=1, head_dim=64, layer_types=((SLIDING,) * 5 + (FULL,)) * 2,
                      sliding_window=window, max_position_embeddings=max_len,
                      rope=((FULL, RopeConfig(theta=1_000_000.0)), (SLIDING, RopeConfig(theta=10_000.0))),
                      norm_offset=1.0, sandwich_norms=True, qk_norm=True, embed_scale=256**0.5,
                      activation="gelu_tanh", tie_word_embeddings=True)
    return Decoder(cfg, rngs=nnx.Rngs(0))


def run_case(model: Decoder, streams: int, context: int, tokens: int, hybrid: bool) -> dict:
    """The streams' prompts prefill in chunks (the first ones decoding meanwhile); once every stream has its
    first token, --tokens steps in which all of them decode are timed and the KV held is every stream's
    context at once."""
    chunk = 512
    engine = Engine(model, None, max_model_len=context + tokens + 16 + streams * context // chunk,
                    max_num_seqs=streams, max_num_batched_tokens=chunk, kv_cache_memory=16 << 30,
                    disable_hybrid_kv_cache_manager=not hybrid, enable_prefix_caching=False)
    engine.warmup(max_rows=streams)  # what the steps run, compiled before the clock starts
    rng = np.random.default_rng(0)
    params = SamplingParams(temperature=0.0, max_tokens=tokens + 8 + streams * context // chunk, ignore_eos=True)
    ids = [engine.add_request(rng.integers(0, 4096, size=context).tolist(), params) for _ in range(streams)]
    layer_block = ModelRunner.block_bytes(model, engine.kv.block_size, 1)
    start, held, seen, steps, made, decode = time.perf_counter(), 0, {}, 0, 0, 0.0
    prefill = None
    while steps < tokens:
        t = time.perf_counter()
        outs = engine.step()
        for o in outs:
            made += len(o.token_ids) - len(seen.get(o.request_id, ()))
            seen[o.request_id] = o.token_ids
        if prefill is None:
            if len(seen) == streams:  # every prompt computed, its first token out
                prefill, made = time.perf_counter() - start, 0
            continue
        decode += time.perf_counter() - t
        steps += 1
        held = max(held, engine.kv.layer_blocks_in_use() * layer_block)
    for i in ids:
        engine.abort(i)
    return dict(prefill=prefill, tok_s=made / decode, held=held, pool=2 * engine.runner.k.nbytes,
                tokens=[seen[i][:tokens] for i in ids], rss=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="1x32768,1x8192,8x8192")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--window", type=int, default=512)
    args = ap.parse_args()
    cases = [tuple(map(int, c.split("x"))) for c in args.cases.split(",")]
    model = gemma3_shaped(args.window, max(c for _, c in cases) + args.tokens + 16)
    print(f"Gemma-3-shaped: 12 layers (5 sliding of {args.window} : 1 global), kv 1x64 f32 | kernel tier {isa_level()}")
    print(f"{'case':>9} {'mode':>11} {'prefill s':>9} {'decode tok/s':>12} {'KV held MB':>10} {'pool MB':>8} "
          f"{'peak RSS GB':>11}")
    for streams, context in cases:
        results = {}
        for mode, hybrid in (("hybrid", True), ("all-global", False)):
            r = results[mode] = run_case(model, streams, context, args.tokens, hybrid)
            print(f"{streams:>3}x{context:<5} {mode:>11} {r['prefill']:>9.1f} {r['tok_s']:>12.1f} "
                  f"{r['held'] / 1e6:>10.1f} {r['pool'] / 1e6:>8.0f} {r['rss']:>11.2f}")
        h, a = results["hybrid"], results["all-global"]
        print(f"{'':>9} KV held hybrid / all-global {h['held'] / a['held']:.1%}; decode {h['tok_s'] / a['tok_s']:.2f}x; "
              f"same greedy tokens: {h['tokens'] == a['tokens']}")


if __name__ == "__main__":
    main()
