"""The engine driven from a background thread, for asyncio callers (the server).

One thread owns the Engine: it takes new requests and aborts from an inbox between steps, runs
`step()` while there is work, and hands each output to its caller's asyncio queue. Callers never
wait for a step to end (an event loop must not block for a whole batch's forward pass), so a
request's errors at admission (too long, bad ids, a grammar that does not compile) arrive as the
first item of its stream. `call` runs a function on that thread between steps (loading a LoRA adapter
while requests run). Once an AsyncEngine runs an Engine, nothing else may use it. Closing a
stream early (a client that disconnects) aborts its request, which frees its KV blocks before the
next step. An error inside a step fails every request in flight with that error instead of leaving
their streams waiting forever; the engine stays usable. With `warm_up_when_idle`, the thread compiles the
rest of the engine's warm-up (`Engine.warmup`, request options' samplers included) whenever it has nothing
else to do, one program at a time: a request that comes meanwhile waits at most for the compile in flight.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from typing import TypeVar

from tunix_rt.engine.engine import Engine, EngineStats, Prompt
from tunix_rt.engine.errors import EngineShutdownError
from tunix_rt.engine.params import RequestOutput, SamplingParams

log = logging.getLogger(__name__)
T = TypeVar("T")


class AsyncEngine:
    def __init__(self, engine: Engine, *, warm_up_when_idle: bool = False):
        self.engine = engine
        self._warming = warm_up_when_idle  # engine thread only: warm-up left to compile while idle
        self._warm_compiled, self._warm_seconds = 0, 0.0
        self._wake = threading.Condition()  # guards the inbox and _stopped
        self._inbox: list[tuple] = []  # ("add", id, prompt, params, target, lora, images) | ("abort", id) | ("call", ...)
        self._stopped = False
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}  # engine thread only
        self._stats = engine.stats()
        self._thread = threading.Thread(target=self._run, name="tunix-rt-engine", daemon=True)
        self._thread.start()

    async def generate(self, prompt: Prompt, params: SamplingParams | None = None,
                       request_id: str | None = None, *, lora_request=None,
                       images: Sequence = ()) -> AsyncIterator[RequestOutput]:
        """Yield each sample's output as it advances until all n samples finished (`images`: Engine.add_request's)."""
        params = params or SamplingParams()
        rid = uuid.uuid4().hex if request_id is None else str(request_id)
        queue: asyncio.Queue = asyncio.Queue()
        self._post(("add", rid, prompt, params, (asyncio.get_running_loop(), queue), lora_request, images))
        remaining = params.n
        try:
            while remaining:
                item = await queue.get()
                if isinstance(item, BaseException):
                    remaining = 0  # nothing of this request is left in the engine
                    raise item
                remaining -= item.finished
                yield item
        finally:
            if remaining:
                self.abort(rid)

    async def call(self, fn: Callable[[Engine], T]) -> T:
        """Run fn(engine) on the engine's thread between two steps (the engine is not thread-safe): how the
        server loads and unloads LoRA adapters while requests run. Its exception is raised here."""
        queue: asyncio.Queue = asyncio.Queue()
        self._post(("call", fn, (asyncio.get_running_loop(), queue)))
        result = await queue.get()
        if isinstance(result, _Raised):
            raise result.error
        return result

    def abort(self, request_id: str) -> None:
        """Stop a request; its blocks are freed before the engine's next step."""
        self._post(("abort", str(request_id)))

    def stats(self) -> EngineStats:
        """The engine's stats as of its latest step (read without waiting for the running one)."""
        return self._stats

    @property
    def warming_up(self) -> bool:
        """Whether warm-up programs are left to compile while idle (warm_up_when_idle)."""
        return self._warming

    def shutdown(self) -> None:
        with self._wake:
            self._stopped = True
            self._wake.notify()
        self._thread.join()

    def _post(self, item: tuple) -> None:
        with self._wake:
            if self._stopped:
                raise EngineShutdownError("the engine has been shut down")
            self._inbox.append(item)
            self._wake.notify()

    def _run(self) -> None:
        engine = self.engine
        while True:
            with self._wake:
                while (not self._stopped and not self._inbox and not engine.has_unfinished_requests()
                       and not self._warming):
                    self._wake.wait()
                if self._stopped:
                    break
                inbox, self._inbox = self._inbox, []
            if not inbox and not engine.has_unfinished_requests():
                self._warm_up()
                continue
            try:
                for item in inbox:
                    self._apply(item)
                if engine.has_unfinished_requests():
                    self._step()
                self._stats = engine.stats()
            except Exception as e:  # noqa: BLE001 - a fault outside a step: fail what is in flight, keep serving
                log.exception("engine loop error")
                self._fail_all(e)
        with self._wake:
            inbox, self._inbox = self._inbox, []
        stopped = EngineShutdownError("the engine has been shut down")
        for item in inbox:
            if item[0] == "add":
                _deliver(item[4], stopped)
            elif item[0] == "call":
                _deliver(item[2], _Raised(stopped))
        self._fail_all(stopped)

    def _warm_up(self) -> None:
        """Compile warm-up programs until a request or a shutdown comes (checked between two compiles)."""
        start = time.perf_counter()
        busy = lambda: bool(self._inbox) or self._stopped  # noqa: E731 - read without the lock: a hint
        try:
            self._warm_compiled += self.engine.warmup(busy, options=True)
        except Exception as e:  # noqa: BLE001 - what is left compiles on first use instead
            log.warning("compiling the engine's warm-up while idle failed: %s", e)
            self._warming = False
            return
        finally:
            self._warm_seconds += time.perf_counter() - start
        self._warming = busy()
        self._stats = self.engine.stats()
        if not self._warming:
            log.info("warm-up finished: %d programs compiled while idle, in %.1f s", self._warm_compiled,
                     self._warm_seconds)

    def _fail_all(self, error: BaseException) -> None:
        """End every stream in flight with `error` and drop its request from the engine."""
        for rid, target in self._streams.items():
            with contextlib.suppress(Exception):  # already failing: the stream must still end
                self.engine.abort(rid)
            _deliver(target, error)
        self._streams.clear()

    def _apply(self, item: tuple) -> None:
        if item[0] == "abort":
            self._streams.pop(item[1], None)
            self.engine.abort(item[1])
            return
        if item[0] == "call":
            _, fn, target = item
            try:
                result = fn(self.engine)
            except Exception as e:  # noqa: BLE001 - the caller's error, raised from its await
                result = _Raised(e)
            _deliver(target, result)
            return
        _, rid, prompt, params, target, lora_request, images = item
        try:
            self.engine.add_request(prompt, params, rid, lora_request=lora_request, images=images)
        except Exception as e:  # noqa: BLE001 - the caller's error, raised from its stream
            _deliver(target, e)
            return
        self._streams[rid] = target

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as e:  # noqa: BLE001 - delivered to every waiting stream
            self._fail_all(e)
            return
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}  # one wake-up per event loop per step
        for out in outputs:
            target = self._streams.get(out.request_id)
            if target is not None:
                by_loop.setdefault(target[0], []).append((target[1], out))
        for loop, items in by_loop.items():
            _deliver_all(loop, items)
        for out in outputs:  # only now: several samples of one request can finish in the same step
            if out.finished and not self.engine.has_request(out.request_id):
                self._streams.pop(out.request_id, None)


@dataclasses.dataclass(frozen=True)
class _Raised:
    """An engine call's exception on its way back to the awaiting caller (an exception could be its result)."""

    error: BaseException


def _deliver(target: tuple[asyncio.AbstractEventLoop, asyncio.Queue], item) -> None:
    _deliver_all(target[0], [(target[1], item)])


def _deliver_all(loop: asyncio.AbstractEventLoop, items: list[tuple[asyncio.Queue, object]]) -> None:
    def put():
        for queue, item in items:
            queue.put_nowait(item)

    try:
        loop.call_soon_threadsafe(put)
    except RuntimeError:  # the caller's event loop has closed: nobody is left to read it
        pass
