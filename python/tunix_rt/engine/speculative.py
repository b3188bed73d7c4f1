"""Speculative decoding (vLLM's `speculative_config`): drafts by n-gram prompt lookup (`"method": "ngram"`) or
from a smaller model of the same vocabulary (`"method": "draft_model", "model": PATH`, engine/draft_model.py).

N-gram lookup: a decoding request whose last n tokens (n from prompt_lookup_max down to prompt_lookup_min)
occurred earlier in its own prompt or output proposes the tokens that followed that occurrence as drafts: no
second model. A draft model proposes its greedy continuation. Either way the step then computes the request's
last token and its k drafts together (one chunk of k + 1 tokens, as a prefill chunk is), samples the target
model at each of the k + 1 positions, and keeps the drafts up to the first one the sample there differs from,
plus the target's own token at that position: 1 to k + 1 tokens from one step whose cost, on a memory-bound
decode, is close to one token's.

This is speculative sampling's rejection rule (Leviathan et al.; Chen et al.) for a proposal that puts all its
mass on one token: the draft d is kept with probability p(d), and a rejected position takes a token drawn from
p with d excluded, which is what a draw from p that is not d is. Here the rule holds draw for draw: the
engine's kernels give a row the same logits whatever the step holds (batch and chunk invariance), and row j of
a request samples with the key plain decoding uses at that output position (fold_in(seed, step)), its
penalties counting the drafts before it. So greedy and seeded requests get exactly the tokens and log-probs
plain decoding gives, and unseeded ones the same law. Requests whose allowed tokens change token by token (a
grammar, stop ids banned until min_tokens) decode as usual in the same steps.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

import numpy as np

from tunix_rt.models.decoder import Decoder

METHODS = ("ngram", "draft_model")


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's fields. The defaults are what measured fastest on a 2-core CPU (benchmarks/speculative.py): 3 drafts
    (a 4-token step still runs the int8 GEMV; 8 tokens take the GEMM at ~2.4x the cost), and speculation only
    while one request runs (two speculating requests make an 8-token step, slower than their plain decodes)."""

    method: str = "ngram"
    num_speculative_tokens: int = 3  # k: drafts proposed per step at most
    prompt_lookup_max: int = 4  # ngram: the longest suffix matched
    prompt_lookup_min: int = 1  # ngram: the shortest
    disable_by_batch_size: int | None = 1  # no drafts while more requests than this run or wait (None: always)
    model: str | os.PathLike | Decoder | None = None  # draft_model: a path, "default", or a Decoder (Python API)

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"speculative_config: method must be one of {', '.join(METHODS)}, got {self.method!r}")
        if (self.method == "draft_model") != (self.model is not None):
            raise ValueError("speculative_config: method draft_model needs a model (a path, 'default' or a Decoder)"
                             if self.model is None else
                             f"speculative_config: model is for method draft_model, not {self.method!r}")
        if self.model is not None and not isinstance(self.model, (str, os.PathLike, Decoder)):
            raise ValueError(f"speculative_config: model must be a path, 'default' or a Decoder, got "
                             f"{type(self.model).__name__}")
        limit = self.disable_by_batch_size
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
            raise ValueError(f"speculative_config: disable_by_batch_size must be a positive integer or None, got "
                             f"{limit!r}")
        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 64:
                raise ValueError(f"speculative_config: {name} must be an integer from 1 to 64, got {value!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"speculative_config: prompt_lookup_min ({self.prompt_lookup_min}) must not exceed "
                             f"prompt_lookup_max ({self.prompt_lookup_max})")

    @classmethod
    def parse(cls, value: SpeculativeConfig | Mapping | None) -> SpeculativeConfig | None:
        """A SpeculativeConfig from itself, vLLM's dict shape, or None (off); unknown keys are refused."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if not isinstance(value, Mapping):
            raise ValueError(f"speculative_config must be a dict like {{'method': 'ngram', 'num_speculative_tokens': "
                             f"4}} or None, got {type(value).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(map(str, set(value) - known))
        if unknown:
            raise ValueError(f"speculative_config: unknown key(s) {', '.join(unknown)} (known: {', '.join(sorted(known))})")
        if value.get("model") is not None and "method" not in value:  # vLLM's older shape: a model names its method
            value = {**value, "method": "draft_model"}
        return cls(**value)


def ngram_drafts(tokens: Sequence[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of the longest suffix of `tokens` (length
    max_n down to min_n) that occurred before; [] when none did."""
    ids = np.asarray(tokens, np.int64)
    length = len(ids)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        # windows starting at 0 .. length - n - 1: every occurrence that ends before the suffix itself does
        windows = np.lib.stride_tricks.sliding_window_view(ids[:-1], n)
        hits = np.flatnonzero((windows == ids[length - n:]).all(axis=1))
        if len(hits):
            start = int(hits[-1]) + n
            return ids[start:start + k].tolist()
    return []


class Proposer(Protocol):
    """Where a decode's drafts come from (the scheduler asks once per speculating request and step)."""

    config: SpeculativeConfig

    def propose(self, seq_id: str, tokens: Sequence[int], room: int) -> tuple[int, ...]:
        """Up to `room` drafts to follow `tokens`, the sequence `seq_id`'s tokens so far."""

    def release(self, seq_id: str) -> None:
        """Forget what was kept for `seq_id` (it finished, was aborted or preempted)."""

    def warmup(self, stop: Callable[[], bool]) -> int:
        """Compile what proposing runs (Engine.warmup); returns the count compiled."""

    def sleep(self) -> None:
        """Free what the proposer holds in memory while the engine sleeps (Engine.sleep)."""

    def wake_up(self) -> None:
        """Take it back (Engine.wake_up)."""


class NgramProposer:
    def __init__(self, config: SpeculativeConfig):
        self.config = config

    def propose(self, seq_id: str, tokens: Sequence[int], room: int) -> tuple[int, ...]:
        c = self.config
        return tuple(ngram_drafts(tokens, room, c.prompt_lookup_min, c.prompt_lookup_max))

    def release(self, seq_id: str) -> None:
        pass

    def warmup(self, stop: Callable[[], bool]) -> int:
        return 0

    def sleep(self) -> None:
        pass

    def wake_up(self) -> None:
        pass
