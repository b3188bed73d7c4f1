"""The model runner: turns a scheduled step into fixed-shape arrays and runs two jitted programs.

1. forward: the step's tokens packed into T_b slots (T_b from a small set of token buckets) run
   through the decoder over the paged KV pools, which the program takes donated and gives back.
   Block tables have min(T_b, max_num_seqs) rows and a fixed width (max_model_len / block_size), one table
   per KV group (models/kv_cache.KVLayout: a sliding-window group's blocks are its own).
2. sample: the rows' last hidden states -> logits -> SamplerOutput, for B_b rows (sequence buckets).
3. score_prompt: log-probs of prompt tokens at the forward's rows (a request's `prompt_logprobs`), from
   the same hidden states the step computes anyway: no second pass over the prompt.
4. decode_loop: up to `decode_steps` decode steps of one token per row (T_b rows) in one program,
   each feeding the tokens it samples to the next, for multi-step scheduling: one dispatch and one
   host round trip for several tokens. It turns as often as the longest row's limit asks (a
   dynamic trip count, so one program serves every limit); a row past its limit writes nothing.

So the set of shapes, and of compiled programs, is fixed by the engine's configuration; each new
program is logged and counted, and weights swap in place (same shapes and dtypes, no recompile).
Every program runs the model on batch-invariant kernels (models/batch_invariant.py): a request's tokens
and log-probs do not depend on the requests sharing its steps, nor on how its prompt was chunked.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tunix_rt.engine.params import MAX_LOGPROBS
from tunix_rt.engine.program_store import Programs, ProgramStore, canonical
from tunix_rt.engine.sampler import SAMPLING_EPS, SamplerOutput, SamplingTensors, log_softmax, sample_tokens
from tunix_rt.engine.scheduler import ScheduledRequest
from tunix_rt.engine.structured import GrammarCompiler
from tunix_rt.models.array_reuse import ReuseByIdentity
from tunix_rt.models.batch_invariant import use_batch_invariant_kernels
from tunix_rt.models.decoder import Decoder, head_logits
from tunix_rt.models.fused_projections import FusedWeights
from tunix_rt.models.kv_cache import KVLayout, PagedKVCache
from tunix_rt.models.multi_lora import MultiLoRALinear, set_adapter_ids
from tunix_rt.models.vision import ImageTokens
from tunix_rt.ops.paged_attention import empty_kv_cache
from tunix_rt.ops.quant import QuantizedTensor, lane_scales

log = logging.getLogger(__name__)


def buckets(smallest: int, largest: int) -> tuple[int, ...]:
    """Powers of two from `smallest`, capped by (and ending with) `largest`."""
    out, size = [], smallest
    while size < largest:
        out.append(size)
        size *= 2
    return (*out, largest)


def _fit(n: int, sizes: tuple[int, ...]) -> int:
    return next(s for s in sizes if s >= n)


_SCORE_CHUNK = 16  # prompt rows per call of score_prompt (long prompts' chunks are short on a server)


def _compile_step(graphdef, treedef, head_def, head_treedef, config, layout, block_size, processed_logprobs, adapters):
    """The jitted programs with the model's structure closed over: a static graphdef argument would be
    hashed on every call, and flat weight leaves skip pytree flattening. With `adapters` (a model with LoRA
    adapter slots) the forward and the decode loop take each token's (row's) adapter slot. The sampler takes only the
    output head's leaves (every leaf passed costs dispatch time on each step) and the sampled rows'
    hidden states, gathered by a program of their own: the sampler, whose compile is the costly one,
    then has one program per row bucket rather than one per (token bucket, row bucket) pair."""

    def merged(leaves, lora_ids):
        model = use_batch_invariant_kernels(nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves)))
        model.layers.read_in_place = True  # never differentiated: the kernels index the stacked weights
        if adapters:
            set_adapter_ids(model, lora_ids)
        return model

    @functools.partial(jax.jit, donate_argnums=(1, 2))
    def forward(leaves, k, v, tokens, positions, slots, token_seq, block_tables, lora_ids, images):
        """`images`: None for a text-only model; else (is_image (T,), soft tokens (T, D), attend_until (T,))."""
        model = merged(leaves, lora_ids)
        cache = PagedKVCache(k, v, slots, token_seq, block_tables, layout)
        image_tokens = None if images is None else ImageTokens(*(a[None] for a in images))
        h, cache = model.hidden_states(tokens[None], positions[None], cache, image_tokens=image_tokens)
        return h[0], cache.k, cache.v, _nonfinite_rows(h[0], token_seq, block_tables.shape[1])

    @jax.jit
    def encode_image(leaves, pixel_values):
        """One image's soft tokens (1, M, D) f32, through the batch-invariant kernels as the decoder's are."""
        return use_batch_invariant_kernels(nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves))).vision(
            pixel_values)

    @jax.jit
    def take_rows(hidden, rows):
        return hidden[rows]

    def output_head(head_leaves):
        return use_batch_invariant_kernels(nnx.merge(head_def, jax.tree.unflatten(head_treedef, head_leaves)))

    @functools.partial(jax.jit, static_argnums=(5, 8))
    def sample(head_leaves, hidden_rows, params, prompt_tokens, output_tokens, num_top_logprobs, bitmask,
               logit_bias, all_greedy):
        logits = head_logits(config, output_head(head_leaves), hidden_rows)
        return sample_tokens(logits, params, prompt_tokens, output_tokens, num_top_logprobs=num_top_logprobs,
                             bitmask=bitmask, logit_bias=logit_bias, processed_logprobs=processed_logprobs,
                             all_greedy=all_greedy)

    @functools.partial(jax.jit, static_argnums=3)
    def score_prompt(head_leaves, hidden_rows, targets, num_top_logprobs):
        """log p(targets[i] | the tokens up to hidden row i) and the top k, for one chunk of _SCORE_CHUNK rows:
        one program whatever the step's size (a whole step's logits would be tokens x vocab floats at once)."""
        logprobs = log_softmax(head_logits(config, output_head(head_leaves), hidden_rows))
        token = jnp.take_along_axis(logprobs, targets[:, None], axis=-1)[:, 0]
        rank = 1 + jnp.sum(logprobs > token[:, None], axis=-1, dtype=jnp.int32)
        if not num_top_logprobs:
            rows = hidden_rows.shape[0]
            return token, rank, jnp.zeros((rows, 0), jnp.int32), jnp.zeros((rows, 0), jnp.float32)
        top_logprobs, top_ids = jax.lax.top_k(logprobs, num_top_logprobs)
        return token, rank, top_ids.astype(jnp.int32), top_logprobs

    @functools.partial(jax.jit, donate_argnums=(1, 2), static_argnums=(9, 11))
    def decode_loop(leaves, k, v, tokens, positions, token_seq, block_tables, limits, params, max_steps, lora_ids,
                    all_greedy):
        model = merged(leaves, lora_ids)
        head = model.output_head()
        rows = tokens.shape[0]
        table_rows = jnp.maximum(token_seq, 0)
        last_block = block_tables.shape[2] - 1
        outs = SamplerOutput(jnp.zeros((max_steps, rows), jnp.int32), jnp.zeros((max_steps, rows), jnp.float32),
                             jnp.zeros((max_steps, rows, 0), jnp.int32), jnp.zeros((max_steps, rows, 0), jnp.float32))

        def one_step(i, carry):
            k, v, tok, pos, outs, bad = carry
            live = i < limits
            block = block_tables[:, table_rows, jnp.minimum(pos // block_size, last_block)]  # (G, rows)
            cache = PagedKVCache(k, v, jnp.where(live, block * block_size + pos % block_size, -1),
                                 jnp.where(live, token_seq, -1), block_tables, layout)
            h, cache = model.hidden_states(tok[None], pos[None], cache)
            # No penalties here (Scheduler._multi_step keeps rows with any out of the loop).
            out = sample_tokens(head_logits(config, head, h[0]), dataclasses.replace(params, step=params.step + i),
                                None, None, num_top_logprobs=0, processed_logprobs=processed_logprobs,
                                all_greedy=all_greedy)
            outs = jax.tree.map(lambda buf, new: buf.at[i].set(new), outs, out)
            bad = bad | (live & ~jnp.all(jnp.isfinite(h[0]), axis=-1))
            return cache.k, cache.v, out.tokens, pos + live, outs, bad

        # As many turns as the longest limit needs (at most max_steps): no turn runs for nothing.
        k, v, _, _, outs, bad = jax.lax.fori_loop(0, jnp.max(limits), one_step,
                                                  (k, v, tokens, positions, outs, jnp.zeros(rows, bool)))
        return outs, k, v, bad

    @functools.partial(jax.jit, static_argnums=(0, 1))
    def empty_cache(shape, dtype):
        """The K and V pools, their pages untouched (ops.paged_attention.empty_kv_cache): a program of the store
        like the others (a bare op would trace, lower and look up a program of its own on every engine start, ~40 ms
        of a warm `generate`)."""
        return empty_kv_cache(shape, dtype)

    return {"forward": (forward, ()), "encode_image": (encode_image, ()), "rows": (take_rows, ()),
            "sample": (sample, (5, 8)),
            "empty_cache": (empty_cache, (0, 1)),
            "score_prompt": (score_prompt, (3,)), "decode_loop": (decode_loop, (9, 11))}


def _all_greedy(scheduled: list[ScheduledRequest]) -> bool:
    """Whether every row of the step is greedy: its sampler then compiles without the draw."""
    return all(s.request.params.temperature < SAMPLING_EPS for s in scheduled)


def _sample_key(b_b: int, history, num_top: int, bitmask, logit_bias, all_greedy: bool) -> tuple:
    """What a sampler program is compiled for: row bucket, penalty history width (0: none), top-k log-probs,
    grammar mask, logit-bias width, greedy only."""
    return ("sample", b_b, 0 if history is None else history.shape[1], num_top, bitmask is not None,
            0 if logit_bias is None else logit_bias[0].shape[1], all_greedy)


def _loop_key(t_b: int, steps: int, all_greedy: bool) -> tuple:
    """What a decode loop program is compiled for: rows (a token bucket), steps per call, greedy only."""
    return ("decode_loop", t_b, steps, all_greedy)


def _nonfinite_rows(hidden: jax.Array, token_seq: jax.Array, num_seqs: int) -> jax.Array:
    """(num_seqs,) True for each sequence any of whose tokens' hidden states hold a NaN or inf this step: its
    K/V is not fit to share (engine: such a request ends with finish_reason "error", its blocks uncached)."""
    bad_token = ~jnp.all(jnp.isfinite(hidden), axis=-1)
    seq = jnp.where(token_seq >= 0, token_seq, num_seqs)
    return jnp.zeros(num_seqs, bool).at[seq].max(bad_token, mode="drop")


@dataclasses.dataclass(frozen=True)
class PromptLogprobs:
    """One scheduled request's prompt log-probs from a step: positions[i]'s token given those before it."""

    positions: np.ndarray  # (R,) prompt positions, each >= 1
    logprobs: np.ndarray  # (R,)
    ranks: np.ndarray  # (R,) the token's rank in its distribution, 1 = the most likely
    top_ids: np.ndarray  # (R, K)
    top_logprobs: np.ndarray


@dataclasses.dataclass(frozen=True)
class StepResult:
    tokens: np.ndarray  # (steps, B): each step's token for each scheduled request, in order
    logprobs: np.ndarray  # (steps, B)
    top_ids: np.ndarray  # (steps, B, K)
    top_logprobs: np.ndarray
    nonfinite: np.ndarray  # (B,) True where a request's step produced a NaN or inf (its results are void)
    prompt_logprobs: dict[int, PromptLogprobs] = dataclasses.field(default_factory=dict)  # by scheduled index


class _LaneScales:
    """The engine's copy of the weights gives each quantized one its column-lane scales, laid out once
    rather than by the GEMV on every decode step. A weight update whose packed weights are the arrays the
    engine already holds (an RL step training LoRA adapters or float layers) reuses their lanes."""

    def __init__(self):
        self._reuse = ReuseByIdentity()

    def apply(self, state: nnx.State) -> nnx.State:
        is_quantized = lambda v: isinstance(v, QuantizedTensor)
        with self._reuse.sweep() as reuse:
            def lay_out(qt: QuantizedTensor) -> QuantizedTensor:
                return dataclasses.replace(qt, lanes=reuse((qt.scales, qt.mins), lambda: lane_scales(qt)))

            return jax.tree.map(lambda v: lay_out(v) if is_quantized(v) else v, state, is_leaf=is_quantized)


class ModelRunner:
    def __init__(self, model: Decoder, *, layout: KVLayout, block_size: int, max_num_seqs: int,
                 max_num_batched_tokens: int, max_model_len: int, grammars: GrammarCompiler | None = None,
                 token_buckets: tuple[int, ...] | None = None, decode_steps: int = 1,
                 processed_logprobs: bool = False, max_drafts: int = 0, max_speculating: int = 0):
        # the structure, shapes and dtypes update_weights' states come in (checked before anything is made of them)
        self._source_graphdef, source = nnx.split(model)
        source_leaves, self._source_treedef = jax.tree_util.tree_flatten(source)
        self._source_specs = [(leaf.shape, leaf.dtype) for leaf in source_leaves]
        self._fused = FusedWeights()
        self.graphdef, state = nnx.split(self._fused.apply(self._source_graphdef, source))
        self._lane_scales = _LaneScales()
        self.leaves, self.treedef = jax.tree.flatten(self._lane_scales.apply(state))
        head_def, head_state = nnx.split(model.output_head())
        self.head_leaves, head_treedef = jax.tree.flatten(head_state)
        closed_over = (self.graphdef, self.treedef, head_def, head_treedef, model.config, layout, block_size,
                       processed_logprobs, any(isinstance(m, MultiLoRALinear) for _, m in nnx.iter_modules(model)))
        self._programs = Programs(_compile_step(*closed_over), "\n".join(map(canonical, closed_over)),
                                  ProgramStore.beside_compile_cache())
        self.decode_steps = decode_steps
        cfg = model.config
        self.layout = layout
        self.cache_shape = (layout.total_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
        self.vocab_size = cfg.vocab_size
        self.dtype = model.dtype
        self.hidden_size = cfg.hidden_size
        self.vision = cfg.vision
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.max_blocks_per_seq = -(-max_model_len // block_size)
        self.token_buckets = buckets(1, max_num_batched_tokens) if token_buckets is None else tuple(token_buckets)
        # rows sampled per step: one per request, and the drafts of the (at most max_speculating) requests with any
        self.max_drafts, self.max_speculating = max_drafts, min(max_speculating, max_num_seqs)
        self.seq_buckets = buckets(1, max_num_seqs + self.max_speculating * max_drafts)
        self.k: jax.Array | None = None  # every layer's pool, layer after layer (models/kv_cache.py)
        self.v: jax.Array | None = None
        self.grammars = grammars
        self.allocate_cache()

    @staticmethod
    def block_bytes(model: Decoder, block_size: int, layers: int | None = None) -> int:
        """K and V bytes of one block of `layers` layers (every layer by default)."""
        c = model.config
        layers = c.num_layers if layers is None else layers
        return 2 * layers * block_size * c.num_kv_heads * c.head_dim * model.dtype.itemsize

    def allocate_cache(self) -> None:
        self.k, self.v = self._programs(("empty_cache", self.cache_shape, self.dtype.name), self.cache_shape, self.dtype)

    def release_cache(self) -> None:
        for buf in (self.k, self.v):
            if buf is not None:
                buf.delete()
        self.k = self.v = None

    def update_weights(self, state: nnx.State) -> None:
        """Swap in new weights of the same structure, shapes and dtypes (so nothing recompiles)."""
        paths_leaves, treedef = jax.tree_util.tree_flatten_with_path(state)
        if treedef != self._source_treedef:
            raise ValueError(f"update_weights: the new weights' structure differs from the engine's model:\n{treedef}\n"
                             f"vs\n{self._source_treedef}")
        for (path, new), (shape, dtype) in zip(paths_leaves, self._source_specs):
            if new.shape != shape or new.dtype != dtype:
                raise ValueError(f"update_weights: {jax.tree_util.keystr(path)} is {new.dtype}{list(new.shape)}, the "
                                 f"engine's model has {dtype}{list(shape)}")
        model = self._fused.apply(self._source_graphdef, state)
        leaves, treedef = jax.tree.flatten(self._lane_scales.apply(nnx.state(model)))
        assert treedef == self.treedef, "the same source structure fuses and lays out the same way"
        self.leaves = leaves
        self.head_leaves = jax.tree.leaves(nnx.state(model.output_head()))

    def replace_leaves(self, updates: dict[int, jax.Array]) -> None:
        """Swap single weight leaves (by index) for arrays of their shape and dtype: the LoRA manager's slot writes."""
        for i, new in updates.items():
            old = self.leaves[i]
            if new.shape != old.shape or new.dtype != old.dtype:
                raise ValueError(f"replace_leaves: leaf {i} is {old.dtype}{list(old.shape)}, got {new.dtype}"
                                 f"{list(new.shape)}")
            self.leaves[i] = new

    def reachable_shapes(self) -> list[tuple[int, int]]:
        """(token bucket, row bucket) pairs a step can land in: each sampled row is one of the step's tokens."""
        return [(t, b) for t in self.token_buckets for b in self.seq_buckets
                if b <= _fit(min(t, self.seq_buckets[-1]), self.seq_buckets)]

    def warmup(self, stop: Callable[[], bool] = lambda: False, *, max_rows: int | None = None,
               greedy: bool = True) -> int:
        """Compile the forward of every token bucket, the row gather of every reachable shape, the plain
        sampler (no penalties, logprobs of the sampled token only, no grammar) of every row bucket, the
        decode loop of every bucket a decode-only step can land in (those two for all-greedy steps and for
        steps that draw), on all-padding steps that write nothing, and the prompt scorer with and without top
        k; returns how many programs that compiled. With `max_rows`, only the programs of steps with at most
        that many rows (1: whatever a lone request of any length needs) and no prompt scorer; with `greedy`
        false, not the all-greedy steps' programs. It ends early, between two compiles, once `stop()` is true;
        a later call goes on where it stopped."""
        compiled = 0  # by this call (another thread may compile meanwhile)
        seqs_cap = self.max_num_seqs if max_rows is None else max_rows
        rows_cap = seqs_cap + min(seqs_cap, self.max_speculating) * self.max_drafts  # speculating requests' drafts too
        variants = (False, True) if greedy else (False,)  # all_greedy of the samplers and decode loops
        decode_buckets = {_fit(n, self.token_buckets) for n in range(1, min(seqs_cap, self.token_buckets[-1]) + 1)}
        for t_b in self.token_buckets:
            pad = np.full(t_b, -1, np.int32)
            groups = self.layout.num_groups
            tables = np.zeros((groups, min(t_b, self.max_num_seqs), self.max_blocks_per_seq), np.int32)
            row_buckets = [b for t, b in self.reachable_shapes() if t == t_b and b <= rows_cap]
            samplers = [_sample_key(b, None, 0, None, None, g) for b in row_buckets for g in variants]
            loops = [_loop_key(t_b, self.decode_steps, g)
                     for g in (variants if self.decode_steps > 1 and t_b in decode_buckets else ())]
            wanted = [("forward", t_b), *(("rows", t_b, b) for b in row_buckets), *samplers, *loops]
            if all(key in self.compiled for key in wanted):
                continue
            if stop():
                return compiled
            compiled += self._is_new(("forward", t_b))
            positions = np.zeros(t_b, np.int32)
            hidden, self.k, self.v, _ = self._programs(("forward", t_b), self.leaves, self.k, self.v,
                                                       np.zeros(t_b, np.int32), positions,
                                                       np.full((groups, t_b), -1, np.int32), pad, tables, pad,
                                                       self._step_images([], t_b, positions))
            for b_b in row_buckets:
                if stop():
                    return compiled
                compiled += self._is_new(("rows", t_b, b_b))
                hidden_rows = self._programs(("rows", t_b, b_b), hidden, np.zeros(b_b, np.int32))
                for all_greedy in variants:
                    key = _sample_key(b_b, None, 0, None, None, all_greedy)
                    if key not in self.compiled and not stop():
                        compiled += self._is_new(key)
                        jax.block_until_ready(self._programs(key, self.head_leaves, hidden_rows,
                                                             SamplingTensors.from_rows([], b_b), None, None, 0, None,
                                                             None, all_greedy))
            for key in loops:
                if stop():
                    return compiled
                compiled += self._is_new(key)
                _, self.k, self.v, _ = self._programs(key, self.leaves, self.k, self.v, np.zeros(t_b, np.int32),
                                                      np.zeros(t_b, np.int32), pad, tables, np.zeros(t_b, np.int32),
                                                      SamplingTensors.from_rows([], t_b), self.decode_steps, pad,
                                                      key[3])
        for num_top in () if max_rows is not None else (0, min(MAX_LOGPROBS, self.vocab_size)):
            if ("score_prompt", num_top) in self.compiled:  # prompt log-probs: the target alone, or with top k
                continue
            if stop():
                break
            compiled += self._is_new(("score_prompt", num_top))
            rows = np.zeros((_SCORE_CHUNK, self.hidden_size), self.dtype)
            jax.block_until_ready(self._programs(("score_prompt", num_top), self.head_leaves, rows,
                                                 np.zeros(_SCORE_CHUNK, np.int32), num_top))
        return compiled

    def warmup_options(self, stop: Callable[[], bool] = lambda: False) -> int:
        """Compile the sampler programs a request's options pick, for every row bucket, all-greedy and drawing:
        top-k log-probs, logit_bias (min_tokens' ban too), penalties, a grammar's bitmask (a step with any of them decodes one
        token at a time, so no decode loop needs them). They are pure programs run on dummy rows (this may run
        beside the engine's steps); a server compiles them while its engine is idle (Engine.warmup(options=True)),
        so a request's first use compiles only if it comes before the warm-up gets there. Returns how many
        programs it compiled."""
        compiled = 0  # by this call (another thread may compile meanwhile)
        top = min(MAX_LOGPROBS, self.vocab_size)
        for b_b in self.seq_buckets:
            rows = np.zeros((b_b, self.hidden_size), self.dtype)
            params = SamplingTensors.from_rows([], b_b)
            full = np.full((b_b, self.max_model_len), -1, np.int32)
            mask = np.full((b_b, -(-self.vocab_size // 32)), -1, np.int32)
            bias = (np.full((b_b, 8), -1, np.int32), np.zeros((b_b, 8), np.float32))
            for (hist, num_top, bitmask, logit_bias), all_greedy in itertools.product(
                    ((None, top, None, None), (None, 0, None, bias), (full, 0, None, None), (None, 0, mask, None)),
                    (False, True)):
                key = _sample_key(b_b, hist, num_top, bitmask, logit_bias, all_greedy)
                if key in self.compiled:
                    continue
                if stop():
                    return compiled
                compiled += self._is_new(key)
                jax.block_until_ready(self._programs(key, self.head_leaves, rows, params, hist, hist, num_top, bitmask,
                                                   logit_bias, all_greedy))
        return compiled

    @property
    def compiled(self):
        """The keys of the programs made so far (compiled or loaded from the program store)."""
        return self._programs.keys()

    def program_text(self, key: tuple) -> str:
        """The optimized HLO of the program `key` (one of `compiled`), e.g. to name a profile's ops."""
        return self._programs.text(key)

    def _is_new(self, key: tuple) -> int:
        """1 when the program `key` is yet to be made (it is, when it runs next), else 0."""
        return int(key not in self._programs.keys())

    def encode_image(self, pixel_values: np.ndarray) -> np.ndarray:
        """An image's (C, H, W) pixel values -> its soft tokens (M, D) f32 on the host."""
        return np.asarray(self._programs(("encode_image",), self.leaves, pixel_values[None]))[0]

    def _step_images(self, scheduled: list[ScheduledRequest], t_b: int, positions: np.ndarray):
        """The forward's `images` input: which step tokens are an image's, their soft tokens (zeros elsewhere) and
        the last position each token sees (an image's end for its tokens); None for a text-only model."""
        if self.vision is None:
            return None
        is_image = np.zeros(t_b, bool)
        embeds = np.zeros((t_b, self.hidden_size), np.float32)
        until = positions.copy()
        offset = 0
        for s in scheduled:
            for image in s.request.images:
                lo, hi = max(s.start, image.start), min(s.start + s.num_new, image.end)
                if lo < hi:
                    rows = slice(offset + lo - s.start, offset + hi - s.start)
                    is_image[rows] = True
                    embeds[rows] = image.embeds[lo - image.start:hi - image.start]
                    until[rows] = image.end - 1
            offset += s.num_new
        return is_image, embeds, until

    def execute(self, scheduled: list[ScheduledRequest], block_lists: Sequence[dict[str, list[int]]]) -> StepResult:
        """Run one step; block_lists[g] maps each sequence to its blocks in KV group g (the KV manager's tables;
        -1: a block freed outside a sliding window, which no token reads). A request with drafts is sampled at
        its last token and at each draft (StepResult's steps axis, as a decode loop's)."""
        num_tokens = sum(s.num_new for s in scheduled)
        t_b = _fit(num_tokens, self.token_buckets)
        table_rows = min(t_b, self.max_num_seqs)
        tokens = np.zeros(t_b, np.int32)
        positions = np.zeros(t_b, np.int32)
        groups = self.layout.num_groups
        slots = np.full((groups, t_b), -1, np.int32)
        token_seq = np.full(t_b, -1, np.int32)
        lora_ids = np.full(t_b, -1, np.int32)  # each token's adapter slot, -1 = the base model
        tables = np.zeros((groups, table_rows, self.max_blocks_per_seq), np.int32)
        sampled = []  # the step's rows that are sampled: each request's last token, and its drafts
        bs = self.block_size
        offset = 0
        for i, s in enumerate(scheduled):
            req, n = s.request, s.num_new
            pos = np.arange(s.start, s.start + n, dtype=np.int32)
            for g, lists in enumerate(block_lists):
                blocks = np.maximum(np.asarray(lists[req.seq_id], np.int32), 0)
                slots[g, offset:offset + n] = blocks[pos // bs] * bs + pos % bs
                tables[g, i, :len(blocks)] = blocks
            tokens[offset:offset + n] = [*req.all_token_ids[s.start:s.start + n - len(s.draft)], *s.draft]
            positions[offset:offset + n] = pos
            token_seq[offset:offset + n] = i
            lora_ids[offset:offset + n] = req.lora_slot
            offset += n
            sampled.extend(range(offset - 1 - len(s.draft), offset))
        if any(s.limit > 1 and not s.draft for s in scheduled):
            return self._run_decode_loop(scheduled, t_b, tokens, positions, token_seq, tables, lora_ids)
        b_b = _fit(len(sampled), self.seq_buckets)
        rows = np.zeros(b_b, np.int32)
        rows[:len(sampled)] = sampled
        # the request each sampled row belongs to, and the row's place among its samples (0: its last token)
        by_row = [s for s in scheduled for _ in range(1 + len(s.draft))]
        ahead = [j for s in scheduled for j in range(1 + len(s.draft))]
        params, prompt_hist, output_hist, num_top = self._sampling_inputs(by_row, b_b, ahead)
        all_greedy = _all_greedy(scheduled)
        hidden, self.k, self.v, nonfinite = self._programs(("forward", t_b), self.leaves, self.k, self.v, tokens,
                                                           positions, slots, token_seq, tables, lora_ids,
                                                           self._step_images(scheduled, t_b, positions))
        bitmask = self._grammar_masks(by_row, b_b)
        bias = self._logit_biases(by_row, b_b)
        out: SamplerOutput = self._programs(
            _sample_key(b_b, prompt_hist, num_top, bitmask, bias, all_greedy), self.head_leaves,
            self._programs(("rows", t_b, b_b), hidden, rows), params, prompt_hist, output_hist, num_top, bitmask,
            bias, all_greedy)
        prompt_logprobs = self._prompt_logprobs(scheduled, hidden)
        # row j of request i's samples, (steps, requests): a request with fewer repeats its last
        counts = np.asarray([1 + len(s.draft) for s in scheduled])
        first = np.cumsum(counts) - counts
        picks = np.minimum(first[None, :] + np.arange(counts.max())[:, None], (first + counts - 1)[None, :])
        arrays = [np.asarray(a)[picks] for a in (out.tokens, out.logprobs, out.top_ids, out.top_logprobs)]
        return StepResult(*arrays, np.asarray(nonfinite)[:len(scheduled)], prompt_logprobs=prompt_logprobs)

    def _prompt_logprobs(self, scheduled: list[ScheduledRequest], hidden: jax.Array) -> dict[int, PromptLogprobs]:
        """Score the prompt tokens this step's rows predict, for the requests that ask (prompt_logprobs):
        the row at prompt position p predicts token p + 1."""
        wanted, rows, targets, offset = [], [], [], 0
        for i, s in enumerate(scheduled):
            req = s.request
            prompt_len = len(req.prompt_token_ids)
            if req.params.prompt_logprobs is not None and s.start + 1 < prompt_len:
                positions = np.arange(s.start + 1, min(s.start + s.num_new, prompt_len - 1) + 1)
                wanted.append((i, positions, len(rows)))
                rows.extend(offset + positions - 1 - s.start)
                targets.extend(req.prompt_token_ids[p] for p in positions)
            offset += s.num_new
        if not wanted:
            return {}
        num_top = min(MAX_LOGPROBS, self.vocab_size) if any(
            scheduled[i].request.params.prompt_logprobs for i, _, _ in wanted) else 0
        # The scored rows, gathered on the host (the forward's output is there on CPU), go through one
        # program of _SCORE_CHUNK rows per chunk: compiled at warm-up, whatever the step's size.
        rows, targets = np.asarray(rows, np.int64), np.asarray(targets, np.int32)
        hidden = np.asarray(hidden)
        pad = -len(rows) % _SCORE_CHUNK
        rows, targets = np.pad(rows, (0, pad)), np.pad(targets, (0, pad))
        chunks = [self._programs(("score_prompt", num_top), self.head_leaves, hidden[rows[c:c + _SCORE_CHUNK]],
                                 targets[c:c + _SCORE_CHUNK], num_top) for c in range(0, len(rows), _SCORE_CHUNK)]
        out = [np.concatenate([np.asarray(chunk[k]) for chunk in chunks]) for k in range(4)]
        return {i: PromptLogprobs(positions, *(a[at:at + len(positions)] for a in out))
                for i, positions, at in wanted}

    def _logit_biases(self, scheduled: list[ScheduledRequest], b_b: int) -> tuple[np.ndarray, np.ndarray] | None:
        """The rows' logit_bias as (ids, values) padded to (b_b, M) with M a power of two (at least 8), or None;
        a row short of its min_tokens gets -inf on its stop ids."""
        biases = [{**(s.request.params.logit_bias or {}), **dict.fromkeys(s.request.banned_stop_ids, -np.inf)}
                  for s in scheduled]
        most = max(map(len, biases))
        if not most:
            return None
        width = max(8, 1 << (most - 1).bit_length())
        ids, values = np.full((b_b, width), -1, np.int32), np.zeros((b_b, width), np.float32)
        for i, bias in enumerate(biases):
            ids[i, :len(bias)] = list(bias)
            values[i, :len(bias)] = list(bias.values())
        return ids, values

    def _run_decode_loop(self, scheduled, t_b, tokens, positions, token_seq, tables, lora_ids) -> StepResult:
        """Each request's `limit` decodes of one token per row in one program (rows are the step's tokens)."""
        params, _ = self._sampling_params(scheduled, t_b)  # no top-k log-probs here (Scheduler._multi_step)
        limits = np.zeros(t_b, np.int32)
        limits[:len(scheduled)] = [s.limit for s in scheduled]
        all_greedy = _all_greedy(scheduled)
        out, self.k, self.v, nonfinite = self._programs(_loop_key(t_b, self.decode_steps, all_greedy), self.leaves,
                                                        self.k, self.v, tokens, positions, token_seq, tables, limits,
                                                        params, self.decode_steps, lora_ids, all_greedy)
        n = len(scheduled)
        return StepResult(*(np.asarray(a)[:, :n] for a in (out.tokens, out.logprobs, out.top_ids, out.top_logprobs)),
                          np.asarray(nonfinite)[:n])

    def _grammar_masks(self, scheduled: list[ScheduledRequest], b_b: int) -> np.ndarray | None:
        """Allowed-token bitmasks when a row that samples this step has a grammar, else None."""
        rows = [(s.request.matcher, i) for i, s in enumerate(scheduled) if s.completes and s.request.matcher]
        return self.grammars.fill_masks(rows, b_b) if rows else None

    def _sampling_params(self, scheduled: list[ScheduledRequest], batch: int,
                         ahead: list[int] | None = None) -> tuple[SamplingTensors, int]:
        """The rows' sampling options padded to `batch`, and how many top logprobs the step returns. Row i samples
        its request's output token len(output) + ahead[i] (a draft's row samples where plain decoding would reach
        it later): its draw's key is that step's, so a kept draft's row drew what plain decoding draws there."""
        ahead = ahead or [0] * len(scheduled)
        rows = [dict(temperature=p.temperature, top_k=p.top_k, top_p=p.top_p, min_p=p.min_p,
                     presence_penalty=p.presence_penalty, frequency_penalty=p.frequency_penalty,
                     repetition_penalty=p.repetition_penalty, seed=s.request.seed,
                     step=len(s.request.output_token_ids) + j)
                for s, j in zip(scheduled, ahead) for p in (s.request.params,)]
        wants_top = any(s.request.params.logprobs for s in scheduled)
        return SamplingTensors.from_rows(rows, batch), min(MAX_LOGPROBS, self.vocab_size) if wants_top else 0

    def _sampling_inputs(self, scheduled: list[ScheduledRequest], b_b: int, ahead: list[int]):
        """The sampler's options and the token histories its penalties read (None when no row has any): a draft's
        row counts the drafts before it as output, as plain decoding would have them by then."""
        params, num_top = self._sampling_params(scheduled, b_b, ahead)
        if not any(s.request.params.uses_penalties for s in scheduled):
            return params, None, None, num_top
        prompt_hist = np.full((b_b, self.max_model_len), -1, np.int32)
        output_hist = np.full((b_b, self.max_model_len), -1, np.int32)
        for i, (s, j) in enumerate(zip(scheduled, ahead)):
            if s.request.params.uses_penalties:
                p_ids, o_ids = s.request.prompt_token_ids, [*s.request.output_token_ids, *s.draft[:j]]
                prompt_hist[i, :len(p_ids)] = p_ids
                output_hist[i, :len(o_ids)] = o_ids
        return params, prompt_hist, output_hist, num_top
