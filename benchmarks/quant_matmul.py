"""quant_matmul vs XLA's f32 `x @ w` on the same shapes, in one run; plus achieved weight GB/s.

Usage: python benchmarks/quant_matmul.py [--quick] [--formats q4_0,q8_0,...]
Prints a table: median times (jitted, warmed up), speed-up = f32 time / quant time, and the
weight bytes each op streams per call over its time, next to a bandwidth figure measured here
(a jitted reduction over a 512 MiB array). Timings are never asserted anywhere.
For GEMV rows (M <= 4) a last column repeats the ratio with each op run 16 times back to back inside
one jitted loop (each input depending on the last output), as a model's decode step runs it: no
Python dispatch between calls (measured here: the ~0.1 ms a call spends outside its kernel weighs
on a 0.4 ms GEMV far more than on XLA's 1.6 ms f32 dot).
Path "int8": x quantized to int8 per block on every row, as the engine runs it (int8_rows=None);
"exact": f32 products over dequantized weights, the default past 4 rows (scoring, training).
A second f32 peer, numpy's `x @ w` (its BLAS, OpenBLAS in numpy's wheels, on as many threads as XLA's
pool), stands in for an f32 dot on a lower tier: XLA's dot dispatches on the CPU it finds (xla_cpu_max_isa
does not reach it), while OpenBLAS takes OPENBLAS_CORETYPE, so
`OPENBLAS_CORETYPE=Haswell TUNIX_RT_ISA=avx2 python benchmarks/quant_matmul.py` compares AVX2 with AVX2.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from tunix_rt.ops import quant_matmul, quantize
from tunix_rt.ops._ffi import isa_level

SMOLLM2 = [(576, 576), (576, 192), (576, 1536), (1536, 576), (576, 49152)]


def median_time(fn, *args, repeats: int = 15, min_time: float = 0.2) -> float:
    return paired_medians([(fn, args)], repeats, min_time)[0]


def paired_medians(calls, repeats: int = 21, min_time: float = 0.3) -> list[float]:
    """Median time of each (fn, args), the calls alternating so machine drift hits all alike."""
    for fn, args in calls:
        jax.block_until_ready(fn(*args))
    times = [[] for _ in calls]
    start = time.perf_counter()
    while len(times[0]) < repeats or time.perf_counter() - start < min_time:
        for slot, (fn, args) in zip(times, calls):
            t = time.perf_counter()
            jax.block_until_ready(fn(*args))
            slot.append(time.perf_counter() - t)
        if len(times[0]) >= 200:
            break
    return [statistics.median(t) for t in times]


CHAIN = 16


def chained(op):
    """op run CHAIN times in one jitted loop, each x depending on the previous output."""
    def run(x, w):
        return jax.lax.fori_loop(0, CHAIN, lambda _, x: x + 1e-30 * jnp.sum(op(x, w)), x)
    return jax.jit(run)


def measured_bandwidth() -> float:
    big = jnp.ones((128 * 1024 * 1024,), jnp.float32)  # 512 MiB
    t = median_time(jax.jit(jnp.sum), big, repeats=7)
    return big.nbytes / t / 1e9


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--formats", default="q4_0,q8_0,q4_1,int8,int4")
    ap.add_argument("--quick", action="store_true", help="M in 1, 64 and K=N=4096 only")
    args = ap.parse_args()
    formats = args.formats.split(",")
    ms = (1, 64) if args.quick else (1, 8, 64, 512)
    shapes = [(4096, 4096)] + ([] if args.quick else SMOLLM2)

    bw = measured_bandwidth()
    print(f"quant_matmul vs f32 x @ w | jax {jax.__version__} | {jax.devices()[0]} | kernel tier {isa_level()} | "
          f"measured read bandwidth {bw:.1f} GB/s | numpy's BLAS core type "
          f"{os.environ.get('OPENBLAS_CORETYPE', 'as detected')}")
    print(f"{'M':>5} {'K':>6} {'N':>6} {'fmt':>5} {'path':>5} {'f32 ms':>9} {'quant ms':>9} {'speedup':>8} "
          f"{'f32 GB/s':>9} {'quant GB/s':>10} {'in-graph':>8} {'numpy ms':>9} {'vs numpy':>8}")
    rng = np.random.default_rng(0)
    dot = jax.jit(lambda x, w: x @ w)
    dot_chain = chained(lambda x, w: x @ w)
    int8_chain = chained(functools.partial(quant_matmul, int8_rows=None))
    exact = jax.jit(quant_matmul)  # past 4 rows: exact products
    int8 = jax.jit(functools.partial(quant_matmul, int8_rows=None))
    for k, n in shapes:
        w = jnp.asarray(rng.standard_normal((k, n)), jnp.float32)
        qts = {fmt: quantize(w, fmt) for fmt in formats}
        w_np = np.asarray(w)
        for m in ms:
            x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
            t_np = median_time(np.matmul, np.asarray(x), w_np)
            for fmt in formats:
                paths = [("int8", int8)]
                if m > 4:
                    paths.append(("exact", exact))
                for path, fn in paths:
                    t_f32, t_q = paired_medians([(dot, (x, w)), (fn, (x, qts[fmt]))])
                    in_graph = ""
                    if m <= 4:
                        c_f32, c_q = paired_medians([(dot_chain, (x, w)), (int8_chain, (x, qts[fmt]))], repeats=9)
                        in_graph = f"{c_f32 / c_q:>7.2f}x"
                    print(f"{m:>5} {k:>6} {n:>6} {fmt:>5} {path:>5} {t_f32 * 1e3:>9.3f} {t_q * 1e3:>9.3f} "
                          f"{t_f32 / t_q:>7.2f}x {w.nbytes / t_f32 / 1e9:>9.1f} {qts[fmt].nbytes / t_q / 1e9:>10.1f} "
                          f"{in_graph:>8} {t_np * 1e3:>9.3f} {t_np / t_q:>7.2f}x")


if __name__ == "__main__":
    main()
