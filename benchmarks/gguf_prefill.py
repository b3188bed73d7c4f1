"""A long prompt's prefill on a Gemma-3-shaped GGUF file: ours beside llama.cpp's on the same file (issue 40).

Usage: python benchmarks/gguf_prefill.py [--prompt 32768] [--window 512] [--chunk 512]
(from a checkout, with the test dependencies and llama-cpp-python installed)

The model: benchmarks/hybrid_kv.py's shape (12 layers, five sliding-window layers of --window to one global,
hidden 256, 4 query heads and 1 KV head of 64) with a 256-token byte vocabulary, random weights made in
transformers and written as llama.cpp's converter writes a Gemma 3 file (f32; the writer the GGUF loader's
tests use). Each side runs in a process of its own on this host's threads and prefills the same random prompt
in chunks of --chunk tokens (our max_num_batched_tokens; llama.cpp's n_batch and n_ubatch); printed: our
start-up (load and warm-up compile), seconds to the first token and prompt tokens/s after it, peak RSS of
each process, the kernel tier, and whether both pick the same greedy first token.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from peer_process import llama_last_logits, peak_rss_gb, run_contender

ROOT = Path(__file__).resolve().parents[1]


def write_model(path: Path, window: int, max_len: int) -> None:
    sys.path.insert(0, str(ROOT))
    from tests.checkpoints.test_gguf_loader import write_gguf
    from tests.models.hf_tiny import make_hf_model

    hf = make_hf_model("gemma3_text", path.parent / "hf", vocab_size=256, hidden_size=256, intermediate_size=1024,
                       num_hidden_layers=12, num_attention_heads=4, num_key_value_heads=1, head_dim=64,
                       query_pre_attn_scalar=64, sliding_window=window, max_position_embeddings=max_len,
                       rope_theta=1_000_000.0, rope_local_base_freq=10_000.0)
    write_gguf(hf, path)


def prompt(n: int) -> list[int]:
    import numpy as np

    return np.random.default_rng(0).integers(3, 256, size=n).tolist()


def run_ours(path: str, n: int, chunk: int) -> dict:
    from tunix_rt.checkpoints.loader import load
    from tunix_rt.engine.engine import Engine
    from tunix_rt.engine.params import SamplingParams
    from tunix_rt.ops._ffi import isa_level

    start = time.perf_counter()
    model, tokenizer = load(path)
    engine = Engine(model, tokenizer, max_model_len=n + 16, max_num_seqs=1, max_num_batched_tokens=chunk,
                    enable_prefix_caching=False)
    engine.warmup(max_rows=1)
    startup = time.perf_counter() - start
    ids = prompt(n)
    start = time.perf_counter()
    rid = engine.add_request(ids, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
    first = None
    while first is None:
        for out in engine.step():
            if out.request_id == rid and out.token_ids:
                first = out.token_ids[0]
    seconds = time.perf_counter() - start
    return dict(startup=startup, seconds=seconds, first=first, rss=peak_rss_gb(), tier=isa_level())


def run_llama_cpp(path: str, n: int, chunk: int) -> dict:
    import numpy as np
    from llama_cpp import Llama

    threads = len(os.sched_getaffinity(0))
    start = time.perf_counter()
    llm = Llama(path, n_ctx=n + 16, n_batch=chunk, n_ubatch=chunk, n_threads=threads, n_threads_batch=threads,
                verbose=False)
    startup = time.perf_counter() - start
    ids = prompt(n)
    start = time.perf_counter()
    llm.eval(ids)
    seconds = time.perf_counter() - start
    return dict(startup=startup, seconds=seconds, first=int(np.argmax(llama_last_logits(llm))), rss=peak_rss_gb())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt", type=int, default=32768)
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--run", choices=("ours", "llama.cpp"), help=argparse.SUPPRESS)  # one side, in its own process
    ap.add_argument("--model", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.run:
        run = run_ours if args.run == "ours" else run_llama_cpp
        print(json.dumps(run(args.model, args.prompt, args.chunk)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "gemma3-shaped.gguf"
        write_model(path, args.window, args.prompt + 16)
        results = {side: run_contender(sys.executable, __file__, ["--run", side, "--model", str(path), "--prompt",
                                                                  str(args.prompt), "--chunk", str(args.chunk)],
                                       len(os.sched_getaffinity(0)))
                   for side in ("ours", "llama.cpp")}
    for side, r in results.items():
        if "error" in r:
            print(f"{side} failed: {r['error']}")
            return
    ours, peer = results["ours"], results["llama.cpp"]
    print(f"Gemma-3-shaped GGUF (12 layers, 5 sliding of {args.window} : 1 global, f32), {args.prompt}-token prompt, "
          f"chunks of {args.chunk} | kernel tier {ours['tier']}")
    print(f"{'':>10} {'start-up s':>10} {'prefill s':>9} {'tok/s':>8} {'peak RSS GB':>11} {'first token':>11}")
    for side, r in results.items():
        print(f"{side:>10} {r['startup']:>10.1f} {r['seconds']:>9.1f} {args.prompt / r['seconds']:>8.0f} "
              f"{r['rss']:>11.2f} {r['first']:>11}")
    print(f"prefill: ours {peer['seconds'] / ours['seconds']:.2f}x llama.cpp's speed; same first token: "
          f"{ours['first'] == peer['first']}")


if __name__ == "__main__":
    main()
