"""The scheduler, with vLLM v1's one invariant.

Every request has num_computed_tokens catching up with its tokens (prompt + generated). Each step
hands out a budget of tokens: running requests first (a decode needs 1, a chunked prefill takes
what the budget leaves), then waiting requests in arrival order (FCFS, no skipping) as long as
budget, blocks and the running-sequence limit allow. There are no separate prefill and decode
phases: a step is whatever mix of both fits the budget. When the pool runs out of blocks the most
recently admitted running request is preempted: its blocks are freed and it goes back to the front
of the queue to be recomputed later (its prefix may still be found in the prefix cache). A request that
runs with a LoRA adapter is admitted only when the adapter holds (or can be given) one of the engine's
adapter slots; it gives its hold back when it finishes or is preempted. Blocks are counted in every KV group
(engine/kv_cache_manager.HybridKVCacheManager): as a running request is scheduled, its sliding-window groups
first give back the blocks its window has passed.

Long prefills (vLLM's long_prefill_token_threshold, when set): a prompt with more than that many tokens left
to compute takes at most that many per step (fewer once its context passes LONG_PREFILL_CONTEXT, as its
tokens' attention grows with it), and a running one sits out the steps in which other requests have work, up
to LONG_PREFILL_MAX_WAITS in a row. A short request that arrives behind a long prompt then
waits for one short step rather than the whole prompt: a multi-tenant server's latency for one client does
not depend on another client's prompt length. Results do not change: a request's numbers never depend on
how its prompt was chunked.

Multi-step decoding (vLLM's num_scheduler_steps): when nothing waits and every scheduled request is
a plain one-token decode, the step may run `decode_steps` decodes in one device program. Each
request then gets KV room for the tokens it may still sample (its `limit`); the host sees the
tokens afterwards and drops whatever follows a stop, so the output is the same as one step at a time.

Speculative decoding (engine/speculative.py), when configured: a request's decode takes its drafts (n-gram
lookup or a draft model's) along (`draft`), one chunk of 1 + k tokens, with KV room for all of them; the drafts the target rejects
stop counting as computed, and later steps overwrite their slots. Drafts are never entered in the prefix
cache: only known tokens' blocks are.

The scheduler owns the step's accounting both ways (vLLM's `update_from_output`): what it hands out in
`schedule()`, and what the step's result does to its requests: sampled tokens appended, computed counts,
finishes and the blocks they free. The engine only wires the two and makes the outputs.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import deque

from tunix_rt.engine.kv_cache_manager import KVCacheManager
from tunix_rt.engine.request import Request, Status
from tunix_rt.engine.speculative import Proposer

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class ScheduledRequest:
    request: Request
    start: int  # num_computed_tokens before this step
    num_new: int
    limit: int = 1  # tokens this step may sample for it: > 1 in a multi-step decode or with drafts
    draft: tuple[int, ...] = ()  # speculative tokens after the request's last one (part of num_new)

    @property
    def completes(self) -> bool:
        """True when this step catches the request up, so its last logits yield the next token."""
        return self.start + self.num_new - len(self.draft) == self.request.num_tokens


LONG_PREFILL_MAX_WAITS = 4  # steps a running long prefill sits out in a row before it takes one anyway
LONG_PREFILL_CONTEXT = 512  # past this context a long prefill's chunk shrinks as 1 / context


class Scheduler:
    def __init__(self, kv: KVCacheManager, *, max_num_seqs: int, max_num_batched_tokens: int, decode_steps: int = 1,
                 max_model_len: int, loras=None, long_prefill_token_threshold: int = 0,
                 proposer: Proposer | None = None):
        self.kv = kv
        self.proposer = proposer  # speculative decoding's drafts (engine/speculative.py), None: off
        self.max_model_len = max_model_len
        self.long_prefill = long_prefill_token_threshold  # 0: off
        self.loras = loras  # engine/lora_manager.LoRAManager: admission takes an adapter slot, leaving gives it back
        self.decode_steps = decode_steps
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.num_generation_tokens = 0  # totals since start
        self.num_draft_tokens = 0  # speculative drafts proposed, and of them accepted by the target
        self.num_accepted_tokens = 0

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[ScheduledRequest]:
        budget = self.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        preempted = False
        i = 0
        deferred: list[Request] = []  # long prefills that give this step to the others if they have work
        image_waits = False  # a running request's image did not fit what was left: admit nobody past it
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            if self._is_long_prefill(req, req.num_computed_tokens) and req.long_prefill_waits < LONG_PREFILL_MAX_WAITS:
                deferred.append(req)
                i += 1
                continue
            fits, preempting = self._fit_running(req, budget)
            preempted |= preempting
            if fits is None and not preempting:  # its image waits for a step with room; the others go on
                image_waits = True
                i += 1
                continue
            if not fits:
                break
            scheduled.append(fits)
            budget -= fits.num_new
            req.long_prefill_waits = 0  # a long prefill that waited its most takes its turn here, before admissions
            i += 1
        # Admitting while preempting would only thrash: the queue waits for the next step.
        while not preempted and not image_waits and self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            cached, num_cached = self.kv.computed_blocks(req.block_tokens, req.extra_keys)
            if req.params.prompt_logprobs is not None:  # every prompt position's logits are needed: compute all
                cached, num_cached = [], 0
            num_new = req.chunk_size(num_cached, min(req.num_tokens - num_cached, budget,
                                                     self._chunk_cap(req, num_cached)), budget)
            if num_new == 0:  # an image's placeholders do not fit what is left of this step
                break
            if req.lora is not None:
                slot = self.loras.acquire(req.lora)
                if slot is None:  # every adapter slot serves running requests: wait for one to end
                    break
                req.lora_slot = slot
            if not self.kv.allocate(req.seq_id, req.block_tokens, num_cached, num_new, cached, req.extra_keys):
                self._leave_slot(req)
                break
            self.waiting.popleft()
            self.kv.record_lookup(req.num_tokens, num_cached)
            if req.num_cached_tokens is None:
                req.num_cached_tokens = num_cached
            req.num_computed_tokens = num_cached
            req.status = Status.RUNNING
            self.running.append(req)
            scheduled.append(ScheduledRequest(req, num_cached, num_new))
            budget -= num_new
        if not scheduled:  # nobody else has work this step: the long prefills take it
            for req in deferred:
                if req.status is not Status.RUNNING or budget <= 0:  # preempted by the one before it
                    continue
                fits, preempting = self._fit_running(req, budget)
                preempted |= preempting
                if not fits:
                    break
                scheduled.append(fits)
                budget -= fits.num_new
        taken = {id(s.request) for s in scheduled}
        for req in deferred:
            req.long_prefill_waits = 0 if id(req) in taken else req.long_prefill_waits + 1
        if not preempted and not self.waiting:
            scheduled = self._multi_step(scheduled)
        for s in scheduled:
            s.request.num_computed_tokens += s.num_new
        return scheduled

    def _fit_running(self, req: Request, budget: int) -> tuple[ScheduledRequest | None, bool]:
        """Room for running `req`'s next chunk (what is left of it, within `budget` and its chunk cap),
        preempting the newest running requests (never one scheduled before it: those sit earlier in the list)
        until it fits: its ScheduledRequest, or None when it had to go itself (or when its next chunk is an image
        that does not fit `budget`: it waits, nothing preempted); and whether anything was preempted."""
        self.kv.release_behind(req.seq_id, req.num_computed_tokens)  # sliding-window blocks it has passed
        num_new = req.chunk_size(req.num_computed_tokens, min(req.num_tokens - req.num_computed_tokens, budget,
                                                              self._chunk_cap(req, req.num_computed_tokens)), budget)
        if num_new == 0:  # an image's placeholders do not fit what is left of this step
            return None, False
        finishes_prompt = req.num_computed_tokens + num_new == req.num_tokens  # drafts follow the last token only
        draft = self._drafts(req, budget) if num_new == 1 and finishes_prompt else ()
        if draft and self.kv.allocate(req.seq_id, req.block_tokens, req.num_computed_tokens, 1 + len(draft),
                                      extra=req.extra_keys):
            return ScheduledRequest(req, req.num_computed_tokens, 1 + len(draft), limit=1 + len(draft),
                                    draft=draft), False
        preempted = False  # no room for drafts: the plain decode, preempting as it needs
        while not self.kv.allocate(req.seq_id, req.block_tokens, req.num_computed_tokens, num_new,
                                   extra=req.extra_keys):
            victim = self.running.pop()
            self._preempt(victim)
            preempted = True
            if victim is req:
                return None, True
        return ScheduledRequest(req, req.num_computed_tokens, num_new), preempted

    def _drafts(self, req: Request, budget: int) -> tuple[int, ...]:
        """A decode's n-gram drafts: no more than the step's budget, the request's max_tokens and the context
        window leave room for beside the token it samples anyway. None for a request whose allowed tokens change
        with each token it samples (a grammar, stop ids banned until min_tokens)."""
        if self.proposer is None or req.matcher is not None or req.banned_stop_ids:
            return ()
        spec = self.proposer.config
        if spec.disable_by_batch_size is not None and \
                len(self.running) + len(self.waiting) > spec.disable_by_batch_size:
            return ()
        room = min(spec.num_speculative_tokens, budget - 1, req.max_tokens - len(req.output_token_ids) - 1,
                   self.max_model_len - req.num_tokens)
        if room < 1:
            return ()
        return self.proposer.propose(req.seq_id, req.all_token_ids, room)

    def _is_long_prefill(self, req: Request, num_computed: int) -> bool:
        return 0 < self.long_prefill < len(req.prompt_token_ids) - num_computed

    def _chunk_cap(self, req: Request, num_computed: int) -> int:
        """A long prefill's tokens this step: the threshold T up to a context of LONG_PREFILL_CONTEXT, then fewer
        (at least 8) as its context grows, since each of its tokens attends to the whole context: the step (and
        what a newcomer waits for) stays about as short as T tokens at that context."""
        if not self._is_long_prefill(req, num_computed):
            return req.num_tokens
        return max(min(8, self.long_prefill), self.long_prefill * LONG_PREFILL_CONTEXT // max(num_computed,
                                                                                               LONG_PREFILL_CONTEXT))

    def _multi_step(self, scheduled: list[ScheduledRequest]) -> list[ScheduledRequest]:
        """Give a pure decode step `decode_steps` tokens per request where the KV pool has room.

        Requests nearer their max_tokens get a smaller limit (the loop turns as often as the largest
        limit asks). Penalties, logit biases (min_tokens' ban on stop ids too) and grammars need the host
        between tokens, and top-k log-probs take the sampler a server compiles ahead (Engine.warmup(options=True))
        rather than a decode loop of their own, so a step with any stays single. Blocks taken here and left
        unused (a stop came first) go back with the request's other blocks.
        """
        steps = self.decode_steps
        if steps < 2 or not scheduled or not all(s.num_new == 1 and s.completes and s.request.matcher is None
                                and not s.request.params.uses_penalties and not s.request.params.logit_bias
                                and not s.request.banned_stop_ids and not s.request.params.logprobs
                                for s in scheduled):
            return scheduled
        limits = [max(1, min(steps, s.request.max_tokens - len(s.request.output_token_ids))) for s in scheduled]
        if max(limits) < 2:
            return scheduled
        for s, limit in zip(scheduled, limits):
            req = s.request
            if not self.kv.allocate(req.seq_id, req.block_tokens, s.start + 1, limit - 1, extra=req.extra_keys):
                return scheduled  # room taken so far stays with its requests and serves their next steps
        return [dataclasses.replace(s, limit=limit) for s, limit in zip(scheduled, limits)]

    def update_from_output(self, scheduled: list[ScheduledRequest], result) -> list[Request]:
        """Apply a step's result (runner.StepResult) to its requests: prompt log-probs recorded, sampled tokens
        appended, finishes freed. Returns the requests that advanced (a prefill chunk that does not catch its
        request up has no new token and is not among them)."""
        for i, prompt in result.prompt_logprobs.items():
            scheduled[i].request.record_prompt_logprobs(prompt.positions, prompt.logprobs, prompt.ranks,
                                                        prompt.top_ids, prompt.top_logprobs)
        advanced = []
        for i, s in enumerate(scheduled):
            req = s.request
            if result.nonfinite[i]:  # its K/V and logits are void: share nothing of it, end it as an error
                log.warning("request %s produced non-finite values (adapter %s); it ends with finish_reason "
                            "'error'", req.request_id, req.lora.name if req.lora is not None else None)
                self.kv.uncache(req.seq_id)
                req.finish("error")
            elif not s.completes:
                continue  # a prefill chunk: its logits are not a next token yet
            elif req.max_tokens == 0:  # the prompt is scored: nothing is sampled
                req.finish("length")
            else:
                self._append_sampled(req, result, i, s)
            if req.status is Status.FINISHED:
                self.finish(req)
            advanced.append(req)
        return advanced

    def _append_sampled(self, req: Request, result, i: int, s: ScheduledRequest) -> None:
        """The tokens result row `i` sampled for `req`; a multi-step decode's tokens after a stop are dropped,
        and so are a speculative step's after the first draft the target disagrees with (that step's own token is
        kept: 1 to 1 + drafts tokens). Rejected drafts stop counting as computed: their K/V is not the sequence's."""
        k = req.params.logprobs
        for step in range(s.limit):
            top = None
            if k:
                top = dict(zip(result.top_ids[step, i, :k].tolist(), result.top_logprobs[step, i, :k].tolist()))
            token = int(result.tokens[step, i])
            req.append(token, float(result.logprobs[step, i]), top)
            self.num_generation_tokens += 1
            kept = step < len(s.draft) and token == s.draft[step]  # the draft at `step` is what the target chose
            self.num_accepted_tokens += kept
            if req.status is Status.FINISHED:
                break
            if s.draft:
                if not kept:
                    req.num_computed_tokens -= len(s.draft) - step
                    break
            else:
                req.num_computed_tokens += step < s.limit - 1  # the loop computed the token it sampled
        self.num_draft_tokens += len(s.draft)

    def _leave_slot(self, req: Request) -> None:
        if req.lora_slot >= 0:
            self.loras.release(req.lora)
            req.lora_slot = -1

    def _free(self, req: Request) -> None:
        """Its KV blocks back to the pool, and what its drafts' proposer kept for it."""
        self.kv.free(req.seq_id)
        if self.proposer is not None:
            self.proposer.release(req.seq_id)

    def _preempt(self, req: Request) -> None:
        self._leave_slot(req)
        req.long_prefill_waits = 0
        self._free(req)
        req.num_computed_tokens = 0
        req.status = Status.WAITING
        self.waiting.appendleft(req)
        self.num_preemptions += 1

    def preempt_all(self, requests: list[Request]) -> None:
        """Send running requests back to the queue front, in their order, to be recomputed."""
        for req in reversed(requests):
            if req.status is Status.RUNNING:
                self.running.remove(req)
                self._preempt(req)
                self.num_preemptions -= 1  # a failed step, not memory pressure

    def finish(self, req: Request) -> None:
        """Drop a finished request from the running set and free its blocks at once."""
        self.running.remove(req)
        self._leave_slot(req)
        self._free(req)

    def abort(self, request_id: str) -> list[Request]:
        """Remove every sequence of `request_id` (all n samples) wherever it is; returns them."""
        found = [r for r in self.running if r.request_id == request_id]
        found += [r for r in self.waiting if r.request_id == request_id]
        for req in found:
            if req.status is Status.RUNNING:
                self.running.remove(req)
            else:
                self.waiting.remove(req)
            self._leave_slot(req)
            self._free(req)
        return found
