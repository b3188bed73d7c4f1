"""EngineConfig: the rollout engine's limits and sizing (vLLM's names), checked once when made.

The engine takes one (`Engine(model, tokenizer, config)`), the server's options embed one and the CLI's serve
flags are read off its fields, so each default is written here only.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from tunix_rt.engine.speculative import SpeculativeConfig

LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs")  # vLLM's names (its *_logits modes are not offered)


def _flag(default, help: str, **serve_default):
    """A field that is also a `tunix-rt serve` flag; `serve=` gives the flag a default of its own where a
    shared server wants another trade-off than an embedded engine (fairness over throughput)."""
    return dataclasses.field(default=default, metadata={"flag": help, **serve_default})


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineConfig:
    # Fields with a "flag" help text are `tunix-rt serve` flags of the same name (--max-num-seqs ...).
    max_model_len: int | None = _flag(None, "context window (default: the model's, at most 4096)")
    max_num_seqs: int = _flag(64, "sequences decoded together")
    max_num_batched_tokens: int = _flag(512, "tokens per engine step")
    block_size: int = _flag(16, "tokens per KV-cache block")
    num_kv_blocks: int | None = None  # None: what kv_cache_memory holds (no more than max_num_seqs full sequences)
    kv_cache_memory: int = _flag(1 << 30, "bytes for the paged KV cache")
    enable_prefix_caching: bool = _flag(True, "reuse the KV blocks of prompt prefixes seen before")
    disable_hybrid_kv_cache_manager: bool = _flag(
        False, "keep every layer's KV blocks for the whole sequence, sliding-window layers too (by default those "
        "layers give back the blocks their window has passed)")
    seed: int = 0  # seeds the requests that name none
    token_buckets: Sequence[int] | None = None  # step sizes compiled (the largest = max_num_batched_tokens)
    decode_steps: int = _flag(8, "decode steps run as one program when a step has only decodes")
    max_loras: int = _flag(0, "LoRA adapters resident at once, each request picking its own (0: no adapters)")
    max_lora_rank: int = _flag(16, "the largest LoRA rank an adapter may have (with --max-loras)")
    max_cpu_loras: int = _flag(32, "LoRA adapters registered at once, each a host copy of its weights (at least "
                               "--max-loras are allowed); loading one more is refused")
    long_prefill_token_threshold: int = _flag(
        0, "a prompt with more tokens than this left to compute advances at most this many per step and gives way "
        "to other requests' steps (0: off; the server's default keeps one client's long prompt from stalling "
        "the others)", serve=32)
    speculative_config: SpeculativeConfig | Mapping | None = _flag(
        None, "speculative decoding, as JSON in vLLM's shape: '{\"method\": \"ngram\", "
        "\"num_speculative_tokens\": 3, \"prompt_lookup_max\": 4, \"prompt_lookup_min\": 1}', or a draft model of the "
        "same tokenizer: '{\"model\": PATH, \"num_speculative_tokens\": 3}' (default: off)",
        json=True)
    logprobs_mode: str = _flag("raw_logprobs", "log-probs reported: raw_logprobs (the model's distribution) or "
                               "processed_logprobs (the one sampled from: after penalties, temperature, top-k/p)")

    def __post_init__(self):
        def positive(name, value):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Engine: {name} must be a positive integer, got {value!r}")

        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size", "kv_cache_memory", "decode_steps",
                     "max_lora_rank", "max_cpu_loras"):
            positive(name, getattr(self, name))
        if isinstance(self.max_loras, bool) or not isinstance(self.max_loras, int) or self.max_loras < 0:
            raise ValueError(f"Engine: max_loras must be an integer >= 0, got {self.max_loras!r}")
        if isinstance(self.long_prefill_token_threshold, bool) or not isinstance(self.long_prefill_token_threshold,
                                                                                 int) or self.long_prefill_token_threshold < 0:
            raise ValueError(f"Engine: long_prefill_token_threshold must be an integer >= 0, got "
                             f"{self.long_prefill_token_threshold!r}")
        for name in ("max_model_len", "num_kv_blocks"):
            if getattr(self, name) is not None:
                positive(name, getattr(self, name))
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"Engine: logprobs_mode must be one of {', '.join(LOGPROBS_MODES)}, got "
                             f"{self.logprobs_mode!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"Engine: seed must be an integer, got {self.seed!r}")
        object.__setattr__(self, "speculative_config", SpeculativeConfig.parse(self.speculative_config))
        if self.token_buckets is not None:
            buckets = tuple(self.token_buckets)
            if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 1 for t in buckets) or \
                    max(buckets, default=0) != self.max_num_batched_tokens:
                raise ValueError(f"Engine: token_buckets must be positive integers, the largest equal to "
                                 f"max_num_batched_tokens ({self.max_num_batched_tokens}), got {self.token_buckets!r}")
            object.__setattr__(self, "token_buckets", tuple(sorted(set(buckets))))

    @classmethod
    def serving(cls, **overrides) -> EngineConfig:
        """The config `tunix-rt serve` starts from: each field's serve default where it has one."""
        return cls(**{**{f.name: f.metadata["serve"] for f in dataclasses.fields(cls) if "serve" in f.metadata},
                      **overrides})

    @classmethod
    def field(cls, name: str) -> dataclasses.Field:
        return next(f for f in dataclasses.fields(cls) if f.name == name)

    @classmethod
    def flags(cls) -> list[dataclasses.Field]:
        """The fields the serve command exposes as flags (each field's metadata["flag"] is its help)."""
        return [f for f in dataclasses.fields(cls) if "flag" in f.metadata]
