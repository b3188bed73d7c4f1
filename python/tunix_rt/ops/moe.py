"""Mixture-of-Experts routing as XLA FFI ops: router top-k, permute, grouped matmul, unpermute.

A MoE layer runs them in order: `router_topk` picks k experts per token with their weights;
`permute` copies each token's row once per choice into an expert-sorted buffer (stable, so expert e
owns a contiguous run of rows, `group_sizes[e]` long);
`grouped_matmul` multiplies each run by its expert's weight; `unpermute` sums every token's k rows
back, weighted. Only the rows a token was routed to are computed: decode touches only the routed
experts' weights. Each op has a pure-JAX reference with the same signature (the grouped matmul's is
jax.lax.ragged_dot, which XLA:CPU runs as a dense product over every group) and a custom_vjp.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from tunix_rt.ops import grouped_matmul_pallas
from tunix_rt.ops._ffi import platform_dispatch, require_array

_ROUTE = "tunix_rt_moe_route"
_PERMUTE = "tunix_rt_moe_permute"
_UNPERMUTE = "tunix_rt_moe_unpermute"
_UNPERMUTE_BWD = "tunix_rt_moe_unpermute_bwd"
_GMM = "tunix_rt_grouped_matmul"
_GMM_DW = "tunix_rt_grouped_matmul_dw"
_FLOATS = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))
SCORINGS = ("softmax", "sigmoid")


def _positive_int(name: str, value, op: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{op}: {name} must be a positive integer, got {value!r}")
    return int(value)


# ---- router top-k ------------------------------------------------------------------------------


def _check_route(logits, k, scoring, n_groups, topk_groups, group_top, bias, scale):
    require_array("router_topk", "logits", logits)
    if jnp.dtype(logits.dtype) not in _FLOATS or logits.ndim < 1:
        raise ValueError(f"router_topk: logits must be float32 or bfloat16 (..., experts), got {logits.dtype} {logits.shape}")
    e = logits.shape[-1]
    k = _positive_int("k", k, "router_topk")
    if k > e:
        raise ValueError(f"router_topk: k ({k}) exceeds the number of experts ({e})")
    if scoring not in SCORINGS:
        raise ValueError(f"router_topk: scoring must be one of {SCORINGS}, got {scoring!r}")
    n_groups = _positive_int("n_groups", n_groups, "router_topk")
    topk_groups = _positive_int("topk_groups", topk_groups, "router_topk")
    group_top = _positive_int("group_top", group_top, "router_topk")
    if e % n_groups:
        raise ValueError(f"router_topk: n_groups ({n_groups}) must divide the number of experts ({e})")
    if topk_groups > n_groups or group_top > e // n_groups:
        raise ValueError(f"router_topk: need topk_groups <= n_groups and group_top <= experts per group, got "
                         f"topk_groups={topk_groups}, n_groups={n_groups}, group_top={group_top}")
    if n_groups > 1 and k > topk_groups * (e // n_groups):
        raise ValueError(f"router_topk: k ({k}) exceeds the experts of the {topk_groups} kept groups")
    if bias is not None and (require_array("router_topk", "bias", bias).shape != (e,)):
        raise ValueError(f"router_topk: bias must have shape ({e},), got {bias.shape}")
    if isinstance(scale, bool) or not isinstance(scale, (int, float, np.floating)) or not math.isfinite(scale):
        raise ValueError(f"router_topk: scale must be a finite number, got {scale!r}")


def _scores(logits, scoring):
    x = logits.astype(jnp.float32)
    return jax.nn.softmax(x, axis=-1) if scoring == "softmax" else jax.nn.sigmoid(x)


def _weights_for(logits, ids, scoring, renormalize, scale):
    """The routing weights of fixed choices `ids`: what gradients flow through."""
    w = jnp.take_along_axis(_scores(logits, scoring), ids, axis=-1)
    if renormalize:
        w = w / jnp.sum(w, axis=-1, keepdims=True)
    return w * scale


def router_topk_reference(logits, k, *, scoring="softmax", renormalize=False, n_groups=1, topk_groups=1, group_top=1,
                          bias=None, scale=1.0):
    """Pure-JAX router top-k with the FFI op's semantics (see router_topk)."""
    _check_route(logits, k, scoring, n_groups, topk_groups, group_top, bias, scale)
    e = logits.shape[-1]
    scores = _scores(jax.lax.stop_gradient(logits), scoring)
    choice = scores if bias is None else scores + bias.astype(jnp.float32)
    if n_groups > 1:
        grouped = choice.reshape(*choice.shape[:-1], n_groups, e // n_groups)
        group_score = jnp.sum(jax.lax.top_k(grouped, group_top)[0], axis=-1)
        _, kept = jax.lax.top_k(group_score, topk_groups)
        keep = jnp.any(jax.nn.one_hot(kept, n_groups, dtype=jnp.bool_), axis=-2)
        choice = jnp.where(jnp.repeat(keep, e // n_groups, axis=-1), choice, -jnp.inf)
    _, ids = jax.lax.top_k(choice, k)
    ids = ids.astype(jnp.int32)
    return _weights_for(logits, ids, scoring, renormalize, scale), ids


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _route_ffi(logits, bias, k, static):
    return _route_call(logits, bias, k, static)


def _route_call(logits, bias, k, static):
    scoring, renormalize, n_groups, topk_groups, group_top, scale = static
    t, e = logits.shape
    out = (jax.ShapeDtypeStruct((t, k), jnp.float32), jax.ShapeDtypeStruct((t, k), jnp.int32))
    call = jax.ffi.ffi_call(_ROUTE, out, vmap_method="sequential")
    return call(logits.astype(jnp.float32), bias, scoring=np.int32(SCORINGS.index(scoring)), renormalize=renormalize,
                n_groups=np.int64(n_groups), topk_groups=np.int64(topk_groups), group_top=np.int64(group_top),
                scale=np.float32(scale))


def _route_fwd(logits, bias, k, static):
    out = _route_call(logits, bias, k, static)
    return out, (logits, out[1])


def _route_bwd(k, static, residuals, cotangents):
    logits, ids = residuals
    scoring, renormalize, _, _, _, scale = static
    _, vjp = jax.vjp(lambda lg: _weights_for(lg, ids, scoring, renormalize, scale), logits)
    (dlogits,) = vjp(cotangents[0])
    return dlogits, None


_route_ffi.defvjp(_route_fwd, _route_bwd)


def router_topk(logits, k, *, scoring="softmax", renormalize=False, n_groups=1, topk_groups=1, group_top=1, bias=None,
                scale=1.0):
    """(weights f32 (..., k), expert ids int32 (..., k)) for router logits (..., experts).

    scores = softmax or sigmoid of the logits (in f32). Experts are chosen by scores + `bias`
    (DeepSeek-V3's balancing correction, never differentiated), optionally only among the best
    `topk_groups` of `n_groups` equal groups (a group scores the sum of its `group_top` best
    choices: 1 for DeepSeek-V2, 2 for V3); ties go to the lower id. weights are the chosen
    scores, renormalised to sum 1 with `renormalize` (Mixtral, Qwen3-MoE's norm_topk_prob), times
    `scale`. Differentiable in logits. Non-finite logits other than -inf are an error.
    """
    _check_route(logits, k, scoring, n_groups, topk_groups, group_top, bias, scale)
    lead, e = logits.shape[:-1], logits.shape[-1]
    bias_arr = jnp.zeros((e,), jnp.float32) if bias is None else jax.lax.stop_gradient(bias).astype(jnp.float32)
    static = (scoring, bool(renormalize), int(n_groups), int(topk_groups), int(group_top), float(scale))
    flat = logits.reshape(-1, e)
    w, ids = platform_dispatch(
        _ROUTE,
        lambda lg, b: _route_ffi(lg, b, int(k), static),
        lambda lg, b: router_topk_reference(lg, int(k), scoring=scoring, renormalize=renormalize, n_groups=n_groups,
                                            topk_groups=topk_groups, group_top=group_top,
                                            bias=None if bias is None else b, scale=scale),
        flat,
        bias_arr,
    )
    return w.reshape(*lead, int(k)), ids.reshape(*lead, int(k))


# ---- permute / unpermute -----------------------------------------------------------------------


def _check_permute(x, expert_ids, num_experts):
    require_array("permute", "x", x)
    require_array("permute", "expert_ids", expert_ids)
    if x.ndim != 2 or jnp.dtype(x.dtype) not in _FLOATS:
        raise ValueError(f"permute: x must be float32 or bfloat16 (tokens, hidden), got {x.dtype} {x.shape}")
    if expert_ids.ndim != 2 or expert_ids.shape[0] != x.shape[0] or jnp.dtype(expert_ids.dtype) != jnp.int32:
        raise ValueError(f"permute: expert_ids must be int32 ({x.shape[0]}, k), got {expert_ids.dtype} {expert_ids.shape}")
    _positive_int("num_experts", num_experts, "permute")


def permute_reference(x, expert_ids, num_experts):
    """Pure-JAX permute with the FFI op's semantics (see permute)."""
    _check_permute(x, expert_ids, num_experts)
    t, k = expert_ids.shape
    flat = expert_ids.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    counts = jnp.bincount(flat, length=num_experts).astype(jnp.int32)
    row_of = jnp.zeros((t * k,), jnp.int32).at[order].set(jnp.arange(t * k, dtype=jnp.int32))
    xs = jnp.zeros((t * k, x.shape[1]), x.dtype).at[row_of].set(jnp.repeat(x, k, axis=0))
    return xs, row_of.reshape(t, k), counts


def _check_unpermute(ys, row_of, weights):
    require_array("unpermute", "ys", ys)
    require_array("unpermute", "row_of", row_of)
    require_array("unpermute", "weights", weights)
    if ys.ndim != 2 or jnp.dtype(ys.dtype) not in _FLOATS:
        raise ValueError(f"unpermute: ys must be float32 or bfloat16 (rows, hidden), got {ys.dtype} {ys.shape}")
    if row_of.ndim != 2 or jnp.dtype(row_of.dtype) != jnp.int32:
        raise ValueError(f"unpermute: row_of must be int32 (tokens, k), got {row_of.dtype} {row_of.shape}")
    if weights.shape != row_of.shape or jnp.dtype(weights.dtype) not in _FLOATS:
        raise ValueError(f"unpermute: weights must be float (tokens, k) = {row_of.shape}, got {weights.dtype} {weights.shape}")


def unpermute_reference(ys, row_of, weights):
    """Pure-JAX unpermute with the FFI op's semantics (see unpermute)."""
    _check_unpermute(ys, row_of, weights)
    if ys.shape[0] == 0:  # nothing routed (jnp.take of an empty array drops the index shape)
        return jnp.zeros((row_of.shape[0], ys.shape[1]), ys.dtype)
    rows = jnp.take(ys, jnp.maximum(row_of, 0), axis=0).astype(jnp.float32)
    w = jnp.where(row_of >= 0, weights.astype(jnp.float32), 0.0)
    return jnp.einsum("tkh,tk->th", rows, w).astype(ys.dtype)


def _unpermute_call(ys, row_of, weights):
    t = row_of.shape[0]
    call = jax.ffi.ffi_call(_UNPERMUTE, jax.ShapeDtypeStruct((t, ys.shape[1]), ys.dtype), vmap_method="sequential")
    return call(ys, row_of, weights)


@jax.custom_vjp
def _unpermute_ffi(ys, row_of, weights):
    return _unpermute_call(ys, row_of, weights)


def _unpermute_fwd(ys, row_of, weights):
    return _unpermute_call(ys, row_of, weights), (ys, row_of, weights)


def _unpermute_bwd(residuals, dout):
    ys, row_of, weights = residuals
    out = (jax.ShapeDtypeStruct(ys.shape, ys.dtype), jax.ShapeDtypeStruct(weights.shape, jnp.float32))
    call = jax.ffi.ffi_call(_UNPERMUTE_BWD, out, vmap_method="sequential")
    dys, dw = call(ys, row_of, weights, dout.astype(ys.dtype))
    return dys, np.zeros(row_of.shape, jax.dtypes.float0), dw


_unpermute_ffi.defvjp(_unpermute_fwd, _unpermute_bwd)


def unpermute(ys, row_of, weights):
    """out[t] = sum_j weights[t, j] * ys[row_of[t, j]] (a row of -1 adds nothing).

    ys (rows, hidden) holds the experts' outputs in permute's order; out (tokens, hidden) has ys's
    dtype, summed in f32. Differentiable in ys and weights. A row outside [-1, rows) is an error.
    """
    _check_unpermute(ys, row_of, weights)
    w32 = weights.astype(jnp.float32)
    return platform_dispatch(_UNPERMUTE, _unpermute_ffi, unpermute_reference, ys, row_of, w32)


def _permute_call(x, expert_ids, num_experts):
    t, k = expert_ids.shape
    out = (jax.ShapeDtypeStruct((t * k, x.shape[1]), x.dtype), jax.ShapeDtypeStruct((t, k), jnp.int32),
           jax.ShapeDtypeStruct((num_experts,), jnp.int32))
    call = jax.ffi.ffi_call(_PERMUTE, out, vmap_method="sequential")
    return call(x, expert_ids)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _permute_ffi(x, expert_ids, num_experts):
    return _permute_call(x, expert_ids, num_experts)


def _permute_fwd(x, expert_ids, num_experts):
    out = _permute_call(x, expert_ids, num_experts)
    return out, (out[1], expert_ids)


def _permute_bwd(num_experts, residuals, cotangents):
    row_of, expert_ids = residuals
    dxs = cotangents[0]
    dx = _unpermute_call(dxs, row_of, jnp.ones(row_of.shape, jnp.float32))  # each token sums its copies
    return dx, np.zeros(expert_ids.shape, jax.dtypes.float0)


_permute_ffi.defvjp(_permute_fwd, _permute_bwd)


def permute(x, expert_ids, num_experts):
    """(xs (tokens * k, hidden), row_of int32 (tokens, k), group_sizes int32 (experts,)).

    Copies token t's row into row row_of[t, j] for each of its k choices, sorted by expert
    (stable: within an expert, tokens keep their order); every choice gets a row, so
    sum(group_sizes) = tokens * k. Differentiable in x. An expert id outside [0, num_experts) is an
    error.
    """
    _check_permute(x, expert_ids, num_experts)
    num_experts = int(num_experts)
    return platform_dispatch(
        _PERMUTE,
        lambda x, ids: _permute_ffi(x, ids, num_experts),
        lambda x, ids: permute_reference(x, ids, num_experts),
        x,
        expert_ids,
    )


# ---- grouped matmul ----------------------------------------------------------------------------


def _check_gmm(x, w, group_sizes, transpose_w):
    require_array("grouped_matmul", "x", x)
    require_array("grouped_matmul", "w", w)
    require_array("grouped_matmul", "group_sizes", group_sizes)
    if x.ndim != 2 or jnp.dtype(x.dtype) not in _FLOATS:
        raise ValueError(f"grouped_matmul: x must be float32 or bfloat16 (rows, K), got {x.dtype} {x.shape}")
    if w.ndim != 3 or jnp.dtype(w.dtype) != jnp.dtype(x.dtype):
        raise ValueError(f"grouped_matmul: w must be (experts, K, N) of x's dtype {x.dtype}, got {w.dtype} {w.shape}")
    k_axis = 2 if transpose_w else 1
    if w.shape[k_axis] != x.shape[1]:
        raise ValueError(f"grouped_matmul: w's K axis ({w.shape[k_axis]}) does not match x's last dimension ({x.shape[1]})")
    if group_sizes.shape != (w.shape[0],) or jnp.dtype(group_sizes.dtype) != jnp.int32:
        raise ValueError(f"grouped_matmul: group_sizes must be int32 ({w.shape[0]},), got {group_sizes.dtype} "
                         f"{group_sizes.shape}")


def grouped_matmul_reference(x, w, group_sizes, *, transpose_w=False):
    """jax.lax.ragged_dot: the same product (XLA:CPU computes it densely over every group)."""
    _check_gmm(x, w, group_sizes, transpose_w)
    return jax.lax.ragged_dot(x, jnp.swapaxes(w, 1, 2) if transpose_w else w, group_sizes).astype(x.dtype)


def _gmm_call(x, w, group_sizes, transpose_w):
    n = w.shape[1] if transpose_w else w.shape[2]
    call = jax.ffi.ffi_call(_GMM, jax.ShapeDtypeStruct((x.shape[0], n), x.dtype), vmap_method="sequential")
    return call(x, w, group_sizes, transpose_w=bool(transpose_w))


def _gmm_dw_call(a, b, group_sizes, num_experts):
    """dw[g] = a[rows of g]^T @ b[rows of g], (experts, a's K, b's N)."""
    out = jax.ShapeDtypeStruct((num_experts, a.shape[1], b.shape[1]), a.dtype)
    return jax.ffi.ffi_call(_GMM_DW, out, vmap_method="sequential")(a, b, group_sizes)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _gmm_ffi(x, w, group_sizes, transpose_w):
    return _gmm_call(x, w, group_sizes, transpose_w)


def _gmm_fwd(x, w, group_sizes, transpose_w):
    return _gmm_call(x, w, group_sizes, transpose_w), (x, w, group_sizes)


def _gmm_bwd(transpose_w, residuals, dy):
    x, w, group_sizes = residuals
    dy = dy.astype(x.dtype)
    dx = _gmm_call(dy, w, group_sizes, not transpose_w)
    e = w.shape[0]
    dw = _gmm_dw_call(dy, x, group_sizes, e) if transpose_w else _gmm_dw_call(x, dy, group_sizes, e)
    return dx, dw, np.zeros(group_sizes.shape, jax.dtypes.float0)


_gmm_ffi.defvjp(_gmm_fwd, _gmm_bwd)


def grouped_matmul(x, w, group_sizes, *, transpose_w=False):
    """y[rows of group g] = x[rows of group g] @ w[g]; rows past sum(group_sizes) are zero.

    x (rows, K), w (experts, K, N) (or (experts, N, K) used transposed with `transpose_w`), of one
    dtype (f32 or bf16, summed in f32); group g owns the `group_sizes[g]` rows after the groups
    before it. Differentiable in x and w; groups without rows cost nothing and get zero gradient.
    Negative sizes, or sizes summing past x's rows, are an error on CPU; the CUDA kernel, which cannot raise,
    counts a negative size as empty and drops rows past x's.
    """
    _check_gmm(x, w, group_sizes, transpose_w)
    transpose_w = bool(transpose_w)
    cuda = None
    if grouped_matmul_pallas.supported(x, w, transpose_w):
        cuda = lambda x, w, gs, interpret: grouped_matmul_pallas.grouped_matmul_pallas(  # noqa: E731
            x, w, gs, transpose_w=transpose_w, interpret=interpret)
    return platform_dispatch(
        _GMM,
        lambda x, w, gs: _gmm_ffi(x, w, gs, transpose_w),
        lambda x, w, gs: grouped_matmul_reference(x, w, gs, transpose_w=transpose_w),
        x,
        w,
        group_sizes,
        cuda=cuda,
    )


# ---- auxiliary losses --------------------------------------------------------------------------


def load_balancing_loss(router_logits, expert_ids, num_experts: int, mask=None):
    """Switch/Mixtral auxiliary loss, as HF transformers computes it: experts * sum over choices j
    and experts e of (fraction of tokens whose j-th choice is e) * (mean router probability of e).
    k (the choices per token) when routing is uniform. `mask` (tokens,) leaves padding out of both means."""
    probs = jax.nn.softmax(router_logits.reshape(-1, num_experts).astype(jnp.float32), axis=-1)
    chosen = jax.nn.one_hot(expert_ids.reshape(probs.shape[0], -1), num_experts, dtype=jnp.float32)
    m = jnp.ones((probs.shape[0],), jnp.float32) if mask is None else mask.reshape(-1).astype(jnp.float32)
    denom = jnp.maximum(jnp.sum(m), 1.0)
    fraction = jnp.einsum("tke,t->ke", chosen, m) / denom
    mean_prob = jnp.einsum("te,t->e", probs, m) / denom
    return num_experts * jnp.sum(fraction * mean_prob[None, :])


def router_z_loss(router_logits, mask=None):
    """ST-MoE's router z-loss: mean over tokens of logsumexp(logits)^2 (keeps router logits small)."""
    z = jax.nn.logsumexp(router_logits.astype(jnp.float32), axis=-1).reshape(-1)
    m = jnp.ones_like(z) if mask is None else mask.reshape(-1).astype(jnp.float32)
    return jnp.sum(z * z * m) / jnp.maximum(jnp.sum(m), 1.0)
