"""The FastAPI application and `tunix-rt serve`: routes, API key, body limit, CORS, loading.

The HTTP server starts at once and loads the model in a background thread: /health answers 503
until the engine is ready (then 200), and /v1 routes answer 503 meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import logging
import threading
import time

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel
from starlette.exceptions import HTTPException

import tunix_rt
from serving import handlers, pooling, responses, tokenization
from serving import protocol as p
from serving.errors import APIError, error_body
from serving.errors import install as install_errors
from serving.handlers import ServerState
from serving.metrics import ServerMetrics
from tunix_rt.engine.config import EngineConfig
from tunix_rt.engine.errors import InvalidRequestError
from tunix_rt.tools.tool_calls import tool_format_for

log = logging.getLogger("tunix_rt.serve")


@dataclasses.dataclass(frozen=True)
class ServeOptions:
    model: str = "default"
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    metrics_without_auth: bool = False  # /metrics answers without the API key (a scraper that cannot send one)
    served_model_name: str | None = None
    allowed_origins: tuple[str, ...] = ()
    max_waiting: int = 256  # sequences queued beyond max_num_seqs before 429
    max_body_bytes: int = 8 << 20
    limit_mm_per_prompt: int = 4  # images in one chat request (vLLM's --limit-mm-per-prompt '{"image": N}')
    dequantize: bool = False
    lora: str | None = None  # a peft LoRA adapter directory applied on the model
    lora_modules: tuple[tuple[str, str], ...] = ()  # (name, path) adapters served beside the base model
    reasoning_parser: str | None = None  # tools/reasoning.py PARSERS: replies' reasoning apart from their content
    engine: EngineConfig = dataclasses.field(default_factory=EngineConfig.serving)  # the engine's limits and sizing
    compile_cache_dir: str | None = None  # a persistent XLA compilation cache (engine/compile_cache.py); None: off


class _BodyLimit:
    """413 for a body over the limit, by its Content-Length or, when chunked, as it arrives."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        message = f"the request body is larger than {self.limit} bytes"
        length = dict(scope.get("headers") or ()).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.limit:
            return await JSONResponse(error_body(413, message), status_code=413)(scope, receive, send)
        seen = 0

        async def limited():
            nonlocal seen
            received = await receive()
            if received["type"] == "http.request":
                seen += len(received.get("body", b""))
                if seen > self.limit:  # while FastAPI reads the body: its handlers answer with the envelope
                    raise HTTPException(413, message)
            return received

        await self.app(scope, limited, send)


OPEN_PATHS = frozenset({"/health"})  # the only paths --api-key leaves open (plus /metrics when asked)


class _ApiKey:
    """401 unless `Authorization: Bearer <key>` matches, on every path but `open_paths`: an allowlist,
    so a route added later is guarded by default."""

    def __init__(self, app, api_key: str, open_paths: frozenset[str] = OPEN_PATHS):
        self.app, self.key, self.open = app, api_key.encode(), open_paths

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope.get("path", "") not in self.open:
            auth = dict(scope.get("headers") or ()).get(b"authorization", b"")
            scheme, _, token = auth.partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.key):
                body = error_body(401, "Incorrect or missing API key: send it as 'Authorization: Bearer <key>'.",
                                  code="invalid_api_key")
                return await JSONResponse(body, status_code=401)(scope, receive, send)
        return await self.app(scope, receive, send)


async def _unless_disconnected(request: Request, coro):
    """Run a non-streaming handler; if the client hangs up first, cancel it (which aborts its
    engine requests and frees their KV blocks) instead of finishing work nobody will read."""
    task = asyncio.ensure_future(coro)

    async def disconnected():
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if not task.done():
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return Response(status_code=499)
    return task.result()


