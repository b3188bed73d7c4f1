"""The embedded engine of one training run: the single seam between a trainer and the sampler.

GRPO, PPO and on-policy distillation sample through a RolloutEngine. It owns the engine's life:
- made from an EngineConfig (the run's derived sizing, overridden by the config's `rollout` section)
  on the first rollout, and warmed up then, so no later rollout meets a new shape;
- given the trainer's current weights in place (no copy through disk, no recompile) before the first
  generate after an optimizer step, woken first if it sleeps;
- put to sleep after each rollout when the run asks (`sleep_engine`), freeing its KV cache while the
  trainer runs;
- seeding every request from the run's seed, the rollout's index and the row alone, so a resumed run
  samples what the uninterrupted one did.
The trainer binds its weights (`bind`), starts each rollout with its index (`begin`), says when the weights
change (`weights_changed`) and ends each rollout (`finish`); objectives only call `generate` and `seed`.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Sequence

import numpy as np

from tunix_rt.engine.config import EngineConfig

log = logging.getLogger("tunix_rt.train")


def rollout_config(section: dict | None, *, decode_and_prefill_buckets: bool = False, **derived) -> EngineConfig:
    """The engine's config: what the run derives (sequence lengths, batch rows, ...) overridden by the
    training config's `rollout` section (EngineConfig's field names).

    With `decode_and_prefill_buckets`, the step sizes compiled are two, derived after the merge unless the
    section names its own: decode steps (max_num_seqs tokens) and prefill steps (max_num_batched_tokens), so
    no rollout after the warm-up meets a new shape.
    """
    config = EngineConfig(**{**derived, **(section or {})})
    if decode_and_prefill_buckets and "token_buckets" not in (section or {}):
        budget = config.max_num_batched_tokens
        config = dataclasses.replace(config, token_buckets=(min(config.max_num_seqs, budget), budget))
    return config


def check_rollout_section(section) -> dict | None:
    """A config's `rollout` section as given (a mapping of EngineConfig fields), checked: unknown names and
    bad values are ValueErrors naming them, before any model loads."""
    if section is None:
        return None
    if not isinstance(section, dict):
        raise ValueError(f"rollout must be a mapping of engine options, got {section!r}")
    fields = {f.name for f in EngineConfig.__dataclass_fields__.values()}
    unknown = sorted(set(section) - fields)
    if unknown:
        raise ValueError(f"unknown rollout option(s) {', '.join(unknown)}; valid: {', '.join(sorted(fields))}")
    try:
        EngineConfig(**section)
    except ValueError as e:
        raise ValueError(f"rollout: {e}") from None
    return dict(section)


class RolloutEngine:
    def __init__(self, tokenizer, config: EngineConfig, *, seed: int, sleep: bool = False):
        self.tokenizer, self.config, self.base_seed, self.sleep_between = tokenizer, config, seed, sleep
        self.engine = None
        self.index = 0
        self._weights: Callable | None = None
        self._stale = True
        self.times = self._no_times()

    @staticmethod
    def _no_times() -> dict[str, float]:
        return {"time/sync": 0.0, "time/rollout": 0.0}

    def bind(self, weights: Callable) -> None:
        """Where the current weights come from: a callable returning the model as the engine runs it."""
        self._weights = weights
        self._stale = True

    def weights_changed(self) -> None:
        """The trainer stepped: the next generate takes the new weights first."""
        self._stale = True

    def begin(self, index: int) -> None:
        """A rollout starts: `index` (the rollout's, or the step's) keys its requests' seeds."""
        self.index = index

    def seed(self, row: int, stream: int = 0, *turn: int) -> int:
        """The seed of a request of this rollout: a function of the run's seed, the rollout's index, the row
        (a dataset item), a stream (e.g. a resampling round) and, for a later turn of a multi-turn trajectory,
        its sample and turn numbers only."""
        key = (self.base_seed % 2**63, self.index, stream, row, *turn)
        return int(np.random.SeedSequence(key).generate_state(1)[0] & 0x7FFFFFFF)

    def _sync(self) -> None:
        from tunix_rt.engine.engine import Engine

        if self._weights is None:
            raise RuntimeError("RolloutEngine.bind(weights) must be called before the first rollout")
        start = time.perf_counter()
        model = self._weights()
        if self.engine is None:
            self.engine = Engine(model, self.tokenizer, self.config)
            # Rollouts always draw (RL's temperature is > 0, on-policy distillation's 1): no all-greedy programs.
            log.info("engine: compiled %d step programs", self.engine.warmup(greedy=False))
        else:
            if self.engine.is_sleeping:
                self.engine.wake_up()
            self.engine.update_weights(model)
        self._stale = False
        self.times["time/sync"] += time.perf_counter() - start

    def generate(self, prompts: Sequence[Sequence[int]], params) -> list:
        """The engine's outputs for these prompts, sampled from the trainer's current weights."""
        engine = self.live()
        start = time.perf_counter()
        outputs = engine.generate([list(p) for p in prompts], params)
        self.times["time/rollout"] += time.perf_counter() - start
        return outputs

    def live(self):
        """The engine, holding the trainer's current weights, for a caller that drives it request by request
        (agentic rollouts); it adds its own time to times["time/rollout"]."""
        if self._stale or self.engine is None or self.engine.is_sleeping:
            self._sync()
        return self.engine

    def finish(self) -> dict[str, float]:
        """The rollout is over: sleep if the run asks, and return (and reset) its sync and sampling times."""
        if self.sleep_between and self.engine is not None and not self.engine.is_sleeping:
            self.engine.sleep()
        times, self.times = self.times, self._no_times()
        return times

    @property
    def num_compiles(self) -> int:
        return self.engine.stats().num_compiles if self.engine is not None else 0
