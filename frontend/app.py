"""Build the aiohttp app, serve it, and run it as an llmbus service.

Start order: load the tokenizer; connect to the scheduler and finish the handshake (aiohttp's
``cleanup_ctx``, so a missing scheduler fails start-up with a clear error instead of a server that
answers nothing); only then listen for HTTP, then report ready to the supervisor.
"""

from __future__ import annotations

import asyncio
import signal
from typing import Callable

import structlog
import zmq.asyncio
from aiohttp import web

from llmbus.bus import tracing
from llmbus.bus.gc_pauses import freeze_startup_heap
from llmbus.bus.service import ServiceContext, run_service
from llmbus.frontend.config import FrontendConfig, resolve_limits
from llmbus.frontend.engine_client import EngineClient
from llmbus.frontend.errors import ApiError, ErrorKind
from llmbus.frontend.generation import Generator
from llmbus.frontend.images import FetchRules
from llmbus.frontend.middleware import (auth_middleware, cors_middleware, error_middleware,
                                         request_metrics_middleware, tracing_middleware)
from llmbus.frontend.routes import setup_routes
from llmbus.frontend.state import STATE, FrontendState
from llmbus.frontend.tokenizer import ModelTokenizer, load_tokenizer

log = structlog.get_logger("llmbus.frontend")

ABORTED_ANSWER_S = 2.0  # after a drain is cut short: time for handlers to write their error
STATS_INTERVAL_S = 0.25  # request metrics go to the other frontends at most this often


def make_app(config: FrontendConfig, *, tokenizer: ModelTokenizer | None = None,
             zmq_ctx: zmq.asyncio.Context | None = None) -> web.Application:
    """The frontend app; the scheduler handshake runs when the app starts (runner.setup())."""
    # outermost first: CORS headers go on every answer, 401s included
    middlewares = [cors_middleware(config.cors_allow_origin)]
    if tracing.enabled():
        middlewares.append(tracing_middleware)  # outside the error middleware: it sees the final status
    if config.api_key:
        middlewares.append(auth_middleware(config.api_key))
    middlewares += [error_middleware, request_metrics_middleware]
    app = web.Application(client_max_size=config.payload_limit, middlewares=middlewares)
    state = FrontendState(config=config, tokenizer=tokenizer or load_tokenizer(config.model_dir))
    app[STATE] = state
    state.sampling_defaults.log_line()

    async def engine_ctx(app: web.Application):
        state.chat_template.load()  # compiled now, not in the first chat request
        engine = EngineClient(config.requests_endpoint, config.events_endpoint, config.frontend_id, zmq_ctx,
                              hang_timeout_s=config.scheduler_hang_timeout_s)
        hello = await engine.start(config.scheduler_timeout_s)
        try:
            limits = resolve_limits(config, state.tokenizer.model_max_length, hello.max_batch_total_tokens)
        except ValueError:
            await engine.close()
            raise
        state.engine, state.limits = engine, limits
        state.request_metrics.set_limits(limits.max_input_tokens, limits.max_total_tokens)
        # several frontends (SO_REUSEPORT) each admit their share of the launch's limit, never fewer than one
        # request may take (each of its choices takes one): a smaller share would refuse such a request always
        share = max(-(-config.max_concurrent_requests // config.frontends_sharing),
                    min(config.max_concurrent_requests, max(config.max_client_batch_size, config.max_best_of)))
        state.generator = Generator(engine, state.tokenizer, limits, share,
                                    config.validation_workers, config.enable_prefill_logprobs,
                                    on_finished=state.request_metrics.generation_finished, vision=state.vision,
                                    image_fetch=FetchRules.of(config.max_image_fetch_size,
                                                              config.allowed_media_domains))
        log.info("limits", max_input_tokens=limits.max_input_tokens,
                 max_total_tokens=limits.max_total_tokens, eos_token_ids=state.tokenizer.eos_token_ids)
        if state.vision is not None:
            log.info("images", family=state.vision.family, image_token=state.vision.image_token,
                     tokens_per_image=state.vision.tokens_per_image)
        stats_sender = asyncio.create_task(_send_request_stats(state), name="request-stats")
        yield
        stats_sender.cancel()
        await asyncio.gather(stats_sender, return_exceptions=True)
        state.generator.shutdown()
        await engine.close()

    app.cleanup_ctx.append(engine_ctx)
    setup_routes(app)
    return app


async def _send_request_stats(state: FrontendState) -> None:
    """This frontend's request metrics to the others (through the scheduler) whenever they changed."""
    sent = 0
    while True:
        metrics = state.request_metrics
        if metrics.version != sent:
            sent = metrics.version
            await state.engine.send_stats(metrics.snapshot(state.config.frontend_id))
        await asyncio.sleep(STATS_INTERVAL_S)


def make_runner(app: web.Application, config: FrontendConfig) -> web.AppRunner:
    # handler_cancellation: a client that disconnects cancels its handler, which aborts its request
    return web.AppRunner(app, handle_signals=False, handler_cancellation=True,
                         shutdown_timeout=ABORTED_ANSWER_S, access_log=None)  # after our own drain


async def serve(config: FrontendConfig, *, on_ready: Callable[[str], None] | None = None,
                stop: asyncio.Event | None = None, abort: asyncio.Event | None = None,
                install_signals: bool = True, tokenizer: ModelTokenizer | None = None) -> None:
    """Serve until ``stop`` is set (or SIGTERM/SIGINT when ``install_signals``); calls ``on_ready(url)``.

    Then drain: new requests get 503 while those in flight finish, for up to ``shutdown_timeout_s``;
    ``abort`` (a second signal) or the timeout ends what is left with a 503 error."""
    stop = stop or asyncio.Event()
    abort = abort or asyncio.Event()
    if install_signals:
        loop = asyncio.get_running_loop()

        def on_signal() -> None:
            (abort if stop.is_set() else stop).set()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, on_signal)
    app = make_app(config, tokenizer=tokenizer)
    runner = make_runner(app, config)
    # the handshake may wait long for the scheduler: a stop request must not wait for it
    setup = asyncio.ensure_future(runner.setup())
    stopping = asyncio.ensure_future(stop.wait())
    await asyncio.wait({setup, stopping}, return_when=asyncio.FIRST_COMPLETED)
    if not setup.done():
        setup.cancel()
        await asyncio.gather(setup, return_exceptions=True)
        log.info("stopped before the scheduler answered")
        return
    stopping.cancel()
    setup.result()  # raises the handshake's error
    try:
        site = web.TCPSite(runner, config.hostname, config.port, reuse_address=True,
                           reuse_port=config.reuse_port or None)
        await site.start()
        port = runner.addresses[0][1] if runner.addresses else config.port
        url = f"http://{config.hostname}:{port}"
        log.info("listening", url=url, frontend_id=config.frontend_id)
        if on_ready is not None:
            on_ready(url)
        await stop.wait()
        await _drain(app[STATE], config.shutdown_timeout_s, abort)
    finally:
        await runner.cleanup()