def create_app(state: ServerState, options: ServeOptions) -> FastAPI:
    app = FastAPI(title="tunix-rt OpenAI-compatible server", version="0.1.0")
    install_errors(app)

    def ready() -> None:
        if state.engine is None and state.scorer is None:
            raise APIError(503, "the model is still loading", code="model_loading")

    def generative(route: str) -> None:
        """The generative routes: ready, and not a sequence classifier (which has no engine)."""
        ready()
        if state.scorer is not None:
            raise APIError(400, f"{state.model_name} is a sequence classification (reward) model: it answers /pooling "
                           f"and /classify, not {route}", code="model_not_generative")

    def classifier(route: str) -> None:
        ready()
        if state.scorer is None:
            raise APIError(400, f"{state.model_name} is a generative model: {route} needs a sequence classification "
                           "(reward) model", code="model_not_classifier")

    def check_model(model: str | None) -> None:
        state.lora_for(model)  # the base model or a served adapter, else 404

    @app.get("/health")
    async def health():
        ready()
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", response_model=p.ModelList)
    async def models():
        ready()
        base = p.ModelCard(id=state.model_name, root=state.root, max_model_len=state.max_model_len)
        adapters = [p.ModelCard(id=name, root=path, parent=state.model_name, max_model_len=state.max_model_len)
                    for name, path in state.adapters.items()]
        return p.ModelList(data=[base, *adapters])

    @app.post("/v1/load_lora_adapter", response_class=PlainTextResponse,
              responses={400: {"model": p.ErrorResponse}})
    async def load_lora_adapter(body: p.LoadLoRAAdapterRequest):
        """vLLM's runtime adapter loading: the adapter is read and checked, then requests may name it."""
        generative("/v1/load_lora_adapter")
        if body.lora_name == state.model_name or body.lora_name in state.adapters:
            raise APIError(400, f"The lora adapter '{body.lora_name}' has already been loaded.", param="lora_name",
                           code="lora_adapter_exists")
        engine = state.engine.engine

        async def load():
            # read and checked off the engine's thread (file reads, parsing); only registered between two steps
            adapter = await asyncio.to_thread(engine.read_lora, body.lora_name, body.lora_path)
            await state.engine.call(lambda e: e.register_lora(adapter))
            state.adapters[body.lora_name] = body.lora_path

        try:  # shielded: a client that leaves mid-way must not leave the server and the engine disagreeing
            await asyncio.shield(asyncio.ensure_future(load()))
        except InvalidRequestError as e:  # LoRAAdapterError, or an engine without adapter slots
            raise APIError(400, str(e), param="lora_path", code=e.code) from None
        return f"Success: LoRA adapter '{body.lora_name}' added successfully."

    @app.post("/v1/unload_lora_adapter", response_class=PlainTextResponse,
              responses={404: {"model": p.ErrorResponse}})
    async def unload_lora_adapter(body: p.UnloadLoRAAdapterRequest):
        """vLLM's runtime unloading: new requests cannot name it; those in flight finish with it."""
        generative("/v1/unload_lora_adapter")
        if body.lora_name not in state.adapters:
            raise APIError(404, f"The lora adapter '{body.lora_name}' cannot be found.", param="lora_name",
                           code="model_not_found")
        del state.adapters[body.lora_name]  # first: no request planned from here on names it
        await asyncio.shield(asyncio.ensure_future(state.engine.call(lambda e: e.remove_lora(body.lora_name))))
        return f"Success: LoRA adapter '{body.lora_name}' removed successfully."

    @app.get("/version")
    async def version():
        return {"version": tunix_rt.__version__}

    @app.post("/tokenize", response_model=p.TokenizeResponse, responses={400: {"model": p.ErrorResponse}})
    async def tokenize(body: p.TokenizeRequest):
        ready()
        check_model(body.model)
        return tokenization.tokenize(state, body)

    @app.get("/tokenizer_info", response_model=p.TokenizerInfo)
    async def tokenizer_info():
        ready()
        return tokenization.tokenizer_info(state)

    @app.post("/detokenize", response_model=p.DetokenizeResponse, responses={400: {"model": p.ErrorResponse}})
    async def detokenize(body: p.DetokenizeRequest):
        ready()
        check_model(body.model)
        return tokenization.detokenize(state, body)

    errors = {status: {"model": p.ErrorResponse} for status in (400, 401, 404, 413, 429)}

    @app.post("/pooling", response_model=p.PoolingResponse, responses=errors)
    async def pooling_route(body: p.PoolingRequest):
        classifier("/pooling")
        check_model(body.model)
        return await _pooled(pooling.pooling, body)

    @app.post("/classify", response_model=p.ClassifyResponse, responses=errors)
    async def classify_route(body: p.PoolingRequest):
        classifier("/classify")
        check_model(body.model)
        return await _pooled(pooling.classify, body)

    async def _pooled(fn, body):
        """A scoring request holds one place of the server's capacity (429 past it) while it runs."""
        release = handlers.admit(state, 1)
        try:
            return await asyncio.to_thread(fn, state, body, state.model_name)
        finally:
            release()

    @app.post("/v1/chat/completions", response_model=p.ChatCompletion, responses=errors)
    async def chat_completions(body: p.ChatCompletionRequest, request: Request):
        generative("/v1/chat/completions")
        check_model(body.model)
        with_images = any(isinstance(m.content, list) and any(part.type == "image_url" for part in m.content)
                          for m in body.messages)
        # decoding and resizing images takes a while: off the event loop, which serves every other stream
        plan = await asyncio.to_thread(handlers.plan_chat, state, body) if with_images else handlers.plan_chat(state, body)
        return await _run(request, plan.params.n, body.stream, lambda: handlers.chat_stream(state, body, plan),
                          lambda: handlers.chat_full(state, body, plan))

    @app.post("/v1/completions", response_model=p.Completion, responses=errors)
    async def completions(body: p.CompletionRequest, request: Request):
        generative("/v1/completions")
        check_model(body.model)
        plan = handlers.plan_completion(state, body)
        return await _run(request, plan.params.n * len(plan.prompts), body.stream,
                          lambda: handlers.completion_stream(state, body, plan),
                          lambda: handlers.completion_full(state, body, plan))

    @app.post("/v1/responses", response_model=p.ResponseObject, responses=errors)
    async def responses_create(body: p.ResponsesRequest, request: Request):
        generative("/v1/responses")
        check_model(body.model)
        plan = responses.plan(state, body)
        return await _run(request, 1, body.stream, lambda: responses.stream(state, body, plan),
                          lambda: responses.full(state, body, plan))

    async def _run(request: Request, sequences: int, stream: bool, start_stream, full):
        release = handlers.admit(state, sequences)
        streaming = False
        try:
            if not stream:
                result = await _unless_disconnected(request, full())
                if not isinstance(result, BaseModel):  # the client left (a Response), or a plain dict
                    return result
                # serialized off the event loop: a long prompt's prompt log-probs are megabytes of JSON, and
                # /health and every other client wait while the loop works
                body = await asyncio.to_thread(result.model_dump_json)
                return Response(body, media_type="application/json")
            events = await _unless_disconnected(request, start_stream())  # may wait in the queue a while
            if isinstance(events, Response):  # the client left before its first token
                return events
            response = StreamingResponse(_released(events, release), media_type="text/event-stream")
            streaming = True
            return response
        finally:
            if not streaming:
                release()

    if options.api_key is not None:
        open_paths = OPEN_PATHS | ({"/metrics"} if options.metrics_without_auth else set())
        app.add_middleware(_ApiKey, api_key=options.api_key, open_paths=frozenset(open_paths))
    if options.allowed_origins:  # added last, so it runs first: preflights need no key
        app.add_middleware(CORSMiddleware, allow_origins=list(options.allowed_origins), allow_credentials=True,
                           allow_methods=["*"], allow_headers=["*"])
    return app


