"""The rollout engine: continuous batching over a paged KV cache, embedded in-process.

Four parts with one job each: the KV manager (blocks, prefix cache), the scheduler (who runs this
step, how many tokens), the runner (fixed-shape jitted forward + sampler) and the requests
(tokens, detokenized text, stop rules). `step()` is one turn of the loop; `generate` and `stream`
drive it, `AsyncEngine` (async_engine.py) drives it from a thread for the server.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import logging
import os
from collections.abc import Callable, Iterator, Sequence

import numpy as np
from flax import nnx

from tunix_rt.engine.compile_cache import ensure_compile_cache
from tunix_rt.engine.config import EngineConfig
from tunix_rt.engine.detokenizer import IncrementalDetokenizer
from tunix_rt.engine.draft_model import DraftModelProposer
from tunix_rt.engine.errors import (
    ContextLengthExceededError,
    DuplicateRequestIdError,
    EngineUnavailableError,
    InvalidPromptError,
    InvalidRequestError,
    RequestTooLargeError,
)
from tunix_rt.engine.kv_cache_manager import HybridKVCacheManager, KVCacheManager
from tunix_rt.engine.lora_manager import Adapter, LoRAManager, LoRARequest
from tunix_rt.engine.params import RequestOutput, SamplingParams
from tunix_rt.engine.request import Request, RequestImage, Status
from tunix_rt.engine.runner import ModelRunner
from tunix_rt.engine.scheduler import Scheduler
from tunix_rt.engine.speculative import NgramProposer, Proposer, SpeculativeConfig
from tunix_rt.engine.structured import GrammarCompiler
from tunix_rt.models.decoder import Decoder
from tunix_rt.models.kv_cache import KVLayout
from tunix_rt.models.lora import has_lora
from tunix_rt.models.multi_lora import with_adapter_slots
from tunix_rt.models.vision import image_spans

log = logging.getLogger(__name__)
_ENCODED_IMAGES = 64  # images whose soft tokens the engine keeps, so a repeated image is not encoded again

Prompt = str | Sequence[int]


@dataclasses.dataclass(frozen=True)
class EngineStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float  # fraction of blocks held by requests
    prefix_cache_queries: int  # prompt tokens looked up
    prefix_cache_hits: int  # of which served from cached blocks
    prefix_cache_hit_rate: float
    num_preemptions: int
    num_compiles: int  # distinct programs compiled or loaded so far: the steps' and the empty KV pools'
    prompt_tokens: int  # totals since start
    generation_tokens: int
    num_blocks: int
    block_size: int
    spec_draft_tokens: int = 0  # speculative decoding: drafts proposed, and of them accepted by the target
    spec_accepted_tokens: int = 0


class Engine:
    def __init__(self, model: Decoder | str | os.PathLike | None = "default", tokenizer=None,
                 config: EngineConfig | None = None, *, dequantize: bool = False, **options):
        """`config` sizes the engine (engine/config.py); keyword `options` replace its fields one by one
        (`Engine(model, tok, max_num_seqs=8)`). A model path or "default" is loaded (packed weights stay
        packed unless `dequantize`). The engine's programs go to the persistent compilation cache
        (engine/compile_cache.py) unless the process chose otherwise (`use_compile_cache(None)` turns it off)."""
        unknown = sorted(set(options) - {f.name for f in dataclasses.fields(EngineConfig)})
        if unknown:
            raise ValueError(f"Engine: unknown option(s) {', '.join(unknown)} (EngineConfig's fields are the options)")
        config = dataclasses.replace(config or EngineConfig(), **options)
        ensure_compile_cache()
        if not isinstance(model, Decoder):
            from tunix_rt.checkpoints.loader import load_model

            loaded = load_model(model, dequantize=dequantize)
            model, tokenizer = loaded.model, tokenizer or loaded.tokenizer
        cfg = model.config
        max_model_len = config.max_model_len or min(cfg.max_position_embeddings, 4096)
        block_size, max_num_seqs = config.block_size, config.max_num_seqs
        self.config = config
        spec = config.speculative_config
        layout = self._kv_layout(model, max_model_len)
        if config.max_loras:  # the engine's copy gets adapter slots; the caller's model stays as it is
            if has_lora(model):
                raise ValueError("Engine: a model with LoRA layers cannot take adapter slots (max_loras): merge its "
                                 "adapter first (merge_lora), or serve it as one of the engine's adapters")
            model = with_adapter_slots(model, slots=config.max_loras, rank=config.max_lora_rank)
        self.model = model
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.kv = HybridKVCacheManager(
            [KVCacheManager(n, block_size, config.enable_prefix_caching, window=w)
             for n, w in zip(layout.blocks, layout.windows)],
            [layout.group_layers(g) for g in range(layout.num_groups)])
        eos = tokenizer.eos_token_ids if tokenizer is not None else ()
        self.grammars = GrammarCompiler(tokenizer, cfg.vocab_size, eos)
        self.runner = ModelRunner(model, layout=layout, block_size=block_size, max_num_seqs=max_num_seqs,
                                  max_num_batched_tokens=config.max_num_batched_tokens, max_model_len=max_model_len,
                                  grammars=self.grammars, token_buckets=config.token_buckets,
                                  decode_steps=config.decode_steps,
                                  processed_logprobs=config.logprobs_mode == "processed_logprobs",
                                  max_drafts=spec.num_speculative_tokens if spec else 0,
                                  max_speculating=(spec.disable_by_batch_size or max_num_seqs) if spec else 0)
        self.loras = (LoRAManager(model, self.runner, slots=config.max_loras, rank=config.max_lora_rank,
                                  max_registered=config.max_cpu_loras) if config.max_loras else None)
        self.proposer = None if spec is None else self._proposer(spec, max_model_len)
        self.scheduler = Scheduler(self.kv, max_num_seqs=max_num_seqs,
                                   max_num_batched_tokens=config.max_num_batched_tokens,
                                   decode_steps=config.decode_steps, loras=self.loras,
                                   long_prefill_token_threshold=config.long_prefill_token_threshold,
                                   max_model_len=max_model_len, proposer=self.proposer)
        self.eos_token_ids = frozenset(eos)
        self._requests: dict[str, list[Request]] = {}
        self._ids = itertools.count()
        self._seeds = np.random.default_rng(config.seed)
        self._prompt_tokens = 0
        self._encoded: dict[str, np.ndarray] = {}  # images' soft tokens by digest, the most recent last
        log.info("engine: KV blocks of %d tokens per group %s (windows %s; %.0f MiB), max_model_len %d", block_size,
                 layout.blocks, layout.windows, layout.total_blocks * ModelRunner.block_bytes(model, block_size, 1)
                 / 2**20, max_model_len)

    def _step_tokens(self) -> int:
        """The most tokens one request adds in a step: a chunk, a decode loop, or a decode with its drafts."""
        c, spec = self.config, self.config.speculative_config
        return max(c.max_num_batched_tokens, c.decode_steps, 1 + (spec.num_speculative_tokens if spec else 0))

    def _kv_layout(self, model: Decoder, max_model_len: int) -> KVLayout:
        """The KV groups' block counts. A sliding-window group (unless disable_hybrid_kv_cache_manager): each of
        max_num_seqs requests' window and a partial block, plus one step's tokens shared by all of them, but no
        more than the all-global layout gives a layer; the full group: num_kv_blocks, or what kv_cache_memory
        holds beside the windows (no more than max_num_seqs full-length sequences could ever use)."""
        c, cfg, bs = self.config, model.config, self.config.block_size
        per_seq = -(-max_model_len // bs)
        layer_bytes = ModelRunner.block_bytes(model, bs, 1)
        all_global = c.num_kv_blocks or min(c.kv_cache_memory // (layer_bytes * cfg.num_layers), c.max_num_seqs * per_seq)
        if all_global < 1:
            raise ValueError(f"Engine: the KV cache needs at least one block of {bs} tokens per layer, got "
                             f"{all_global} (raise kv_cache_memory or num_kv_blocks)")
        window_blocks = None
        if not c.disable_hybrid_kv_cache_manager:
            step = max(c.max_num_batched_tokens, c.max_num_seqs * c.decode_steps)  # the most tokens one step adds
            window_blocks = lambda w: min(c.max_num_seqs * (-(-(w - 1) // bs) + 2) + -(-step // bs), all_global)
        num_blocks = c.num_kv_blocks
        if num_blocks is None:
            windowed = KVLayout.of(cfg, 0, window_blocks)
            full_layers = sum(1 for g in windowed.layer_group if windowed.windows[g] is None)
            left = c.kv_cache_memory // layer_bytes - windowed.total_blocks
            num_blocks = min(left // max(full_layers, 1), c.max_num_seqs * per_seq)  # >= all_global
        return KVLayout.of(cfg, num_blocks, window_blocks)

    def _proposer(self, spec: SpeculativeConfig, max_model_len: int) -> Proposer:
        """Where speculative drafts come from: n-gram lookup, or a draft model (loaded here from a path; its
        packed weights stay packed)."""
        if spec.method == "ngram":
            return NgramProposer(spec)
        draft = spec.model
        if not isinstance(draft, Decoder):
            from tunix_rt.checkpoints.loader import load_model

            draft = load_model(draft).model
        c = self.config
        return DraftModelProposer(spec, draft, target_vocab_size=self.model.config.vocab_size,
                                  max_model_len=max_model_len, block_size=c.block_size,
                                  max_sequences=min(spec.disable_by_batch_size or c.max_num_seqs, c.max_num_seqs),
                                  max_num_batched_tokens=c.max_num_batched_tokens)

    # -- requests ---------------------------------------------------------------------------

    def _prompt_ids(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidPromptError(
                    "a text prompt needs a tokenizer: pass token ids or give the Engine a tokenizer")
            ids = self.tokenizer.encode(prompt)
        else:
            ids = [int(t) for t in prompt]
        if not ids:
            raise InvalidPromptError("prompt is empty: give at least one token")
        vocab = self.model.config.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidPromptError(f"prompt holds token id {bad}, outside the model's vocabulary [0, {vocab})")
        if len(ids) >= self.max_model_len:
            raise ContextLengthExceededError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, your request has "
                f"{len(ids)} input tokens. Please reduce the length of the input.",
                max_model_len=self.max_model_len, num_tokens=len(ids))
        return ids

    def _images(self, ids: list[int], images: Sequence[np.ndarray]) -> tuple[RequestImage, ...]:
        """Each image's pixel values (C, H, W) checked against the prompt's runs of placeholders (one run of
        mm_tokens_per_image per image, in order) and encoded (an image seen before is not encoded again)."""
        if isinstance(images, np.ndarray):  # a stack of images, or one image given bare
            if images.ndim != 4:
                raise InvalidRequestError(f"images must be a list of (C, H, W) pixel arrays (or an (N, C, H, W) stack), "
                                          f"got an array of shape {images.shape}", param="images")
            images = list(images)
        vision = self.model.config.vision
        if vision is None:
            if len(images):
                raise InvalidRequestError(f"images given to a text-only {self.model.config.architecture} model",
                                          param="images")
            return ()
        spans = image_spans(ids, vision.image_token_id)
        if len(spans) != len(images):
            raise InvalidRequestError(f"the prompt holds {len(spans)} run(s) of image placeholders (id "
                                      f"{vision.image_token_id}) for {len(images)} image(s)", param="images")
        if images and vision.mm_tokens_per_image > self.config.max_num_batched_tokens:
            raise InvalidRequestError(f"an image's {vision.mm_tokens_per_image} tokens exceed max_num_batched_tokens "
                                      f"({self.config.max_num_batched_tokens}): they must fit one step",
                                      param="images")
        shape = (vision.num_channels, vision.image_size, vision.image_size)
        out = []
        for i, ((start, end), pixels) in enumerate(zip(spans, images)):
            if end - start != vision.mm_tokens_per_image:
                raise InvalidRequestError(f"image {i}'s run of placeholders holds {end - start} tokens, not "
                                          f"mm_tokens_per_image ({vision.mm_tokens_per_image})", param="images")
            pixels = np.asarray(pixels)
            if pixels.shape != shape or not np.issubdtype(pixels.dtype, np.floating) or not np.isfinite(pixels).all():
                raise InvalidRequestError(f"image {i}: pixel values must be finite floats of shape {shape}, got "
                                          f"{pixels.dtype} {pixels.shape}", param="images")
            pixels = np.ascontiguousarray(pixels, np.float32)
            digest = hashlib.sha256(pixels.tobytes()).hexdigest()
            embeds = self._encoded.pop(digest, None)
            if embeds is None:
                embeds = self.runner.encode_image(pixels)
            self._encoded[digest] = embeds  # most recent last
            while len(self._encoded) > _ENCODED_IMAGES:
                self._encoded.pop(next(iter(self._encoded)))
            out.append(RequestImage(start, end, embeds, digest))
        return tuple(out)

    def add_request(self, prompt: Prompt, params: SamplingParams | None = None, request_id: str | None = None,
                    *, cache_salt: str | None = None, lora_request: LoRARequest | str | None = None,
                    images: Sequence[np.ndarray] = ()) -> str:
        """Queue a prompt (text or token ids); returns its request id. n > 1 queues n sequences. `lora_request`
        (vLLM's LoRARequest, or an adapter's name) runs it with that LoRA adapter (an engine with max_loras).
        `images` (a model with a vision encoder): each image's pixel values (C, H, W), as the model's
        ImageProcessor makes them, for the prompt's runs of image placeholders in order."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError(f"params must be a SamplingParams, got {type(params).__name__}")
        ids = self._prompt_ids(prompt)
        request_id = str(next(self._ids)) if request_id is None else str(request_id)
        if request_id in self._requests:
            raise DuplicateRequestIdError(f"request id {request_id!r} is already in use")
        room = self.max_model_len - len(ids)
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        for need, group in zip(self.kv.most_blocks(len(ids) + max_tokens, self._step_tokens()), self.kv.groups):
            if need > group.pool.num_blocks:
                raise RequestTooLargeError(
                    f"request needs up to {need} KV blocks ({len(ids)} prompt + {max_tokens} new tokens) but the pool "
                    f"has {group.pool.num_blocks}: it can never fit (lower max_tokens or enlarge the KV cache)")
        if params.stop and self.tokenizer is None:
            raise InvalidRequestError("stop strings need a tokenizer to detokenize with", param="stop")
        stop_ids = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self.eos_token_ids)
        vocab = self.model.config.vocab_size
        bad = next((t for t in params.logit_bias or () if t >= vocab), None)
        if bad is not None:
            raise InvalidRequestError(f"logit_bias holds token id {bad}, outside the model's vocabulary "
                                      f"[0, {vocab})", param="logit_bias")
        matcher = None if params.structured_outputs is None else self.grammars.compile(params.structured_outputs)
        lora = None
        if lora_request is not None:
            if self.loras is None:
                raise InvalidRequestError("lora_request needs an engine with adapter slots (max_loras > 0)",
                                          param="lora_request")
            lora = self.loras.get(lora_request)
        extra_keys = (() if lora is None else (lora.cache_key,)) + (() if cache_salt is None else (cache_salt,))
        request_images = self._images(ids, images)  # last: every cheaper check has passed
        base_seed = params.seed if params.seed is not None else int(self._seeds.integers(2**32))
        seqs = []
        for i in range(params.n):
            detok = None
            if self.tokenizer is not None:
                detok = IncrementalDetokenizer(self.tokenizer, ids, skip_special_tokens=params.skip_special_tokens,
                                               stop=params.stop, include_stop_str_in_output=params.include_stop_str_in_output)
            seqs.append(Request(request_id, i, ids, params, max_tokens=max_tokens, stop_ids=stop_ids,
                                seed=(base_seed + i) % 2**32, detokenizer=detok,
                                extra_keys=extra_keys, matcher=None if matcher is None else matcher.deep_copy(),
                                lora=lora, images=request_images))
        if lora is not None:
            self.loras.request_added(lora, params.n)
        self._requests[request_id] = seqs
        for seq in seqs:
            self.scheduler.add(seq)
        self._prompt_tokens += len(ids) * params.n
        return request_id

    def abort(self, request_id: str) -> list[RequestOutput]:
        """Stop a request (all its samples) and free its KV blocks at once."""
        seqs = self._requests.pop(str(request_id), None)
        if seqs is None:
            return []
        self.scheduler.abort(str(request_id))
        outs = []
        for seq in seqs:
            if seq.status is not Status.FINISHED:
                seq.finish("abort")
                self._sequence_done(seq)
            outs.append(seq.output())
        return outs

    def has_request(self, request_id: str) -> bool:
        """True while any sample of `request_id` is queued or running."""
        return str(request_id) in self._requests

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_work()

    # -- the loop ---------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedule, run and sample one step; returns an output for every sequence that advanced."""
        if self.is_sleeping:
            raise EngineUnavailableError("the engine is asleep: call wake_up() before generating")
        scheduled = self.scheduler.schedule()
        if not scheduled:
            if self.scheduler.has_work():  # cannot happen with add_request's fit check; never spin silently
                raise RuntimeError("scheduler made no progress with requests queued")
            return []
        try:
            result = self.runner.execute(scheduled, self.kv.group_blocks())
        except Exception:
            # The step's blocks were allocated (and entered in the prefix cache) but never written:
            # forget the cache and send the step's requests back to be recomputed.
            self.kv.reset_prefix_cache()
            self.scheduler.preempt_all([s.request for s in scheduled])
            raise
        outputs = []
        for req in self.scheduler.update_from_output(scheduled, result):
            if req.status is Status.FINISHED:
                self._sequence_done(req)
            outputs.append(req.output())
        for out in outputs:
            seqs = self._requests.get(out.request_id)
            if out.finished and seqs and all(s.status is Status.FINISHED for s in seqs):
                del self._requests[out.request_id]
        return outputs

    def _sequence_done(self, req: Request) -> None:
        if req.lora is not None:
            self.loras.request_done(req.lora)

    def generate(self, prompts: Prompt | Sequence[Prompt], params: SamplingParams | Sequence[SamplingParams] | None = None,
                 *, use_tqdm: bool = False, lora_request: LoRARequest | str | Sequence | None = None,
                 images: Sequence[Sequence[np.ndarray]] | None = None
                 ) -> list[RequestOutput] | list[list[RequestOutput]]:
        """Run prompts to completion: one RequestOutput per prompt, or a list of n per prompt when n > 1.
        `lora_request`, as in vLLM: one adapter for every prompt, or one (or None) per prompt; `images`: each
        prompt's images (add_request's)."""
        single = isinstance(prompts, str) or (len(prompts) > 0 and isinstance(prompts[0], (int, np.integer)))
        prompts = [prompts] if single else list(prompts)
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts")
        loras = list(lora_request) if isinstance(lora_request, (list, tuple)) else [lora_request] * len(prompts)
        if len(loras) != len(prompts):
            raise ValueError(f"got {len(loras)} lora_requests for {len(prompts)} prompts")
        images = [()] * len(prompts) if images is None else list(images)
        if len(images) != len(prompts):
            raise ValueError(f"got images for {len(images)} prompts, there are {len(prompts)}")
        ids = []
        try:
            for prompt, p, lora, pixels in zip(prompts, params, loras, images):
                ids.append(self.add_request(prompt, p, lora_request=lora, images=pixels))
        except ValueError:
            for rid in ids:
                self.abort(rid)
            raise
        results: dict[str, list[RequestOutput | None]] = {rid: [None] * p.n for rid, p in zip(ids, params)}
        pending = sum(p.n for p in params)
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            bar = tqdm(total=pending, desc="generating", unit="seq")
        try:
            while pending:
                for out in self.step():
                    slot = results.get(out.request_id)
                    if slot is not None and out.finished:
                        slot[out.index] = out
                        pending -= 1
                        if bar is not None:
                            bar.update(1)
        except BaseException:  # an error or an interrupt: leave nothing of ours queued
            for rid in ids:
                self.abort(rid)
            raise
        finally:
            if bar is not None:
                bar.close()
        return [results[rid][0] if p.n == 1 else results[rid] for rid, p in zip(ids, params)]

    def stream(self, prompt: Prompt, params: SamplingParams | None = None, request_id: str | None = None, *,
               lora_request: LoRARequest | str | None = None) -> Iterator[RequestOutput]:
        """Yield each sequence's output as it advances (delta_text / delta_token_ids hold what is new).

        Closing the iterator early aborts the request.
        """
        rid = self.add_request(prompt, params, request_id, lora_request=lora_request)
        remaining = (params or SamplingParams()).n
        try:
            while remaining:
                for out in self.step():
                    if out.request_id == rid:
                        remaining -= out.finished
                        yield out
        finally:
            if remaining:
                self.abort(rid)

    def warmup(self, stop: Callable[[], bool] = lambda: False, *, max_rows: int | None = None,
               options: bool = False, greedy: bool = True) -> int:
        """Compile every step program plain sampling can need (each token bucket's forward, the row gather
        of each reachable shape, the sampler of each row bucket, the decode loops), so a running engine
        compiles nothing new; returns the count compiled. `max_rows=1`: only what a lone request of any
        length needs (a server's first phase, before /health). `greedy=False`: not the programs of all-greedy
        steps (a caller whose requests all draw, as RL rollouts do).
        Steps with penalties, top logprobs, logit biases or a grammar have sampler programs of their own:
        `options=True` compiles those too (runner.warmup_options), else first use does.
        `stop` ends it early, between two compiles (a server shut down while it loads, or a request came to
        an idle engine); a later call goes on where it stopped."""
        if self.is_sleeping:
            raise EngineUnavailableError("the engine is asleep: call wake_up() before warmup()")
        if max_rows is not None and not (isinstance(max_rows, int) and max_rows >= 1):
            raise ValueError(f"max_rows must be None or >= 1, got {max_rows}")
        compiled = self.runner.warmup(stop, max_rows=max_rows, greedy=greedy)
        if self.proposer is not None and not stop():
            compiled += self.proposer.warmup(stop)
        if options and not stop():
            compiled += self.runner.warmup_options(stop)
        return compiled

    # -- weights and memory -----------------------------------------------------------------

    def update_weights(self, params: nnx.State | Decoder) -> None:
        """Swap the model's weights in place (same shapes and dtypes: nothing recompiles); the
        prefix cache and the images' soft tokens are dropped, since they came from the old weights."""
        if self.loras is not None:
            raise RuntimeError("update_weights on an engine with adapter slots (max_loras) is not supported: its "
                               "slots hold the adapters' weights; make a new engine")
        state = nnx.split(params)[1] if isinstance(params, Decoder) else params
        self.runner.update_weights(state)
        self.kv.reset_prefix_cache()
        self._encoded.clear()

    def sleep(self) -> None:
        """Free the KV cache memory (e.g. for a training phase); requests must be finished first."""
        if self.scheduler.has_work():
            raise RuntimeError("sleep() with requests in flight: finish or abort them first")
        self.runner.release_cache()
        self.kv.reset_prefix_cache()
        if self.proposer is not None:
            self.proposer.sleep()

    def wake_up(self) -> None:
        if self.runner.k is None:
            self.runner.allocate_cache()
        if self.proposer is not None:
            self.proposer.wake_up()

    @property
    def is_sleeping(self) -> bool:
        return self.runner.k is None

    # -- LoRA adapters ----------------------------------------------------------------------

    def add_lora(self, name: str, path) -> None:
        """Register the peft adapter directory `path` as `name` (an engine with max_loras); requests name it."""
        self._adapters().add(name, path)

    def read_lora(self, name: str, path) -> Adapter:
        """Read and check an adapter without registering it: the slow half of add_lora, which a server runs off
        the engine's thread (then `register_lora`)."""
        return self._adapters().read(name, path)

    def register_lora(self, adapter: Adapter) -> None:
        self._adapters().register(adapter)

    def remove_lora(self, name: str) -> None:
        """Unregister adapter `name`: new requests cannot name it; those in flight finish with it."""
        self._adapters().remove(name)

    def list_loras(self) -> dict[str, str]:
        """The registered adapters' names and paths."""
        return {name: a.path for name, a in self._adapters().adapters.items()}

    def _adapters(self) -> LoRAManager:
        if self.loras is None:
            raise InvalidRequestError("this engine has no adapter slots: create it with max_loras > 0")
        return self.loras

    def reset_prefix_cache(self) -> None:
        self.kv.reset_prefix_cache()

    def stats(self) -> EngineStats:
        return EngineStats(
            num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
            kv_cache_usage=self.kv.usage(), prefix_cache_queries=self.kv.queries, prefix_cache_hits=self.kv.hits,
            prefix_cache_hit_rate=self.kv.hit_rate(), num_preemptions=self.scheduler.num_preemptions,
            num_compiles=len(self.runner.compiled), prompt_tokens=self._prompt_tokens,
            generation_tokens=self.scheduler.num_generation_tokens, num_blocks=self.kv.groups[0].pool.num_blocks,
            block_size=self.kv.block_size, spec_draft_tokens=self.scheduler.num_draft_tokens,
            spec_accepted_tokens=self.scheduler.num_accepted_tokens)
