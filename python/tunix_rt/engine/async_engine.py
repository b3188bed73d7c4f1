"""The engine driven from a background thread, for asyncio callers (the server).

One thread owns the Engine and runs `step()` while there is work; callers add requests and read
per-request queues of outputs from their own event loops. Once an AsyncEngine runs an Engine,
nothing else may step it (a second driver would take the first one's outputs). Closing a stream early (a client that
disconnects) aborts its request, which frees its KV blocks at once. An error inside a step fails
every request in flight with that error instead of leaving their streams waiting forever.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator

from tunix_rt.engine.engine import Engine, EngineStats, Prompt
from tunix_rt.engine.params import RequestOutput, SamplingParams


class AsyncEngine:
    def __init__(self, engine: Engine):
        self.engine = engine
        self._lock = threading.Lock()  # guards the engine: the loop's step() vs callers' add/abort
        self._work = threading.Condition(self._lock)
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="tunix-rt-engine", daemon=True)
        self._thread.start()

    async def generate(self, prompt: Prompt, params: SamplingParams | None = None,
                       request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """Yield each sample's output as it advances until all n samples finished."""
        params = params or SamplingParams()
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        with self._work:
            if self._stopped:
                raise RuntimeError("the engine has been shut down")
            rid = self.engine.add_request(prompt, params, request_id)
            self._streams[rid] = (loop, queue)
            self._work.notify()
        remaining = params.n
        try:
            while remaining:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                remaining -= item.finished
                yield item
        finally:
            if remaining:
                self.abort(rid)

    def abort(self, request_id: str) -> None:
        with self._lock:
            self._streams.pop(request_id, None)
            self.engine.abort(request_id)

    def stats(self) -> EngineStats:
        with self._lock:
            return self.engine.stats()

    def shutdown(self) -> None:
        with self._work:
            self._stopped = True
            self._work.notify()
        self._thread.join()

    def _run(self) -> None:
        while True:
            with self._work:
                while not self._stopped and not self.engine.has_unfinished_requests():
                    self._work.wait()
                if self._stopped:
                    return
                try:
                    outputs = self.engine.step()
                except Exception as e:  # noqa: BLE001 - delivered to every waiting stream
                    for rid, (loop, queue) in self._streams.items():
                        self.engine.abort(rid)
                        loop.call_soon_threadsafe(queue.put_nowait, e)
                    self._streams.clear()
                    continue
                deliveries = [(self._streams.get(out.request_id), out) for out in outputs]
                for out in outputs:
                    if out.finished and not self.engine.has_request(out.request_id):
                        self._streams.pop(out.request_id, None)
            for target, out in deliveries:
                if target is not None:
                    loop, queue = target
                    loop.call_soon_threadsafe(queue.put_nowait, out)