async def _released(events, release):
    """The stream's events; the request's place in the queue is given back when it ends."""
    try:
        async with contextlib.aclosing(events):
            async for event in events:
                yield event
    finally:
        release()


def build_state(options: ServeOptions) -> ServerState:
    """The state a loading server starts with; `load_engine` fills in the rest."""
    name = options.served_model_name or options.model
    state = ServerState(engine=None, tokenizer=None, model_name=name, max_model_len=0,
                        tool_format=tool_format_for(None), metrics=None,
                        capacity=options.engine.max_num_seqs + options.max_waiting, root=str(options.model),
                        reasoning_parser=options.reasoning_parser, max_images=options.limit_mm_per_prompt)
    state.metrics = ServerMetrics(lambda: None if state.engine is None else state.engine.stats(), name,
                                  lambda: state.engine is not None and state.engine.warming_up)
    return state


def load_engine(state: ServerState, options: ServeOptions, stopping: threading.Event | None = None) -> None:
    """Load the model, compile the engine's steps, then set state.engine; a `stopping` server (Ctrl-C while this
    runs) ends it after the compile in progress, with no engine set."""
    from tunix_rt.engine.async_engine import AsyncEngine
    from tunix_rt.engine.engine import Engine

    stopping = stopping or threading.Event()

    config = options.engine
    if options.lora_modules and not config.max_loras:  # a slot per adapter named at start
        config = dataclasses.replace(config, max_loras=len(options.lora_modules))
    if options.lora is None and _classifier(options.model):
        _load_scorer(state, options)
        return
    if options.lora is None:
        engine = Engine(options.model, None, config, dequantize=options.dequantize)
    else:
        from tunix_rt.checkpoints.loader import load_model
        from tunix_rt.checkpoints.peft_adapter import load_adapter

        loaded = load_model(options.model, dequantize=options.dequantize)
        load_adapter(loaded.model, options.lora)
        engine = Engine(loaded.model, loaded.tokenizer, config)
    for name, path in options.lora_modules:
        engine.add_lora(name, path)
        state.adapters[name] = str(path)
    state.tokenizer = engine.tokenizer
    if state.tokenizer is None:
        raise ValueError(f"{options.model} has no tokenizer; the server needs one to read and write text")
    state.max_model_len = engine.max_model_len
    vision = engine.model.config.vision
    if vision is not None:  # the checkpoint's own preprocessor_config.json when it is a directory
        from pathlib import Path

        from tunix_rt.models.image_processor import ImageProcessor, ImageTokensText

        source = Path(str(options.model))
        state.image_processor = ImageProcessor.for_model(vision, source if source.is_dir() else None)
        state.image_text = ImageTokensText.of(engine.tokenizer, vision)
    engine.grammars.prepare()  # tool choices and response formats then never wait for it
    start = time.perf_counter()
    # Before /health: what a lone request of any length needs, so early requests with short client timeouts
    # never wait for a compile. The batched steps' and the request options' programs compile on the engine's
    # thread while it is idle (the default model: 24 programs in 7-9.5 s, then 121 in 54 s).
    compiled = engine.warmup(stopping.is_set, max_rows=1)
    if stopping.is_set():
        return
    log.info("compiled %d engine step programs in %.1f s; the rest compile while the engine is idle", compiled,
             time.perf_counter() - start)
    state.tool_format = tool_format_for(engine.tokenizer.chat_template)
    state.engine = AsyncEngine(engine, warm_up_when_idle=True)  # last: /health turns 200 once all above is set
    log.info("serving %s (max_model_len %d, tool format %s%s)", state.model_name, state.max_model_len,
             state.tool_format.name, "" if state.tool_format.native else " via the server's tools prompt")


