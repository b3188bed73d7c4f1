"""Benchmark: the fused RMSNorm FFI op vs the pure-JAX reference (XLA-fused), both jitted.

    python benchmarks/rms_norm.py [--repeats N] [--min-time S] [--shapes 64x576,2048x576]

For each shape and dtype it times the forward pass and forward+backward (jax.vjp: y, dx, dw) of
`rms_norm` and `rms_norm_reference`, measured in the same run: warm-up calls first (compile), then
the median wall time of N calls, each ended by block_until_ready, timed with time.perf_counter.
ratio = reference / ffi, so > 1 means the FFI op is faster. No assertions: it only reports.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from tunix_rt.ops import _ffi, rms_norm, rms_norm_reference

DEFAULT_SHAPES = ((1, 576), (64, 576), (2048, 576), (8192, 2048))
EPS = 1e-6


def _fwd(fn):
    return jax.jit(lambda x, w: fn(x, w, eps=EPS))


def _fwd_bwd(fn):
    def f(x, w, dy):
        y, pull = jax.vjp(lambda x, w: fn(x, w, eps=EPS), x, w)
        dx, dw = pull(dy)
        return y, dx, dw

    return jax.jit(f)


def _median_seconds(f, args, repeats: int, min_time: float, warmup: int = 3) -> float:
    for _ in range(warmup):
        jax.block_until_ready(f(*args))
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < repeats or (time.perf_counter() - start < min_time and len(times) < 50 * repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(f(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _fmt_us(seconds: float) -> str:
    us = seconds * 1e6
    return f"{us:10.1f}" if us < 1e5 else f"{us:10.0f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20, help="at least this many timed calls")
    parser.add_argument("--min-time", type=float, default=0.3, help="keep timing until this many seconds")
    parser.add_argument("--shapes", type=str, default=None, help="comma-separated RxD, e.g. 64x576,2048x576")
    parser.add_argument("--dtypes", type=str, default="float32,bfloat16")
    args = parser.parse_args()

    shapes = (
        [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")] if args.shapes else DEFAULT_SHAPES
    )
    dtypes = [jnp.dtype(d) for d in args.dtypes.split(",")]
    cpu = jax.devices("cpu")[0]

    print("rms_norm benchmark: FFI op vs pure-JAX reference (both jax.jit), median wall time")
    print(
        f"jax {jax.__version__} | backend {jax.default_backend()} | device {cpu.device_kind} | "
        f"isa_level {_ffi.isa_level()} | cpus {os.cpu_count()} | "
        f"TUNIX_RT_ISA={os.environ.get('TUNIX_RT_ISA', '(unset)')} | "
        f"ffi registered: {_ffi.has_cpu_target('tunix_rt_rms_norm_fwd')}"
    )
    print(f"repeats >= {args.repeats}, min time {args.min_time}s per measurement; ratio = reference / ffi")
    print()
    header = f"{'shape':>12} {'dtype':>9} {'pass':>8} {'ffi (us)':>10} {'ref (us)':>10} {'ratio':>7}"
    print(header)
    print("-" * len(header))

    rng = np.random.default_rng(0)
    with jax.default_device(cpu):
        for shape in shapes:
            for dt in dtypes:
                x = jnp.asarray(rng.standard_normal(shape), dt)
                w = jnp.asarray(rng.standard_normal(shape[-1:]) * 0.1 + 1.0, dt)
                dy = jnp.asarray(rng.standard_normal(shape), dt)
                for name, build, inputs in (("fwd", _fwd, (x, w)), ("fwd+bwd", _fwd_bwd, (x, w, dy))):
                    t_ffi = _median_seconds(build(rms_norm), inputs, args.repeats, args.min_time)
                    t_ref = _median_seconds(build(rms_norm_reference), inputs, args.repeats, args.min_time)
                    shape_s = "x".join(str(s) for s in shape)
                    print(
                        f"{shape_s:>12} {dt.name:>9} {name:>8} {_fmt_us(t_ffi)} {_fmt_us(t_ref)} "
                        f"{t_ref / t_ffi:7.2f}",
                        flush=True,
                    )


if __name__ == "__main__":
    main()
