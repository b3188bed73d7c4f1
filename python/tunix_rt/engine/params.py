"""What a caller asks of the engine (SamplingParams) and what it gets back (RequestOutput).

Names and defaults mirror vLLM's, so code written against vLLM reads the same here.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from tunix_rt.engine.errors import InvalidSamplingParamError
from tunix_rt.engine.structured import StructuredOutputsParams

MAX_LOGPROBS = 20  # top-logprobs per token, OpenAI's limit


@dataclasses.dataclass(kw_only=True)
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 = off
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int | None = 16  # None = up to the context window; 0 = score the prompt only (no token sampled)
    min_tokens: int = 0  # tokens generated before end-of-sequence, stop_token_ids or a stop string may end it
    stop: str | Sequence[str] | None = None
    stop_token_ids: Sequence[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None  # None = off; k >= 0 = the sampled token's logprob plus the top k
    prompt_logprobs: int | None = None  # None = off; k >= 0 = each prompt token's logprob plus the top k
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit before sampling (OpenAI's range)
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None  # a grammar the output must follow

    def __post_init__(self):
        def fail(field, why):
            raise InvalidSamplingParamError(f"SamplingParams.{field} {why}, got {getattr(self, field)!r}", param=field)

        def is_int(v):
            return isinstance(v, int) and not isinstance(v, bool)

        def is_num(v):
            return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)

        if not is_int(self.n) or self.n < 1:
            fail("n", "must be a positive integer")
        if not is_num(self.temperature) or self.temperature < 0:
            fail("temperature", "must be a finite number >= 0 (0 = greedy)")
        if not is_num(self.top_p) or not 0 < self.top_p <= 1:
            fail("top_p", "must be in (0, 1]")
        if not is_int(self.top_k) or self.top_k < -1:
            fail("top_k", "must be an integer >= -1 (0 or -1 = off)")
        # off below 1; past int32 (the sampler's dtype) it keeps every token of any vocabulary, as off does
        self.top_k = self.top_k if 0 < self.top_k <= 2**31 - 1 else 0
        if not is_num(self.min_p) or not 0 <= self.min_p <= 1:
            fail("min_p", "must be in [0, 1]")
        for name in ("presence_penalty", "frequency_penalty"):
            if not is_num(getattr(self, name)) or not -2 <= getattr(self, name) <= 2:
                fail(name, "must be in [-2, 2]")
        if not is_num(self.repetition_penalty) or self.repetition_penalty <= 0:
            fail("repetition_penalty", "must be > 0 (1 = off)")
        if self.seed is not None and not is_int(self.seed):
            fail("seed", "must be an integer or None")
        if self.max_tokens is not None and (not is_int(self.max_tokens) or self.max_tokens < 0):
            fail("max_tokens", "must be a non-negative integer (0 = score the prompt only) or None")
        if not is_int(self.min_tokens) or self.min_tokens < 0 or (
                self.max_tokens is not None and is_int(self.max_tokens) and self.min_tokens > self.max_tokens):
            fail("min_tokens", "must be an integer >= 0 and at most max_tokens")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        if not all(isinstance(s, str) and s for s in self.stop):
            fail("stop", "must be a non-empty string or a list of non-empty strings")
        self.stop_token_ids = list(self.stop_token_ids or [])
        if not all(is_int(t) and t >= 0 for t in self.stop_token_ids):
            fail("stop_token_ids", "must be a list of non-negative integers")
        if self.logprobs is not None and (not is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            fail("logprobs", f"must be None or an integer in [0, {MAX_LOGPROBS}]")
        if self.prompt_logprobs is not None and (not is_int(self.prompt_logprobs)
                                                 or not 0 <= self.prompt_logprobs <= MAX_LOGPROBS):
            fail("prompt_logprobs", f"must be None or an integer in [0, {MAX_LOGPROBS}]")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                fail("logit_bias", "must be a dict of token id -> bias")
            for token, bias in self.logit_bias.items():
                if not is_int(token) or token < 0:
                    fail("logit_bias", f"keys must be token ids (non-negative integers), {token!r} is not")
                if not is_num(bias) or not -100 <= bias <= 100:
                    fail("logit_bias", f"values must be numbers in [-100, 100], token {token}'s is {bias!r}")
            self.logit_bias = {int(t): float(b) for t, b in self.logit_bias.items()} or None
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            fail("structured_outputs", "must be a StructuredOutputsParams or None")

    @property
    def uses_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1


@dataclasses.dataclass
class RequestOutput:
    """One completion of one prompt, as it stands (while streaming) or as it ended.

    With n > 1, `generate` returns a list of these per prompt (index 0..n-1).
    """

    request_id: str
    index: int
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None  # "stop" | "length" | "abort" | "error" (NaN/inf: results void) | None while running
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it
    logprobs: list[float] | None = None  # log p of each generated token (raw model distribution; masked by a grammar)
    top_logprobs: list[dict[int, float]] | None = None  # per token, the top-k ids -> log p
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    # with SamplingParams.prompt_logprobs: log p of each prompt token given those before it (None for the first),
    # and with k > 0 the top k ids -> log p at each position (None for the first); raw model distribution. Set on
    # a request's first output and its last (None on the streamed ones between)
    prompt_logprobs: list[float | None] | None = None
    prompt_ranks: list[int | None] | None = None  # each prompt token's rank in its distribution (1 = the most likely)
    prompt_top_logprobs: list[dict[int, float] | None] | None = None
    delta_text: str = ""  # streaming: text added since the previous output of this request
    delta_token_ids: list[int] = dataclasses.field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
