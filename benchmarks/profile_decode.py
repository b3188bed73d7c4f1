"""Where a decode step of the default model goes, per kernel tier: XLA's threads' busy time by op (each FFI op by
its target, XLA's own ops summed, the five largest named) and the host's time between programs.

Usage: python benchmarks/profile_decode.py [--streams 1,8,64] [--steps 6] [--tiers host,avx2,scalar]

Each tier runs in a process of its own (TUNIX_RT_ISA caps the tier the extension dispatches to; a tier above
the host's runs as the host's). In it, `streams` requests of 16-token prompts are prefilled, then `steps`
engine steps of steady decode (each step's program decodes up to 8 tokens per sequence in a loop) run under
jax.profiler. The trace's events on XLA's threads are summed per op name; an FFI call's event is named after its
HLO instruction, which the engine's compiled programs map to its target. Busy time is summed over XLA's
threads, but an FFI op's chunks on the thread pool do not show as events of their own (its one event spans
them), so busy time comes out close to the wall time and the shares compare ops; "host" is the traced wall time in which
none of XLA's threads ran anything (Python, scheduling, sampling bookkeeping, dispatch). The step time comes
from as many steps run just before, untraced. Prints one table per tier and stream count.
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import re
import subprocess
import sys
import tempfile
import time

# events that enclose others or mark points, not ops: left out of the busy time
_WRAPPERS = re.compile(r"^(ThunkExecutor::Execute.*|ThreadpoolListener::.*|end: .*|while(\.\d+)?|conditional(\.\d+)?"
                       r"|call(\.\d+)?)$")
_FFI = re.compile(r'%?([\w.\-]+) = [^\n]*custom-call\([^\n]*custom_call_target="([\w.]+)"')


def _ffi_names(engine) -> dict[str, str]:
    """HLO instruction name -> FFI target, over the engine's compiled programs (a name two programs give to
    different targets maps to both)."""
    names: dict[str, set[str]] = collections.defaultdict(set)
    for key in engine.runner.compiled:
        for name, target in _FFI.findall(engine.runner.program_text(key)):
            names[name].add(target.removeprefix("tunix_rt_"))
    return {name: "/".join(sorted(targets)) for name, targets in names.items()}


def _busy_by_op(trace_dir: str, ffi: dict[str, str]) -> tuple[dict[str, float], float]:
    """(thread-seconds per op on XLA's threads, seconds in which any of XLA's threads ran anything) from the
    trace."""
    from jax.profiler import ProfileData

    [path] = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)
    busy: dict[str, float] = collections.Counter()
    spans = []  # (start, end) of every event on XLA's threads
    for plane in ProfileData.from_file(path).planes:
        for line in plane.lines:
            if not line.name.startswith("tf_XLA"):
                continue
            for event in line.events:
                spans.append((event.start_ns, event.end_ns))
                if _WRAPPERS.match(event.name):
                    continue
                op = ffi.get(event.name)
                busy[f"ffi {op}" if op else f"xla {event.name}"] += event.duration_ns / 1e9
    running, end = 0.0, float("-inf")
    for start, stop in sorted(spans):  # the union of the intervals
        if stop > end:
            running += (stop - max(start, end)) / 1e9
            end = stop
    return busy, running


def run_tier(streams: list[int], steps: int) -> dict:
    import jax
    import numpy as np

    from tunix_rt.checkpoints.loader import load_model
    from tunix_rt.engine.engine import Engine
    from tunix_rt.engine.params import SamplingParams
    from tunix_rt.ops._ffi import isa_level

    loaded = load_model(None)
    new_tokens = 8 * (3 * steps + 3)  # prefill, warm-up, timed and traced steps, each up to 8 tokens a sequence
    engine = Engine(loaded.model, loaded.tokenizer, max_model_len=16 + new_tokens, max_num_seqs=max(streams))
    rng = np.random.default_rng(0)
    report = {"tier": isa_level(), "streams": {}}
    for count in streams:
        prompts = [rng.integers(100, 40_000, size=16).tolist() for _ in range(count)]
        params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
        engine.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))  # compiles
        ids = [engine.add_request(prompt, params) for prompt in prompts]
        prefilled = set()
        while len(prefilled) < count:  # every request has its first token
            prefilled.update(out.request_id for out in engine.step())
        for _ in range(steps // 2):  # warm steady decode
            engine.step()
        before = sum(len(o.token_ids) for o in engine.step())
        start = time.perf_counter()  # timed without the profiler, whose own cost is not the step's
        outs = [engine.step() for _ in range(steps)]
        wall = time.perf_counter() - start
        after = sum(len(o.token_ids) for o in outs[-1])
        options = jax.profiler.ProfileOptions()
        options.python_tracer_level = 0  # XLA's and the host's events only: Python tracing slows every call
        with tempfile.TemporaryDirectory() as trace_dir:
            with jax.profiler.trace(trace_dir, profiler_options=options):
                start = time.perf_counter()  # inside: starting and writing the trace are not the steps'
                traced = [engine.step() for _ in range(steps)]
                traced_wall = time.perf_counter() - start
            busy, running = _busy_by_op(trace_dir, _ffi_names(engine))
        traced_tokens = (sum(len(o.token_ids) for o in traced[-1]) - after) / count
        for request_id in ids:
            engine.abort(request_id)
        per_seq = (after - before) / count  # decode steps timed, one token per sequence each
        report["streams"][count] = dict(
            wall_ms_per_token_step=wall / per_seq * 1e3, tokens_per_s=(after - before) / wall,
            host_ms_per_token_step=(traced_wall - running) / traced_tokens * 1e3,
            busy_ms_per_token_step={op: t / traced_tokens * 1e3 for op, t in busy.most_common()})
    return report


def _table(report: dict) -> str:
    lines = []
    for count, r in report["streams"].items():
        busy = r["busy_ms_per_token_step"]
        total = sum(busy.values())
        host = f"{r['host_ms_per_token_step']:.2f} ms"
        lines.append(f"tier {report['tier']}, {count} streams: {r['wall_ms_per_token_step']:.2f} ms per decode step "
                     f"({r['tokens_per_s']:.0f} tokens/s); host {host}; XLA threads busy {total:.2f} ms")
        ffi = {op: t for op, t in busy.items() if op.startswith("ffi ")}
        xla = {op: t for op, t in busy.items() if op.startswith("xla ")}
        for op, t in sorted(ffi.items(), key=lambda item: -item[1]):
            lines.append(f"    {op[4:]:<40} {t:8.2f} ms  {t / total:6.1%}")
        top = sorted(xla.items(), key=lambda item: -item[1])[:5]
        xla_total = sum(xla.values())
        lines.append(f"    {'XLA ops (' + str(len(xla)) + ')':<40} {xla_total:8.2f} ms  {xla_total / total:6.1%}  largest: "
                     + ", ".join(f"{op[4:]} {t:.2f}" for op, t in top))
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", default="1,8,64")
    ap.add_argument("--steps", type=int, default=6, help="engine steps traced per stream count")
    ap.add_argument("--tiers", default="host,avx2,scalar", help="host (uncapped) and tiers to cap the dispatch to")
    ap.add_argument("--run-tier", help=argparse.SUPPRESS)  # the per-tier child process
    args = ap.parse_args()
    streams = [int(s) for s in args.streams.split(",")]
    if args.run_tier:
        print("REPORT " + json.dumps(run_tier(streams, args.steps)), flush=True)
        return
    seen = set()
    for tier in args.tiers.split(","):
        env = dict(os.environ)
        env.pop("TUNIX_RT_ISA", None)
        if tier != "host":
            env["TUNIX_RT_ISA"] = tier
        proc = subprocess.run([sys.executable, __file__, "--run-tier", tier, "--streams", args.streams, "--steps",
                               str(args.steps)], env=env, capture_output=True, text=True, timeout=3600)
        lines = [line for line in proc.stdout.splitlines() if line.startswith("REPORT ")]
        if proc.returncode or not lines:
            print(f"tier {tier}: failed (exit {proc.returncode})\n{proc.stderr[-2000:]}")
            continue
        report = json.loads(lines[-1][len("REPORT "):])
        if report["tier"] in seen:  # a cap at or above the host's tier: the host's run again
            continue
        seen.add(report["tier"])
        print(_table(report), flush=True)


if __name__ == "__main__":
    main()
