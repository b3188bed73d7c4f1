"""The output head fused with its log-softmax: per-token log-probs, entropy and the KL to a teacher from
hidden states, computed over chunks of tokens so no (tokens, vocab) logits tensor exists at once.

Training needs only a few numbers per token from the head (the target's log-prob, the entropy, a KL),
but a dense head materialises f32 logits of (tokens, vocab) and autodiff keeps them, their softmax and
their gradient: 2.1 GB per copy for 8 x 512 tokens of a 128K vocabulary. Here a custom_vjp walks chunks
of `chunk` tokens: the forward keeps only per-token log-sum-exps; the backward recomputes each chunk's
logits, forms d(logits) in closed form and multiplies it straight into dh and (when the head is being
trained) dW. The idea is Liger Kernel's fused linear cross-entropy and Apple's Cut Cross-Entropy.

Both matmuls run at the operands' dtype with f32 sums (bf16 compute gives bf16 products), the log-softmax
in f32. `*_reference` functions are the dense computation with the same signatures; tests compare the two.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.custom_derivatives import SymbolicZero

from tunix_rt.ops._ffi import require_array

_LOGIT_BUDGET = 1 << 23  # logits per chunk (32 MiB in f32): sets the default chunk from the vocabulary size


class _Head(NamedTuple):
    """Static description of one head: how its weight is laid out and its logit soft-cap."""

    transpose_w: bool  # w is (V, D) (a tied embedding) instead of (D, V)
    softcap: float | None


class _Spec(NamedTuple):
    student: _Head
    teacher: _Head | None
    temperature: float  # of log-probs and entropy
    kd_temperature: float  # of the KL (distillation)
    top_k: int  # > 0: the teacher distribution is the softmax of its top_k logits
    entropy: bool
    chunk: int


def default_chunk(vocab: int, tokens: int) -> int:
    """Tokens per chunk: a power of two keeping a chunk's logits near 8M entries, at most the tokens (to 8)."""
    per_budget = max(8, 1 << int(math.log2(max(1, _LOGIT_BUDGET // max(vocab, 1)))))
    return int(min(per_budget, 1024, max(8, -(-tokens // 8) * 8)))


# --- validation -----------------------------------------------------------------------------------------------


def _check_head(op: str, h_name: str, h, w_name: str, w, transpose_w: bool, softcap) -> int:
    """Vocabulary size of a (h, w) pair, or a ValueError naming what does not fit."""
    for name, arr in ((h_name, h), (w_name, w)):
        require_array(op, name, arr)
        if not jnp.issubdtype(arr.dtype, jnp.floating):
            raise ValueError(f"{op}: {name} must be a float array, got {jnp.dtype(arr.dtype)}")
    if h.ndim < 1:
        raise ValueError(f"{op}: {h_name} must have shape (..., D), got a scalar")
    if w.ndim != 2:
        raise ValueError(f"{op}: {w_name} must be 2-D ({'(V, D)' if transpose_w else '(D, V)'}), got shape {w.shape}")
    d = w.shape[1] if transpose_w else w.shape[0]
    if d != h.shape[-1]:
        raise ValueError(f"{op}: {w_name} {w.shape} does not match {h_name}'s hidden size {h.shape[-1]} "
                         f"(transpose_w={transpose_w})")
    if softcap is not None and not (isinstance(softcap, (int, float)) and math.isfinite(softcap) and softcap > 0):
        raise ValueError(f"{op}: softcap must be a finite number > 0 or None, got {softcap!r}")
    return w.shape[0] if transpose_w else w.shape[1]


def _check_targets(op: str, targets, h) -> None:
    require_array(op, "targets", targets)
    if not jnp.issubdtype(targets.dtype, jnp.integer):
        raise ValueError(f"{op}: targets must be an integer array, got {jnp.dtype(targets.dtype)}")
    if tuple(targets.shape) != tuple(h.shape[:-1]):
        raise ValueError(f"{op}: targets shape {tuple(targets.shape)} must equal h shape[:-1] {tuple(h.shape[:-1])}")


def _check_temperature(op: str, name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value) and value > 0):
        raise ValueError(f"{op}: {name} must be a finite number > 0, got {value!r}")


def _check_chunk(op: str, chunk) -> None:
    if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1):
        raise ValueError(f"{op}: chunk must be a positive integer or None, got {chunk!r}")


# --- the dense reference ----------------------------------------------------------------------------------------


def _dense_logits(h, w, head: _Head) -> jax.Array:
    dims = (((h.ndim - 1,), (1 if head.transpose_w else 0,)), ((), ()))
    dtype = jnp.promote_types(h.dtype, w.dtype)
    z = jax.lax.dot_general(h.astype(dtype), w.astype(dtype), dims, preferred_element_type=jnp.float32)
    if head.softcap is not None:
        z = jnp.tanh(z / head.softcap) * head.softcap
    return z


def _pick(x, targets):
    """x[..., targets]; NaN for a target outside the vocabulary."""
    targets = targets.astype(jnp.int32)
    inside = (targets >= 0) & (targets < x.shape[-1])
    picked = jnp.take_along_axis(x, jnp.where(inside, targets, 0)[..., None], axis=-1)[..., 0]
    return jnp.where(inside, picked, jnp.nan)


def _entropy(logp):
    return -jnp.sum(jnp.where(logp > -jnp.inf, jnp.exp(logp) * logp, 0.0), axis=-1)


def _teacher_logp(zt, top_k: int, temperature: float):
    """(log-probs, ids or None) of the teacher at `temperature`: full, or over its top_k logits."""
    if top_k:
        values, ids = jax.lax.top_k(zt, top_k)
        return jax.nn.log_softmax(values / temperature, axis=-1), ids
    return jax.nn.log_softmax(zt / temperature, axis=-1), None


def _kl(log_p, ids, log_q):
    """KL(p || q) per token; with ids, p lives on those entries of q's vocabulary."""
    if ids is not None:
        log_q = jnp.take_along_axis(log_q, ids, axis=-1)
    return jnp.sum(jnp.where(log_p > -jnp.inf, jnp.exp(log_p) * (log_p - log_q), 0.0), axis=-1)


def head_logprobs_reference(h, w, targets, *, transpose_w: bool = False, temperature: float = 1.0,
                            softcap: float | None = None, entropy: bool = False, chunk: int | None = None):
    """Dense `head_logprobs`: the whole (..., V) logits at once (the chunk is ignored)."""
    _check_logprobs(h, w, targets, transpose_w, temperature, softcap, chunk)
    logp = jax.nn.log_softmax(_dense_logits(h, w, _Head(transpose_w, softcap)) / temperature, axis=-1)
    return _pick(logp, targets), (_entropy(logp) if entropy else None)


def head_distill_reference(h, w, teacher_h, teacher_w, targets, *, temperature: float, top_k: int = 0,
                           transpose_w: bool = False, teacher_transpose_w: bool = False, softcap: float | None = None,
                           teacher_softcap: float | None = None, chunk: int | None = None):
    """Dense `head_distill`."""
    _check_distill(h, w, teacher_h, teacher_w, targets, temperature, top_k, transpose_w, teacher_transpose_w,
                   softcap, teacher_softcap, chunk)
    z = _dense_logits(h, w, _Head(transpose_w, softcap))
    zt = jax.lax.stop_gradient(_dense_logits(teacher_h, teacher_w, _Head(teacher_transpose_w, teacher_softcap)))
    log_p, ids = _teacher_logp(zt, top_k, temperature)
    kl = _kl(log_p, ids, jax.nn.log_softmax(z / temperature, axis=-1))
    return kl, _pick(jax.nn.log_softmax(z, axis=-1), targets)


# --- the chunked op ---------------------------------------------------------------------------------------------


def _check_logprobs(h, w, targets, transpose_w, temperature, softcap, chunk) -> int:
    op = "head_logprobs"
    vocab = _check_head(op, "h", h, "w", w, transpose_w, softcap)
    _check_targets(op, targets, h)
    _check_temperature(op, "temperature", temperature)
    _check_chunk(op, chunk)
    return vocab


def _check_distill(h, w, teacher_h, teacher_w, targets, temperature, top_k, transpose_w, teacher_transpose_w,
                   softcap, teacher_softcap, chunk) -> None:
    op = "head_distill"
    vocab = _check_head(op, "h", h, "w", w, transpose_w, softcap)
    teacher_vocab = _check_head(op, "teacher_h", teacher_h, "teacher_w", teacher_w, teacher_transpose_w,
                                teacher_softcap)
    if teacher_vocab != vocab:
        raise ValueError(f"{op}: teacher_w has a vocabulary of {teacher_vocab}, the student's w {vocab}")
    if tuple(teacher_h.shape[:-1]) != tuple(h.shape[:-1]):
        raise ValueError(f"{op}: teacher_h shape[:-1] {tuple(teacher_h.shape[:-1])} must equal h shape[:-1] "
                         f"{tuple(h.shape[:-1])}")
    _check_targets(op, targets, h)
    _check_temperature(op, "temperature", temperature)
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 0 <= top_k <= vocab:
        raise ValueError(f"{op}: top_k must be an integer in [0, {vocab}] (0: the full distribution), got {top_k!r}")
    _check_chunk(op, chunk)


def head_logprobs(h, w, targets, *, transpose_w: bool = False, temperature: float = 1.0,
                  softcap: float | None = None, entropy: bool = False, chunk: int | None = None):
    """log p(target) (and the entropy, with `entropy`) under softmax(logits / temperature), f32, shape h.shape[:-1].

    logits = h @ w (w (D, V)), or h @ w.T with transpose_w (w (V, D), a tied embedding), then
    softcap * tanh(logits / softcap) when softcap is set (Gemma 2). A target outside [0, V) gives NaN.
    """
    vocab = _check_logprobs(h, w, targets, transpose_w, temperature, softcap, chunk)
    spec = _Spec(_Head(transpose_w, None if softcap is None else float(softcap)), None, float(temperature),
                 float(temperature), 0, entropy, chunk or default_chunk(vocab, _tokens(h)))
    logp, ent, _ = _run(spec, h, w, targets, None, None)
    return logp, (ent if entropy else None)


def head_distill(h, w, teacher_h, teacher_w, targets, *, temperature: float, top_k: int = 0,
                 transpose_w: bool = False, teacher_transpose_w: bool = False, softcap: float | None = None,
                 teacher_softcap: float | None = None, chunk: int | None = None):
    """(KL(teacher_T || student_T), student log p(target) at temperature 1) per token, f32.

    The teacher's logits come from (teacher_h, teacher_w) chunk by chunk beside the student's and are
    never differentiated; with top_k the teacher distribution is the softmax over its k largest logits
    and the student's log-probs (over the full vocabulary) are read at those ids.
    """
    _check_distill(h, w, teacher_h, teacher_w, targets, temperature, top_k, transpose_w, teacher_transpose_w,
                   softcap, teacher_softcap, chunk)
    vocab = w.shape[0] if transpose_w else w.shape[1]
    cap = lambda c: None if c is None else float(c)
    spec = _Spec(_Head(transpose_w, cap(softcap)), _Head(teacher_transpose_w, cap(teacher_softcap)), 1.0,
                 float(temperature), top_k, False, chunk or default_chunk(vocab, _tokens(h)))
    logp, _, kl = _run(spec, h, w, targets, jax.lax.stop_gradient(teacher_h), jax.lax.stop_gradient(teacher_w))
    return kl, logp


def _tokens(h) -> int:
    return int(np.prod(h.shape[:-1], dtype=np.int64))


def _run(spec: _Spec, h, w, targets, teacher_h, teacher_w):
    """Flatten the leading axes, pad to whole chunks, run the custom_vjp core, cut back."""
    lead, n = h.shape[:-1], _tokens(h)
    chunks = max(1, -(-n // spec.chunk))
    pad = chunks * spec.chunk - n

    def split(x):
        x = x.reshape(n, *x.shape[len(lead):])
        return jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1)).reshape(chunks, spec.chunk, *x.shape[1:])

    outs = _core(spec, split(h), w, split(targets), None if teacher_h is None else split(teacher_h), teacher_w)
    return tuple(o.reshape(-1)[:n].reshape(lead) for o in outs)


def _chunk_forward(spec: _Spec, w, teacher_w, h_c, t_c, th_c):
    """One chunk: ((logp, entropy, kl), (log-sum-exp at temperature, at the KL's temperature))."""
    z = _dense_logits(h_c, w, spec.student)
    s = z / spec.temperature
    lse = jax.nn.logsumexp(s, axis=-1)
    logp_all = s - lse[:, None]
    logp = _pick(logp_all, t_c)
    zeros = jnp.zeros_like(lse)
    ent = _entropy(logp_all) if spec.entropy else zeros
    if spec.teacher is None:
        return (logp, ent, zeros), (lse, zeros)
    log_p, ids = _teacher_logp(_dense_logits(th_c, teacher_w, spec.teacher), spec.top_k, spec.kd_temperature)
    s_kd = z / spec.kd_temperature
    lse_kd = jax.nn.logsumexp(s_kd, axis=-1)
    return (logp, ent, _kl(log_p, ids, s_kd - lse_kd[:, None])), (lse, lse_kd)


def _forward(spec: _Spec, h, w, targets, teacher_h, teacher_w):
    return jax.lax.map(lambda xs: _chunk_forward(spec, w, teacher_w, *xs), (h, targets, teacher_h))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _core(spec: _Spec, h, w, targets, teacher_h, teacher_w):
    return _forward(spec, h, w, targets, teacher_h, teacher_w)[0]


def _core_fwd(spec: _Spec, h, w, targets, teacher_h, teacher_w):
    values = [None if a is None else a.value for a in (h, w, targets, teacher_h, teacher_w)]
    outs, lses = _forward(spec, *values)
    # The head's weight gradient is formed only when w is being differentiated (not under LoRA, whose
    # head is frozen): None in its place tells the backward so.
    w_grad = values[1] if w.perturbed else None
    return outs, (*values, *lses, outs[1], w_grad)


def _core_bwd(spec: _Spec, res, cotangents):
    h, w, targets, teacher_h, teacher_w, lse, lse_kd, ent, w_grad = res
    g_logp, g_ent, g_kl = (None if isinstance(g, SymbolicZero) else g for g in cotangents)
    dtype = jnp.promote_types(h.dtype, w.dtype)
    vocab = w.shape[0] if spec.student.transpose_w else w.shape[1]

    def one(dw, xs):
        h_c, t_c, th_c, lse_c, lse_kd_c, ent_c, gl, ge, gk = xs
        z = _dense_logits(h_c, w, spec.student)
        logp_all = z / spec.temperature - lse_c[:, None]
        p = jnp.exp(logp_all)
        ds = jnp.zeros_like(z)
        if gl is not None:  # d log p(t) / ds = onehot(t) - p
            ds = ds + gl[:, None] * (jax.nn.one_hot(t_c, vocab, dtype=z.dtype) - p)
        if ge is not None and spec.entropy:  # dH / ds = -p (log p + H)
            ds = ds - ge[:, None] * jnp.where(p > 0, p * (logp_all + ent_c[:, None]), 0.0)
        dz = ds / spec.temperature
        if gk is not None and spec.teacher is not None:  # dKL / dz = (q_T - p_teacher) / T
            log_p, ids = _teacher_logp(_dense_logits(th_c, teacher_w, spec.teacher), spec.top_k, spec.kd_temperature)
            p_teacher = jnp.exp(log_p)
            if ids is not None:
                p_teacher = jnp.zeros_like(z).at[jnp.arange(z.shape[0])[:, None], ids].set(p_teacher)
            q = jnp.exp(z / spec.kd_temperature - lse_kd_c[:, None])
            dz = dz + gk[:, None] * (q - p_teacher) / spec.kd_temperature
        if spec.student.softcap is not None:  # z = c tanh(u / c): dz/du = 1 - (z / c)^2
            dz = dz * (1.0 - jnp.square(z / spec.student.softcap))
        dz = dz.astype(dtype)
        w_axis = 0 if spec.student.transpose_w else 1  # w's vocabulary axis
        dh_c = jax.lax.dot_general(dz, w.astype(dtype), (((1,), (w_axis,)), ((), ())),
                                   preferred_element_type=jnp.float32).astype(h.dtype)
        if dw is not None:
            operands = (dz, h_c.astype(dtype)) if spec.student.transpose_w else (h_c.astype(dtype), dz)
            dw = dw + jax.lax.dot_general(*operands, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32)
        return dw, dh_c

    dw0 = None if w_grad is None else jnp.zeros(w.shape, jnp.float32)
    dw, dh = jax.lax.scan(one, dw0, (h, targets, teacher_h, lse, lse_kd, ent, g_logp, g_ent, g_kl))
    return dh, (None if dw is None else dw.astype(w.dtype)), None, None, None


_core.defvjp(_core_fwd, _core_bwd, symbolic_zeros=True)
