"""The MoE layer on tunix-rt's routing ops vs a dense all-experts einsum and vs jax.lax.ragged_dot, in one run;
then MoE-model decode on the engine, routed vs all-experts.

Usage: python benchmarks/moe.py [--quick] [--skip-decode]
Layer: hidden 512, expert width 256, SwiGLU experts, softmax top-k routing, f32. Three implementations
of one function (same weights, same outputs):
  ours    router_topk -> permute -> 3 grouped_matmul (FFI) -> unpermute, each with its custom_vjp
  ragged  the same pipeline on the pure-JAX references: jax.lax.ragged_dot for the products (XLA:CPU
          lowers it to a masked dense product over every group)
  dense   every expert on every token (einsum), combined with the top-k weights scattered to (T, E)
Each is jitted; "fwd+bwd" takes gradients of a scalar loss w.r.t. x and all weights. Median times
(each implementation timed in its own block), ratios = peer time / ours. ragged is skipped where its masked operand would pass
--ragged-limit GiB. Decode: a 4-layer MoE decoder (64 experts, top-8) generating on the engine, once
with the routed layer and once with the dense all-experts layer swapped in. Timings are never asserted.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from quant_matmul import paired_medians  # noqa: E402

from tunix_rt.ops import moe  # noqa: E402
from tunix_rt.ops._ffi import isa_level  # noqa: E402

HIDDEN, INTER = 512, 256


def make_params(e: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    f = lambda *s: jnp.asarray(rng.standard_normal(s).astype(np.float32) * 0.05)
    return dict(router=f(HIDDEN, e), gate=f(e, HIDDEN, INTER), up=f(e, HIDDEN, INTER), down=f(e, INTER, HIDDEN))


def routed_layer(k: int, ops: str):
    """The MoE layer on our FFI ops ("ours") or on their pure-JAX references ("ragged")."""
    route, perm, gmm, unperm = ((moe.router_topk, moe.permute, moe.grouped_matmul, moe.unpermute) if ops == "ours" else
                                (moe.router_topk_reference, moe.permute_reference, moe.grouped_matmul_reference,
                                 moe.unpermute_reference))

    def layer(p, x):
        e = p["gate"].shape[0]
        w, ids = route(x @ p["router"], k, renormalize=True)
        rows, row_of, sizes = perm(x, ids, e)
        h = jax.nn.silu(gmm(rows, p["gate"], sizes)) * gmm(rows, p["up"], sizes)
        return unperm(gmm(h, p["down"], sizes), row_of, w)
    return layer


def dense_layer(k: int):
    def layer(p, x):
        e = p["gate"].shape[0]
        w, ids = moe.router_topk_reference(x @ p["router"], k, renormalize=True)
        combine = jnp.zeros((x.shape[0], e), jnp.float32).at[jnp.arange(x.shape[0])[:, None], ids].set(w)
        h = jax.nn.silu(jnp.einsum("th,ehi->tei", x, p["gate"])) * jnp.einsum("th,ehi->tei", x, p["up"])
        return jnp.einsum("tei,eih,te->th", h, p["down"], combine)
    return layer


def fwd_bwd(layer):
    return jax.jit(jax.grad(lambda p, x: jnp.sum(jnp.sin(layer(p, x))), argnums=(0, 1)))


def layer_table(quick: bool, ragged_limit_gib: float) -> None:
    tokens_list = (64, 4096) if quick else (64, 512, 4096)
    print(f"MoE layer, hidden {HIDDEN}, expert width {INTER}, f32, ISA {isa_level()}; median ms; "
          f"ratio = peer / ours")
    header = (f"{'tokens':>6} {'E':>3} {'k':>2} {'pass':>8} {'ours':>9} {'dense':>9} {'ragged':>9} "
              f"{'dense/ours':>10} {'ragged/ours':>11}")
    print(header)
    print("-" * len(header))
    for t in tokens_list:
        for e, k in ((8, 2), (64, 8)):
            p = make_params(e)
            x = jnp.asarray(np.random.default_rng(1).standard_normal((t, HIDDEN)).astype(np.float32))
            ragged_gib = e * t * k * max(HIDDEN, INTER) * 4 / 2**30  # its masked (E, rows, K) operand
            impls = {"ours": routed_layer(k, "ours"), "dense": dense_layer(k)}
            if ragged_gib <= ragged_limit_gib:
                impls["ragged"] = routed_layer(k, "ragged")
            ref = np.asarray(jax.jit(impls["dense"])(p, x))
            np.testing.assert_allclose(np.asarray(jax.jit(impls["ours"])(p, x)), ref, rtol=2e-3, atol=2e-4)
            for name, wrap in (("fwd", jax.jit), ("fwd+bwd", fwd_bwd)):
                fns = {n: wrap(f) for n, f in impls.items()}
                repeats = 3 if t * e >= 4096 * 64 else 7
                # one implementation at a time: alternating with a peer that streams GBs (ragged) would
                # time the others on cold caches
                times = {n: paired_medians([(f, (p, x))], repeats=repeats, min_time=0.0)[0] for n, f in fns.items()}
                ms = {n: f"{v * 1e3:9.2f}" for n, v in times.items()}
                ragged_ms = ms.get("ragged", f"{'skipped':>9}")
                ragged_ratio = f"{times['ragged'] / times['ours']:11.2f}" if "ragged" in times else f"{'-':>11}"
                print(f"{t:>6} {e:>3} {k:>2} {name:>8} {ms['ours']} {ms['dense']} {ragged_ms} "
                      f"{times['dense'] / times['ours']:10.2f} {ragged_ratio}", flush=True)
            if "ragged" not in impls:
                print(f"{'':>6} ragged skipped: its masked operand would take {ragged_gib:.1f} GiB "
                      f"(> --ragged-limit {ragged_limit_gib})")


def decode_table(max_tokens: int) -> None:
    from tunix_rt.engine.engine import Engine
    from tunix_rt.engine.params import SamplingParams
    from tunix_rt.models import decoder as decoder_mod
    from tunix_rt.models.config import FULL, ModelConfig, RopeConfig

    cfg = ModelConfig(architecture="qwen3_moe", vocab_size=8192, hidden_size=HIDDEN, intermediate_size=4 * HIDDEN,
                      num_layers=4, num_heads=8, num_kv_heads=4, head_dim=64, qk_norm=True,
                      rope=((FULL, RopeConfig(theta=1e6)),), num_experts=64, num_experts_per_tok=8,
                      moe_intermediate_size=INTER, norm_topk_prob=True)
    model = decoder_mod.Decoder(cfg, rngs=nnx.Rngs(0))
    prompt = np.random.default_rng(2).integers(0, cfg.vocab_size, 32).tolist()
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    routed_call = decoder_mod.MoEMLP.__call__

    def dense_call(self, x):  # every expert on every token: the all-experts reference
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        w, ids = moe.router_topk_reference(self.router(flat), self.top_k, renormalize=self.renormalize)
        combine = jnp.zeros((flat.shape[0], self.num_experts), jnp.float32).at[
            jnp.arange(flat.shape[0])[:, None], ids].set(w)
        ex = self.experts
        h = self.act(jnp.einsum("th,ehi->tei", flat, ex.gate_proj[...])) * jnp.einsum("th,ehi->tei", flat, ex.up_proj[...])
        return jnp.einsum("tei,eih,te->th", h, ex.down_proj[...], combine).reshape(shape)

    expert_mb = 3 * cfg.num_experts * HIDDEN * INTER * 4 / 2**20
    print(f"\nMoE decode on the engine: {cfg.num_layers} layers, {cfg.num_experts} experts (top "
          f"{cfg.num_experts_per_tok}), {expert_mb:.0f} MiB of expert weights per layer, single stream, "
          f"{max_tokens} new tokens; median of 3")
    results = {}
    for name, call in (("routed (ours)", routed_call), ("all experts", dense_call)):
        decoder_mod.MoEMLP.__call__ = call
        try:
            engine = Engine(model, None, max_model_len=256, max_num_seqs=4, max_num_batched_tokens=64)
            engine.generate([prompt], params)  # compile
            times = []
            for _ in range(3):
                start = time.perf_counter()
                out = engine.generate([prompt], params)[0]
                times.append(time.perf_counter() - start)
            results[name] = (len(out.token_ids) / statistics.median(times), out.token_ids)
        finally:
            decoder_mod.MoEMLP.__call__ = routed_call
    same = results["routed (ours)"][1] == results["all experts"][1]
    for name, (tps, _) in results.items():
        print(f"  {name:<14} {tps:8.1f} tok/s")
    print(f"  ratio routed / all experts: {results['routed (ours)'][0] / results['all experts'][0]:.2f}x; "
          f"same greedy tokens: {same}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="64 and 4096 tokens only")
    ap.add_argument("--skip-decode", action="store_true")
    ap.add_argument("--ragged-limit", type=float, default=2.0, help="GiB cap on ragged_dot's masked operand")
    ap.add_argument("--decode-tokens", type=int, default=64)
    args = ap.parse_args()
    layer_table(args.quick, args.ragged_limit)
    if not args.skip_decode:
        decode_table(args.decode_tokens)


if __name__ == "__main__":
    main()