async def _drain(state: FrontendState, timeout_s: float, abort: asyncio.Event) -> None:
    generator = state.generator
    generator.draining = True
    log.info("stopping: draining requests in flight", in_flight=generator.permits_in_use, timeout_s=timeout_s)
    idle = asyncio.ensure_future(generator.wait_idle())
    aborted = asyncio.ensure_future(abort.wait())
    await asyncio.wait({idle, aborted}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
    aborted.cancel()
    if not idle.done():
        rids = state.engine.fail_all(ApiError(ErrorKind.SHUTTING_DOWN))
        log.warning("stopping: ending the requests still in flight", rids=rids,
                    reason="second signal" if abort.is_set() else f"not done after {timeout_s:g}s")
        # their handlers now answer the error; give them a moment to write it
        await asyncio.wait({idle}, timeout=ABORTED_ANSWER_S)
    idle.cancel()
    log.info("drained")


def run_frontend(config: FrontendConfig, service_name: str = "frontend") -> int:
    """Run the frontend as an llmbus service (logging, parent death, ServiceReady/Fatal); exit code."""

    def body(ctx: ServiceContext) -> None:
        def ready(url: str) -> None:
            freeze_startup_heap()  # the tokenizer, the templates and the app live as long as the process
            ctx.ready(url)

        tracing.setup(config.otlp_endpoint, f"{config.otlp_service_name}.frontend")
        try:
            asyncio.run(serve(config, on_ready=ready))
        finally:
            tracing.shutdown()

    return run_service(service_name, body)
