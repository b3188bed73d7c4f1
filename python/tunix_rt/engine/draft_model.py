"""Drafts from a smaller model of the same vocabulary (speculative_config `"method": "draft_model"`).

The draft model runs on a ModelRunner and KV pool of its own, one sequence per speculating request, kept
between steps: a proposal computes only the tokens the draft has not seen (after a step that kept a drafts, the
target's own token; the first time, the whole prompt in chunks) and then decodes greedily, the first draft
from that chunk and the rest in one decode loop. Drafts the target rejected are rolled back by position: the
draft's next proposal starts from the longest prefix it computed that the target's tokens still share, and
later writes overwrite the rest. Greedy proposals put all their mass on one token, so the engine's
verification keeps the target's law exactly (engine/speculative.py).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence

from tunix_rt.engine.kv_cache_manager import HybridKVCacheManager, KVCacheManager
from tunix_rt.engine.params import SamplingParams
from tunix_rt.engine.request import Request
from tunix_rt.engine.runner import ModelRunner
from tunix_rt.engine.scheduler import ScheduledRequest
from tunix_rt.engine.speculative import SpeculativeConfig
from tunix_rt.models.decoder import Decoder
from tunix_rt.models.kv_cache import KVLayout

_GREEDY = SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True)


def _shared_prefix(a: Sequence[int], b: Sequence[int], start: int, limit: int) -> int:
    """The length of a and b's common prefix, at most `limit`, given that their first `start` tokens agree."""
    n = min(limit, len(a), len(b))
    for i in range(min(start, n), n):
        if a[i] != b[i]:
            return i
    return n


class DraftModelProposer:
    def __init__(self, config: SpeculativeConfig, model: Decoder, *, target_vocab_size: int, max_model_len: int,
                 block_size: int, max_sequences: int, max_num_batched_tokens: int):
        """`max_sequences`: the requests whose draft state is kept at once (the least recently proposed for
        gives its blocks up past that)."""
        if model.config.vocab_size != target_vocab_size:
            raise ValueError(f"speculative_config: the draft model's vocabulary has {model.config.vocab_size} tokens, "
                             f"the target's {target_vocab_size}: a draft model must share the target's tokenizer")
        self.config = config
        num_blocks = max_sequences * -(-max_model_len // block_size)  # the target's room keeps drafts inside it
        # one KV group: a draft's sliding-window layers keep their blocks (a few sequences of a small model)
        self.kv = HybridKVCacheManager([KVCacheManager(num_blocks, block_size, enable_prefix_caching=False)],
                                       [model.config.num_layers])
        self.runner = ModelRunner(model, layout=KVLayout.of(model.config, num_blocks), block_size=block_size,
                                  max_num_seqs=1,
                                  max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len,
                                  decode_steps=max(config.num_speculative_tokens - 1, 1))
        self._seqs: OrderedDict[str, Request] = OrderedDict()  # target seq_id -> its draft sequence, LRU first

    def propose(self, seq_id: str, tokens: Sequence[int], room: int) -> tuple[int, ...]:
        draft = self._seqs.pop(seq_id, None)
        computed = 0
        if draft is not None:  # the tokens up to the last proposal's usually stand: one list compare, no walk
            known = len(draft.prompt_token_ids) if draft.prompt_token_ids == tokens[:len(draft.prompt_token_ids)] else 0
            # at least the last token is computed now: its logits give the first draft
            computed = _shared_prefix(draft.all_token_ids, tokens, known, min(draft.num_computed_tokens, len(tokens) - 1))
        else:
            draft = Request(seq_id, 0, [], _GREEDY, max_tokens=1 << 30, stop_ids=frozenset(), seed=0,
                            detokenizer=None)
        self._seqs[seq_id] = draft
        draft.prompt_token_ids, draft.all_token_ids = list(tokens), list(tokens)
        n = len(tokens)
        while not self.kv.allocate(draft.seq_id, tokens, computed, n - computed + room - 1):
            if len(self._seqs) == 1:  # the pool holds one whole sequence: not reached, but never loop
                self.release(seq_id)  # and keep no state its blocks do not hold
                return ()
            self.release(next(iter(self._seqs)))
        budget = self.runner.token_buckets[-1]
        while n - computed > budget:  # a prompt the draft has not seen: chunks whose samples are not needed
            self._step(ScheduledRequest(draft, computed, budget))
            computed += budget
        drafts = [int(self._step(ScheduledRequest(draft, computed, n - computed)).tokens[0, 0])]
        if room > 1:
            draft.all_token_ids.append(drafts[0])
            result = self._step(ScheduledRequest(draft, n, 1, limit=room - 1))
            drafts += result.tokens[:room - 1, 0].tolist()
        draft.all_token_ids = [*tokens, *drafts]
        draft.num_computed_tokens = n + room - 1  # the last draft is sampled, not computed
        return tuple(drafts)

    def _step(self, s: ScheduledRequest):
        return self.runner.execute([s], self.kv.group_blocks())

    def release(self, seq_id: str) -> None:
        draft = self._seqs.pop(seq_id, None)
        if draft is not None:
            self.kv.free(draft.seq_id)

    def warmup(self, stop: Callable[[], bool]) -> int:
        """Compile what a lone speculating request's proposals run (the draft's forward of each token bucket, its
        sampler and decode loop); returns the count compiled."""
        return self.runner.warmup(stop, max_rows=1)

    def sleep(self) -> None:
        """Free the draft's KV memory (the target engine sleeps); proposals start afresh after wake_up."""
        for seq_id in list(self._seqs):
            self.release(seq_id)
        self.runner.release_cache()

    def wake_up(self) -> None:
        if self.runner.k is None:
            self.runner.allocate_cache()
