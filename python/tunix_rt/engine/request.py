"""One sequence's state inside the engine (a prompt with n > 1 becomes n of these)."""

from __future__ import annotations

import dataclasses
import enum

import numpy as np

from tunix_rt.engine.detokenizer import IncrementalDetokenizer
from tunix_rt.engine.params import RequestOutput, SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclasses.dataclass(frozen=True, eq=False)
class RequestImage:
    """One image of a prompt, encoded at admission: its soft tokens (M, D) f32 on the host fill the prompt's
    placeholders [start, end); `digest` (of its pixel values) keys the prefix cache's blocks that hold it."""

    start: int
    end: int
    embeds: np.ndarray
    digest: str


class Request:
    def __init__(self, request_id: str, index: int, prompt_token_ids: list[int], params: SamplingParams, *,
                 max_tokens: int, stop_ids: frozenset[int], seed: int, detokenizer: IncrementalDetokenizer | None,
                 extra_keys: tuple = (), matcher=None, lora=None, images: tuple[RequestImage, ...] = ()):
        self.request_id = request_id
        self.index = index
        self.seq_id = f"{request_id}#{index}"  # the unit the KV manager keys blocks by
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.max_tokens = max_tokens
        self.stop_ids = stop_ids
        self.seed = seed
        self.detokenizer = detokenizer
        self.extra_keys = extra_keys
        self.matcher = matcher  # llguidance.LLMatcher of a structured-output request: masks its tokens
        self.lora = lora  # the LoRA adapter it runs with (engine/lora_manager.Adapter), None for the base model
        self.lora_slot = -1  # the adapter's slot while admitted (-1: none)
        self.long_prefill_waits = 0  # steps in a row this long prefill gave to others (scheduler)
        self.all_token_ids = list(prompt_token_ids)
        self.images = images
        # what the prefix cache keys blocks by: the tokens, an image's placeholders as (its digest, offset)
        self._prompt_keys = list(prompt_token_ids)
        for image in images:
            self._prompt_keys[image.start:image.end] = [(image.digest, i) for i in range(image.end - image.start)]
        self.output_token_ids: list[int] = []
        self.num_computed_tokens = 0  # catches up with len(all_token_ids); reset to 0 by preemption
        self.num_cached_tokens: int | None = None  # prefix-cache hit at first admission
        self.status = Status.WAITING
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.logprobs: list[float] | None = [] if params.logprobs is not None else None
        self.top_logprobs: list[dict[int, float]] | None = [] if params.logprobs else None
        # filled chunk by chunk as the prompt is computed (by position: a recomputed chunk writes the same values)
        wants_prompt = params.prompt_logprobs is not None
        self.prompt_logprobs: list[float | None] | None = [None] * len(prompt_token_ids) if wants_prompt else None
        self.prompt_ranks: list[int | None] | None = [None] * len(prompt_token_ids) if wants_prompt else None
        self.prompt_top_logprobs: list[dict[int, float] | None] | None = (
            [None] * len(prompt_token_ids) if params.prompt_logprobs else None)
        self.text = ""
        self._sent_tokens = 0
        self._sent_text = 0
        self._sent_prompt = False

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def block_tokens(self) -> list:
        """The tokens as the prefix cache keys them: an image's placeholders by its digest, so only a block
        holding the same image (and everything before it) is shared."""
        return self.all_token_ids if not self.images else self._prompt_keys + self.output_token_ids

    def chunk_size(self, start: int, num_new: int, budget: int) -> int:
        """`num_new` tokens from `start`, cut so that no image's placeholders are split between steps (each sees
        its whole image, whose keys must all be written in the step it attends): a chunk that would end inside
        an image ends before it, or, starting inside or at it, takes the rest of it if `budget` allows (else 0)."""
        end = start + num_new
        for image in self.images:
            if image.start < end < image.end:
                if image.start > start:
                    return image.start - start
                return image.end - start if image.end - start <= budget else 0
        return num_new

    def append(self, token: int, logprob: float, top: dict[int, float] | None) -> None:
        """Record a sampled token and decide whether the sequence ends with it."""
        self.all_token_ids.append(token)
        self.output_token_ids.append(token)
        if self.logprobs is not None:
            self.logprobs.append(logprob)
        if self.top_logprobs is not None:
            self.top_logprobs.append(top or {})
        n = len(self.output_token_ids)
        may_stop = n >= self.params.min_tokens  # before min_tokens no stop applies (vLLM's rule)
        if self.matcher is not None:
            self.matcher.consume_token(token)
        if self.detokenizer is not None:
            self.text += self.detokenizer.add([token], find_stops=may_stop)
            if self.detokenizer.stop_reason is not None:
                self.finish("stop", self.detokenizer.stop_reason)
                self.text = self.detokenizer.text
                return
        if token in self.stop_ids and may_stop:
            self.finish("stop", token)
        elif self.matcher is not None and (self.matcher.is_stopped() or self.matcher.is_error()):
            self.finish("stop")  # the grammar is complete: nothing but end-of-sequence may follow
        elif n >= self.max_tokens:
            self.finish("length")

    @property
    def banned_stop_ids(self) -> frozenset[int]:
        """The ids the next token may not be: its stop ids while the output is shorter than min_tokens (not with
        a grammar, whose mask may allow nothing but a stop: banning it too would leave no token at all)."""
        short = len(self.output_token_ids) < self.params.min_tokens
        return self.stop_ids if short and self.matcher is None else frozenset()

    def record_prompt_logprobs(self, positions, logprobs, ranks, top_ids, top_logprobs) -> None:
        """Log-probs of prompt tokens at `positions` (each given the tokens before it), from a prefill chunk."""
        k = self.params.prompt_logprobs
        for i, pos in enumerate(positions):
            self.prompt_logprobs[pos] = float(logprobs[i])
            self.prompt_ranks[pos] = int(ranks[i])
            if k:
                self.prompt_top_logprobs[pos] = dict(zip(top_ids[i, :k].tolist(), top_logprobs[i, :k].tolist()))

    def finish(self, reason: str, stop_reason: str | int | None = None) -> None:
        if self.detokenizer is not None and self.detokenizer.stop_reason is None:
            self.text += self.detokenizer.flush()
            if self.detokenizer.stop_reason is not None and reason not in ("abort", "error"):  # in the held-back tail
                reason, stop_reason = "stop", self.detokenizer.stop_reason
        self.status = Status.FINISHED
        self.finish_reason = reason
        self.stop_reason = stop_reason

    def output(self) -> RequestOutput:
        """The request as it stands, with what changed since the last output() as deltas."""
        delta_ids = self.output_token_ids[self._sent_tokens:]
        delta_text = self.text[self._sent_text:]
        # prompt log-probs (complete by the first output, which comes once the prompt is computed) ride on the
        # first output and the last only: a copy on every streamed token would cost the prompt's length each time
        with_prompt = self.prompt_logprobs is not None and (not self._sent_prompt or self.finish_reason is not None)
        self._sent_tokens, self._sent_text, self._sent_prompt = len(self.output_token_ids), len(self.text), True
        return RequestOutput(
            request_id=self.request_id, index=self.index, prompt_token_ids=self.prompt_token_ids,
            token_ids=list(self.output_token_ids), text=self.text, finish_reason=self.finish_reason,
            stop_reason=self.stop_reason, logprobs=None if self.logprobs is None else list(self.logprobs),
            top_logprobs=None if self.top_logprobs is None else list(self.top_logprobs),
            num_cached_tokens=self.num_cached_tokens or 0,
            prompt_logprobs=list(self.prompt_logprobs) if with_prompt else None,
            prompt_ranks=list(self.prompt_ranks) if with_prompt else None,
            prompt_top_logprobs=list(self.prompt_top_logprobs) if with_prompt and self.prompt_top_logprobs else None,
            delta_text=delta_text, delta_token_ids=delta_ids)