def _classifier(model: str) -> bool:
    """Whether `model` is an HF directory of a sequence classification (reward) model."""
    from pathlib import Path

    from tunix_rt.checkpoints import hf_dir

    path = Path(str(model))
    return (path / "config.json").is_file() and hf_dir.read_config(path).num_labels > 0


def _load_scorer(state: ServerState, options: ServeOptions) -> None:
    from tunix_rt.checkpoints.loader import load_model

    if options.lora_modules:
        raise ValueError("--lora-modules serve a generative model's adapters; this is a sequence classifier")
    loaded = load_model(options.model, dequantize=options.dequantize)
    max_model_len = options.engine.max_model_len or min(loaded.model.config.max_position_embeddings, 4096)
    state.tokenizer = loaded.tokenizer
    state.max_model_len = max_model_len
    state.tool_format = tool_format_for(loaded.tokenizer.chat_template)
    state.scorer = pooling.Scorer(loaded.model, loaded.tokenizer, loaded.hf_config, max_model_len)  # last: ready
    log.info("serving %s: a sequence classifier of %d label(s) on /pooling and /classify", state.model_name,
             loaded.model.config.num_labels)


def serve(options: ServeOptions) -> None:
    """Run the server until interrupted; the model loads while /health already answers (503)."""
    import uvicorn

    from tunix_rt.engine.compile_cache import use_compile_cache

    cache = use_compile_cache(options.compile_cache_dir)
    log.info("compilation cache: %s", cache or "off")
    state = build_state(options)
    app = _BodyLimit(create_app(state, options), options.max_body_bytes)
    # SIGTERM ends the server within about a second whatever runs: in-flight requests get half a second, then
    # the engine stops after its current step (long prompts advance in short steps: long_prefill_token_threshold).
    server = uvicorn.Server(uvicorn.Config(app, host=options.host, port=options.port, log_level="info",
                                           timeout_graceful_shutdown=0.5))
    failure: list[BaseException] = []
    stopping = threading.Event()

    def load():
        try:
            load_engine(state, options, stopping)
        except BaseException as e:  # noqa: BLE001 - reported below; the server must not keep answering 503
            log.error("loading %s failed: %s", options.model, e)
            failure.append(e)
            server.should_exit = True

    loader = threading.Thread(target=load, name="tunix-rt-load", daemon=True)
    loader.start()
    try:
        server.run()
    finally:
        # Shut down while loading: the load ends after its compile in progress; a process that exited in the
        # middle of an XLA compile would abort ("terminate called ...") instead of stopping cleanly.
        stopping.set()
        if loader.is_alive():
            log.info("waiting for the model load to stop")
            loader.join()
        if state.engine is not None:
            state.engine.shutdown()
    if failure:
        raise failure[0]
