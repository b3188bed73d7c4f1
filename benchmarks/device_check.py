"""The accelerator check, sized for a short lease on one GPU: kernels, engine and training on the device.

Usage (from a checkout, the extension not needed): python benchmarks/device_check.py --out report.json

Writes one JSON report (and prints it part by part), each part in its own subprocess with a time limit, so a
part that fails or hangs is recorded and the rest still run:
  kernels   the Pallas paged-attention kernel against its pure-JAX reference on the device: max error over
            head dims 64/128/256 x GQA 1/4/8 (window and softcap on some), f32 and bf16, decode and mixed
            steps.
  attention the kernel's time per step against the reference (GQA 4, head dim 128, bf16): decode of 64
            sequences x 2K, 4 x 32K and 1 x 32K tokens, a 512-token prefill chunk over 2K; its own launch
            shape and a sweep of blocks per loop step x key splits.
  train_attention
            the Pallas flash-attention kernels of training against the dense reference: max relative error of
            the output and dq, dk, dv, and the time of the forward and of forward + backward, bf16 (f32 on one),
            plain causal rows and packed ones, at the 135M, 1B and a head-dim-256 shape; a sweep of rows per
            tile on each shape's bf16 causal rows.
  moe       MoE's grouped matmul: the Pallas kernels against the reference (XLA's ragged_dot) and a dense
            matmul of the same rows, forward and forward + backward, at a Qwen3-30B-A3B-like expert layer.
  quant     the Pallas quantized-matmul kernel against its reference (dequantize, then XLA's dot) on the
            device: max error for every format and group, f32 and bf16, 1 to 100 rows; and the time of a
            Llama-1B-shaped projection (K 2048, N 8192; q4_1 and q8_0, bf16 and f32) at 1, 16 and 512 rows,
            with the packed weight's bytes per second (quant_matmul runs the kernel for bf16 x only; the
            f32 rows say whether f32 should).
  engine    per model (bf16) and kernel mode (native: the Pallas kernels; reference: the pure-JAX references):
            load time, the first generate's time (its compiles), decode tokens/s at 1 and 16 streams,
            prefill tokens/s of a 512-token prompt, and the greedy tokens of fixed prompts (compared across
            the two modes).
  train     per model and kernel mode: one LoRA SFT step and one GRPO step in bf16 compute (2 steps each: the
            first compiles), their losses.
Models: SmolLM2-135M-shaped (the default model's shape; its GGUF is too large to carry to the device)
and Llama-3.2-1B-shaped, random bf16 weights written here as HF directories with a tiny tokenizer; the engine
also runs each quantized to q4_1 (`tunix-rt quantize`), the kind of weight the default model has.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SMOLLM2_135M = dict(model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=49_152, hidden_size=576,
                    intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                    head_dim=64, rms_norm_eps=1e-5, rope_theta=100_000.0, tie_word_embeddings=True,
                    max_position_embeddings=8192, hidden_act="silu")
MODELS = {"smollm2-135m-shape": SMOLLM2_135M}


def _llama_1b() -> dict:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from train_1b import LLAMA_3_2_1B

    return LLAMA_3_2_1B


def write_model(config: dict, directory: Path) -> Path:
    """An HF directory: config.json, random bf16 safetensors (startup.write_random_weights), the tests' tiny
    tokenizer."""
    from startup import write_random_weights

    from tests.models.hf_tiny import write_tiny_tokenizer

    write_tiny_tokenizer(write_random_weights(config, directory))
    return directory


def _max_rel_err(names, got, want) -> dict:
    """name -> max |got - want| over max |want| (each an array made f32 on the host)."""
    import numpy as np

    f32 = [[np.asarray(x, np.float32) for x in arrays] for arrays in (got, want)]
    return {n: float(np.abs(a - e).max() / max(np.abs(e).max(), 1e-6)) for n, a, e in zip(names, *f32)}


def _median_seconds(fn, repeats: int = 5) -> float:
    import jax

    jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return statistics.median(times)


# --- parts (each runs in its own subprocess: device_check.py --part NAME ...) ------------------------------------


def part_kernels() -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from tests.ops.test_paged_attention import build_case, dense_oracle
    from tunix_rt.ops.paged_attention import paged_attention_reference
    from tunix_rt.ops.paged_attention_pallas import paged_attention_pallas

    static = ("scale", "softcap", "window")
    kernel = jax.jit(paged_attention_pallas, static_argnames=static)
    reference = jax.jit(paged_attention_reference, static_argnames=static)
    cases = []
    for d in (64, 128, 256):
        for group in (1, 4, 8):
            for mode in ("decode", "mixed"):
                windowed = group != 4
                case = build_case(np.random.default_rng(d + group), bs=16, d=d, kv=2, group=group, nseq=4,
                                  max_blocks=8, mode=mode, n_pad=2, window=40 if windowed else None,
                                  softcap=30.0 if windowed else None, max_chunk=16)
                for dtype in (jnp.float32, jnp.bfloat16):
                    args = case.arrays(dtype, dtype)
                    out = np.asarray(kernel(*args, **case.kw).astype(jnp.float32))
                    ref = np.asarray(reference(*args, **case.kw).astype(jnp.float32))
                    exact = dense_oracle(*args, **case.kw)  # float64 on the host
                    cases.append(dict(d=d, group=group, mode=mode, dtype=jnp.dtype(dtype).name, window=case.window,
                                      kernel_vs_reference=float(np.abs(out - ref).max()),
                                      kernel_vs_f64=float(np.abs(out - exact).max()),
                                      reference_vs_f64=float(np.abs(ref - exact).max()), max_abs=float(np.abs(exact).max())))
    worst = {f"{dt}/{key}": max(c[key] for c in cases if c["dtype"] == dt)
             for dt in ("float32", "bfloat16") for key in ("kernel_vs_reference", "kernel_vs_f64", "reference_vs_f64")}
    return dict(cases=cases, worst_abs_err=worst)


def _attention_step(rng, seqs: int, context: int, chunk: int, *, bs=16, kv=8, group=4, d=128):
    """One engine step over `seqs` sequences of `context` tokens each (their blocks shuffled over the pool), the
    last `chunk` positions of each as queries (1: decode; more: a chunked-prefill step), bf16."""
    import jax.numpy as jnp

    per_seq = context // bs
    kc = jnp.asarray(rng.standard_normal((seqs * per_seq, bs, kv, d)), jnp.bfloat16)
    vc = jnp.asarray(rng.standard_normal((seqs * per_seq, bs, kv, d)), jnp.bfloat16)
    tables = jnp.asarray(rng.permutation(seqs * per_seq).reshape(seqs, per_seq), jnp.int32)
    q = jnp.asarray(rng.standard_normal((seqs * chunk, kv * group, d)), jnp.bfloat16)
    token_seq = jnp.repeat(jnp.arange(seqs, dtype=jnp.int32), chunk)
    token_pos = jnp.tile(jnp.arange(context - chunk, context, dtype=jnp.int32), seqs)
    return (q, kc, vc, tables, token_seq, token_pos), 2 * kc.size * kc.dtype.itemsize


def part_attention(interpret: bool = False) -> dict:
    """Paged attention's time per engine step on the device, kernel (its own launch shape, and a sweep of
    blocks per loop step x key splits) against the reference, bf16, GQA 4, head dim 128 (interpret: small
    shapes, to try the part on any host)."""
    import functools

    import jax
    import numpy as np

    from tunix_rt.ops.paged_attention import paged_attention_reference
    from tunix_rt.ops.paged_attention_pallas import launch_shape, paged_attention_pallas

    kw = dict(scale=128**-0.5)
    reference = jax.jit(functools.partial(paged_attention_reference, **kw))
    # (name, sequences, context, query tokens per sequence)
    steps = [("decode 64 x 2K", 64, 2048, 1), ("decode 4 x 32K", 4, 32768, 1), ("decode 1 x 32K", 1, 32768, 1),
             ("prefill 512 of 2K", 1, 2048, 512)]
    if interpret:
        steps = [("decode 2 x 256", 2, 256, 1), ("prefill 8 of 128", 1, 128, 8)]
    rng = np.random.default_rng(0)
    rows = []
    for name, seqs, context, chunk in steps:
        step, cache_bytes = _attention_step(rng, seqs, context, chunk)
        reference_s = _median_seconds(functools.partial(reference, *step))
        want = np.asarray(reference(*step).astype(np.float32))
        _, bs, kv, _ = step[1].shape  # the cache's
        default = launch_shape(seqs * chunk, kv, bs, context // bs, interpret=interpret)
        launches = {default} | {(b, s) for b in (1, 2) for s in (1, 4, 16, 64)}
        if interpret:
            launches = {default, (1, 1), (2, 4)}
        sweep = []
        for blocks, splits in sorted(launches):
            kernel = jax.jit(functools.partial(paged_attention_pallas, **kw, blocks_per_step=blocks, splits=splits,
                                               interpret=interpret))
            try:
                err = float(np.abs(np.asarray(kernel(*step).astype(np.float32)) - want).max())
                seconds = _median_seconds(functools.partial(kernel, *step))
            except Exception as e:  # a launch shape the device refuses (registers, shared memory) is recorded
                sweep.append(dict(blocks_per_step=blocks, splits=splits, error=f"{type(e).__name__}: {e}"[:300]))
                continue
            sweep.append(dict(blocks_per_step=blocks, splits=splits, ms=seconds * 1e3, max_abs_err=err,
                              over_reference=reference_s / seconds, cache_gb_per_s=cache_bytes / seconds / 1e9))
        timed = [r for r in sweep if "ms" in r]
        best = min(timed, key=lambda r: r["ms"]) if timed else None
        mine = next((r for r in timed if (r["blocks_per_step"], r["splits"]) == default), None)
        rows.append(dict(step=name, reference_ms=reference_s * 1e3, cache_bytes=cache_bytes, default=mine, best=best,
                         sweep=sweep))
    return dict(steps=rows)


def part_quant(interpret: bool = False) -> dict:
    """The quantized-matmul kernel on the device (interpret: on any host, smaller timing shapes, to try the
    part itself)."""
    import functools
    import itertools

    import jax
    import jax.numpy as jnp
    import numpy as np

    from tests.ops.test_quant_matmul_pallas import FMT_GROUPS, random_weight
    from tunix_rt.ops.quant import quant_matmul_reference
    from tunix_rt.ops.quant_matmul_pallas import quant_matmul_pallas

    def kernel_fn(qt):
        return jax.jit(functools.partial(quant_matmul_pallas, fmt=qt.fmt, k=qt.shape[0], n=qt.shape[1],
                                         group=qt.group, interpret=interpret))

    reference = jax.jit(quant_matmul_reference)
    rng = np.random.default_rng(0)
    cases = []
    for fmt, group in FMT_GROUPS:
        qt = random_weight(rng, fmt, group, 1024, 192)
        kernel = kernel_fn(qt)
        for rows in (1, 16, 100):
            for dtype in (jnp.float32, jnp.bfloat16):
                x = jnp.asarray(rng.standard_normal((rows, 1024)), dtype)
                out = np.asarray(kernel(x, qt.qs, qt.scales, qt.mins, None).astype(jnp.float32))
                ref = np.asarray(reference(x, qt).astype(jnp.float32))
                cases.append(dict(fmt=fmt, group=group, rows=rows, dtype=jnp.dtype(dtype).name,
                                  max_abs_err=float(np.abs(out - ref).max()), max_abs=float(np.abs(ref).max())))
    worst = {dt: max(c["max_abs_err"] / c["max_abs"] for c in cases if c["dtype"] == dt) for dt in ("float32", "bfloat16")}
    k, n = (2048, 8192) if not interpret else (256, 64)
    timings = []
    for fmt in ("q4_1", "q8_0"):
        qt = random_weight(rng, fmt, 32, k, n)
        kernel = kernel_fn(qt)
        weight_bytes = qt.nbytes
        for rows, dtype in itertools.product((1, 16, 512), (jnp.bfloat16, jnp.float32)):
            x = jnp.asarray(rng.standard_normal((rows, k)), dtype)
            kernel_s = _median_seconds(functools.partial(kernel, x, qt.qs, qt.scales, qt.mins, None))
            reference_s = _median_seconds(functools.partial(reference, x, qt))
            timings.append(dict(fmt=fmt, rows=rows, dtype=jnp.dtype(dtype).name, k=k, n=n, kernel_ms=kernel_s * 1e3,
                                reference_ms=reference_s * 1e3,
                                kernel_over_reference=reference_s / kernel_s,
                                kernel_weight_gb_per_s=weight_bytes / kernel_s / 1e9))
    return dict(cases=cases, worst_relative_err=worst, timings=timings)


def _attention_rows(rng, b: int, t: int, kind: str):
    """Positions and segments of b training rows of t tokens: plain causal rows, or rows packed with
    examples of 64 to 1024 tokens (tests/ops/test_attention.packed_row draws them the same way, shorter)."""
    import numpy as np

    if kind == "causal":
        return np.broadcast_to(np.arange(t, dtype=np.int32), (b, t)).copy(), None
    positions, segments = np.zeros((b, t), np.int32), np.zeros((b, t), np.int32)
    for row in range(b):
        at, seg = 0, 1
        while at < t:
            n = min(int(rng.integers(64, 1025)), t - at)
            positions[row, at:at + n], segments[row, at:at + n] = np.arange(n), seg
            at, seg = at + n, seg + 1
    return positions, segments


def part_train_attention(interpret: bool = False) -> dict:
    """Training attention on the device: the Pallas flash-attention kernels against the dense reference
    (forward, and forward + backward), bf16 and f32, plain causal rows and packed ones, at the shapes training
    runs (interpret: tiny shapes, to try the part on any host)."""
    import functools

    import jax
    import jax.numpy as jnp
    import numpy as np

    from tunix_rt.ops.attention import attention_reference
    from tunix_rt.ops.attention_pallas import attention_pallas

    # (name, rows, tokens, query heads, kv heads, head dim)
    shapes = [("smollm2-135m 8 x 1K", 8, 1024, 9, 3, 64), ("llama-1b 4 x 4K", 4, 4096, 32, 8, 64),
              ("gemma d256 2 x 2K", 2, 2048, 8, 4, 256)]
    if interpret:
        shapes = [("tiny 2 x 100", 2, 100, 4, 2, 16)]
    rng = np.random.default_rng(0)
    rows = []
    for (name, b, t, h, kv, d), kind, dtype in [(s, k, dt) for s in shapes for k in ("causal", "packed")
                                                  for dt in (jnp.bfloat16, jnp.float32)]:
        if dtype == jnp.float32 and (kind == "packed" or name != shapes[0][0]):  # f32: one row says enough
            continue
        positions, segments = _attention_rows(rng, b, t, kind)
        positions, segments = jnp.asarray(positions), None if segments is None else jnp.asarray(segments)
        q = jnp.asarray(rng.standard_normal((b, t, h, d)), dtype)
        k, v = (jnp.asarray(rng.standard_normal((b, t, kv, d)), dtype) for _ in range(2))
        dout = jnp.asarray(rng.standard_normal((b, t, h, d)), dtype)
        opts = dict(scale=d**-0.5)

        def grads(fn):
            def run(q, k, v, dout):
                y, vjp = jax.vjp(lambda q, k, v: fn(q, k, v, positions, segments, **opts), q, k, v)
                return (y, *vjp(dout))
            return jax.jit(run)

        kernel = functools.partial(attention_pallas, interpret=interpret)
        row = dict(shape=name, kind=kind, dtype=jnp.dtype(dtype).name)
        try:
            want = grads(attention_reference)(*(x.astype(jnp.float32) for x in (q, k, v, dout)))
            row["max_rel_err"] = _max_rel_err(("out", "dq", "dk", "dv"), grads(kernel)(q, k, v, dout), want)
            for label, fn in (("kernel", kernel), ("reference", attention_reference)):
                forward = jax.jit(lambda q, k, v, fn=fn: fn(q, k, v, positions, segments, **opts))
                row[f"{label}_fwd_ms"] = _median_seconds(functools.partial(forward, q, k, v)) * 1e3
                row[f"{label}_fwd_bwd_ms"] = _median_seconds(functools.partial(grads(fn), q, k, v, dout)) * 1e3
            row["fwd_over_reference"] = row["reference_fwd_ms"] / row["kernel_fwd_ms"]
            row["fwd_bwd_over_reference"] = row["reference_fwd_bwd_ms"] / row["kernel_fwd_bwd_ms"]
            if kind == "causal" and dtype == jnp.bfloat16:  # the rows per tile, swept on one row of each shape
                row["tile_sweep_fwd_bwd_ms"] = {}
                for tile in (16, 32, 64, 128) if not interpret else (16, 32):
                    swept = grads(functools.partial(attention_pallas, interpret=interpret, tile=tile))
                    try:
                        ms = _median_seconds(functools.partial(swept, q, k, v, dout)) * 1e3
                    except Exception as e:  # a tile the device refuses (registers, shared memory)
                        ms = f"{type(e).__name__}: {e}"[:200]
                    row["tile_sweep_fwd_bwd_ms"][tile] = ms
        except Exception as e:  # recorded (a shape the device refuses, memory), the other rows still run
            row["error"] = f"{type(e).__name__}: {e}"[:400]
        rows.append(row)
    return dict(rows=rows)


def part_moe(interpret: bool = False) -> dict:
    """MoE's grouped matmul on the device: the Pallas kernels against the reference (XLA's ragged_dot) and a
    dense matmul of the same rows (the FLOP floor), forward and forward + backward, at a Qwen3-30B-A3B-like
    expert layer (128 experts, top 8, hidden 2048, expert width 768) with uneven loads; bf16 and f32."""
    import functools

    import jax
    import jax.numpy as jnp
    import numpy as np

    from tunix_rt.ops.grouped_matmul_pallas import grouped_matmul_pallas
    from tunix_rt.ops.moe import grouped_matmul_reference

    experts, k, n = (128, 2048, 768) if not interpret else (8, 64, 32)
    rng = np.random.default_rng(0)
    rows = []
    for tokens, dtype in ((512, jnp.bfloat16), (4096, jnp.bfloat16), (4096, jnp.float32)) if not interpret else \
            ((16, jnp.bfloat16),):
        m = tokens * 8  # top 8
        sizes = jnp.asarray(rng.multinomial(m, rng.dirichlet(np.ones(experts))).astype(np.int32))  # uneven loads
        x = jnp.asarray(rng.standard_normal((m, k)), dtype)
        w = jnp.asarray(rng.standard_normal((experts, k, n)) * 0.02, dtype)
        kernel = functools.partial(grouped_matmul_pallas, interpret=interpret)
        fns = {"kernel": lambda x, w, fn=kernel: fn(x, w, sizes), "reference": lambda x, w: grouped_matmul_reference(x, w, sizes),
               "dense": lambda x, w: x @ w[0]}
        row = dict(rows=m, experts=experts, k=k, n=n, dtype=jnp.dtype(dtype).name)
        try:
            grads = {name: jax.jit(jax.grad(lambda x, w, fn=fn: jnp.sum(fn(x, w).astype(jnp.float32) * x[:, :1]),
                                            (0, 1))) for name, fn in fns.items()}
            row["max_rel_err"] = _max_rel_err(
                ("y", "dx", "dw"), (jax.jit(fns["kernel"])(x, w), *grads["kernel"](x, w)),
                (jax.jit(fns["reference"])(x, w), *grads["reference"](x, w)))
            for name, fn in fns.items():
                row[f"{name}_ms"] = _median_seconds(functools.partial(jax.jit(fn), x, w)) * 1e3
                row[f"{name}_grad_ms"] = _median_seconds(functools.partial(grads[name], x, w)) * 1e3
            row["kernel_tflops"] = 2 * m * k * n / row["kernel_ms"] / 1e9
            row["kernel_over_reference"] = row["reference_ms"] / row["kernel_ms"]
            row["kernel_grad_over_reference"] = row["reference_grad_ms"] / row["kernel_grad_ms"]
            row["kernel_over_dense"] = row["dense_ms"] / row["kernel_ms"]
        except Exception as e:  # recorded, the other rows still run
            row["error"] = f"{type(e).__name__}: {e}"[:400]
        rows.append(row)
    return dict(rows=rows)


def part_engine(model_dir: str) -> dict:
    import jax.numpy as jnp
    import numpy as np

    from tunix_rt.checkpoints.loader import load_model
    from tunix_rt.engine.engine import Engine
    from tunix_rt.engine.params import SamplingParams

    start = time.perf_counter()
    model = load_model(model_dir, dtype=jnp.bfloat16)  # bf16 activations: the dtype the quantized-matmul kernel takes
    engine = Engine(model.model, model.tokenizer, max_num_seqs=16)
    loaded = time.perf_counter() - start
    vocab = engine.model.config.vocab_size
    rng = np.random.default_rng(0)
    prompts = [rng.integers(5, min(vocab, 100), size=12).tolist() for _ in range(3)]
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    start = time.perf_counter()
    first = engine.generate(prompts[:1], greedy)
    first_s = time.perf_counter() - start
    tokens = [o.token_ids for o in engine.generate(prompts, greedy)]

    def decode(streams: int, new: int = 32) -> float:
        params = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
        batch = [rng.integers(5, vocab, size=16).tolist() for _ in range(streams)]
        engine.generate(batch, params)  # compiles this shape's programs
        start = time.perf_counter()
        engine.generate(batch, params)
        return streams * new / (time.perf_counter() - start)

    def prefill(length: int = 512) -> float:
        engine.reset_prefix_cache()
        prompt = rng.integers(5, vocab, size=length).tolist()
        params = SamplingParams(temperature=0, max_tokens=1)
        engine.generate([prompt], params)
        engine.reset_prefix_cache()
        start = time.perf_counter()
        engine.generate([prompt], params)
        return length / (time.perf_counter() - start)

    return dict(load_s=loaded, first_generate_s=first_s, first_tokens=first[0].token_ids, greedy_tokens=tokens,
                decode_tok_s_1=statistics.median(decode(1) for _ in range(3)),
                decode_tok_s_16=statistics.median(decode(16) for _ in range(3)), prefill_tok_s_512=prefill())


def reward_short(prompts, completions, completion_ids, **columns) -> list[float]:
    """The GRPO step's reward: shorter is better (what is learned does not matter here, the step's cost does)."""
    return [-len(ids) / 100.0 for ids in completion_ids]


def part_train(model_dir: str) -> dict:
    import numpy as np

    from tunix_rt.checkpoints.loader import load_model
    from tunix_rt.train.config import GRPOConfig, SFTConfig
    from tunix_rt.train.data import SFTExample
    from tunix_rt.train.rl_trainer import RLTrainer
    from tunix_rt.train.run import build_objective
    from tunix_rt.train.sft import SFTObjective
    from tunix_rt.train.trainer import Trainer, peak_rss_gb

    report = {}
    rng = np.random.default_rng(0)
    batch, length = 8, 256
    with tempfile.TemporaryDirectory() as out:
        loaded = load_model(model_dir, dequantize=True)
        vocab = loaded.model.config.vocab_size
        items = [SFTExample(rng.integers(5, vocab, length).astype(np.int32), np.ones(length, bool)) for _ in range(2 * batch)]
        cfg = SFTConfig(data="-", output=out + "/sft", steps=2, batch_size=batch, max_length=length, lora_rank=8,
                        lora_alpha=16.0, shuffle=False, progress=False, save_steps=10_000, compute_dtype="bfloat16")
        trainer = Trainer(cfg, loaded.model, SFTObjective(items, max_length=length, pad_id=0))
        report["sft_lora_step_s"], report["sft_loss"] = _timed_steps(trainer, 2)
        prompts = Path(out) / "prompts.jsonl"
        prompts.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": f"tell {i}"}]}) + "\n"
                                   for i in range(8)))
        cfg = GRPOConfig(model=model_dir, data=str(prompts), output=out + "/grpo", steps=2, batch_size=16,
                         num_generations=4, max_completion_length=32, lora_rank=8, lora_alpha=16.0,
                         reward=(f"{Path(__file__).resolve()}:reward_short",), learning_rate=1e-5, save_steps=10_000,
                         progress=False, shuffle=False, compute_dtype="bfloat16")
        loaded = load_model(model_dir, dequantize=False)
        trainer = RLTrainer(cfg, loaded.model, build_objective(cfg, loaded, cfg.data))
        report["grpo_lora_step_s"], report["grpo_loss"] = _timed_steps(trainer, 2)
    report["peak_rss_gb"] = peak_rss_gb()
    return report


def _timed_steps(trainer, steps: int) -> tuple[list[float], list[float]]:
    """Each step's seconds and loss (the kernel modes' losses should agree)."""
    times, losses = [], []
    for step in range(steps):
        start = time.perf_counter()
        losses.append(trainer.run_step(step)["loss"])
        times.append(time.perf_counter() - start)
    return times, losses


def _device_memory() -> dict:
    import jax

    stats = jax.devices()[0].memory_stats() or {}
    return {"peak_device_gb": stats.get("peak_bytes_in_use", 0) / 1e9}


def run_part(args) -> None:
    part = {"kernels": lambda: part_kernels(), "quant": lambda: part_quant(args.interpret),
            "attention": lambda: part_attention(args.interpret),
            "train_attention": lambda: part_train_attention(args.interpret), "moe": lambda: part_moe(args.interpret),
            "engine": lambda: part_engine(args.model_dir),
            "train": lambda: part_train(args.model_dir)}[args.part]
    result = part()
    result.update(_device_memory())
    print("RESULT " + json.dumps(result), flush=True)


def _subprocess(argv: list[str], env: dict, timeout: float) -> dict:
    start = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, __file__, *argv], env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode or not lines:
        return {"error": f"exit {proc.returncode}", "stderr_tail": proc.stderr[-3000:]}
    result = json.loads(lines[-1][len("RESULT "):])
    result["wall_s"] = time.perf_counter() - start
    return result


def _engine_runs(directory: str, env: dict, timeout: float) -> dict:
    """The engine part with the device's kernels (native) and with the pure-JAX references, and whether their
    greedy tokens agree."""
    runs = {mode: _subprocess(["--part", "engine", "--model-dir", directory], dict(env, TUNIX_RT_KERNELS=mode), timeout)
            for mode in ("native", "reference")}
    native, reference = runs["native"].get("greedy_tokens"), runs["reference"].get("greedy_tokens")
    if native and reference:
        same = sum(a == b for x, y in zip(native, reference) for a, b in zip(x, y))
        runs["greedy_tokens_equal"] = f"{same}/{sum(len(x) for x in native)}"
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="device_check.json")
    parser.add_argument("--part", choices=("kernels", "attention", "train_attention", "moe", "quant", "engine", "train"),
                        help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    parser.add_argument("--skip-1b", action="store_true", help="only the SmolLM2-135M-shaped model")
    parser.add_argument("--parts", default="kernels,attention,train_attention,moe,quant,engine,train",
                        help="which parts to run (comma-separated)")
    parser.add_argument("--interpret", action="store_true",
                        help="run the attention, train_attention, moe and quant parts' kernels in interpret mode "
                             "(small shapes): to try those parts on any host")
    parser.add_argument("--engine-weights", default="bf16,q4_1",
                        help="which weights the engine part runs each model with (comma-separated: bf16, q4_1)")
    parser.add_argument("--part-timeout", type=float, default=240.0, help="seconds each part may take")
    args = parser.parse_args()
    sys.path[:0] = [str(ROOT / "python"), str(ROOT)]
    if args.part:
        return run_part(args)

    import jax

    report = {"jax": jax.__version__, "devices": [str(d) for d in jax.devices()], "backend": jax.default_backend()}
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "python"), str(ROOT), os.environ.get("PYTHONPATH", "")]))
    out = Path(args.out)

    def record(key: str, value: dict) -> None:
        report[key] = value
        out.write_text(json.dumps(report, indent=1))
        print(f"{key}: {json.dumps(value)[:1500]}", flush=True)

    parts = set(args.parts.split(","))
    weights = set(args.engine_weights.split(","))
    for kernels in ("kernels", "attention", "train_attention", "moe", "quant"):
        if kernels in parts:
            record(kernels, _subprocess(["--part", kernels] + (["--interpret"] if args.interpret else []), env,
                                        args.part_timeout))
    models = dict(MODELS) if args.skip_1b else {**MODELS, "llama-3.2-1b-shape": _llama_1b()}
    if not parts & {"engine", "train"}:
        models = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, config in models.items():
            start = time.perf_counter()
            directory = str(write_model(config, Path(tmp) / name))
            report.setdefault("model_write_s", {})[name] = time.perf_counter() - start
            if "engine" in parts and "bf16" in weights:
                record(f"engine/{name}", _engine_runs(directory, env, args.part_timeout))
            if "engine" in parts and "q4_1" in weights:
                quantized = str(Path(tmp) / f"{name}-q4_1")
                start = time.perf_counter()
                quantize = subprocess.run([sys.executable, "-m", "tunix_rt.cli", "quantize", "--model", directory,
                                           "--format", "q4_1", "--output", quantized], env=dict(env, JAX_PLATFORMS="cpu"),
                                          capture_output=True, text=True, timeout=args.part_timeout)
                report.setdefault("model_quantize_s", {})[name] = time.perf_counter() - start
                record(f"engine/{name}-q4_1", _engine_runs(quantized, env, args.part_timeout) if quantize.returncode == 0
                       else {"error": "tunix-rt quantize failed", "stderr_tail": quantize.stderr[-3000:]})
            if "train" in parts:
                record(f"train/{name}", {mode: _subprocess(["--part", "train", "--model-dir", directory],
                                                           dict(env, TUNIX_RT_KERNELS=mode), args.part_timeout)
                                         for mode in ("native", "reference")})


if __name__ == "__main__":
    main()
