"""A local image server for the frontend's fetch tests: real HTTP on 127.0.0.1, in a thread."""

from __future__ import annotations

import asyncio
import threading

from aiohttp import web

from llmbus.testing.fake_scheduler import WAIT


class ImageServer:
    """An aiohttp server on 127.0.0.1, in a thread of its own: ``png`` at /img.png and ``jpeg`` (no declared
    type) at /img.jpg, a 404, text, redirects (/moved to /img.png on the same host, /away to it under the
    name ``localhost``, /loop to itself), a body without a length that never ends, and one that never answers
    (until the server stops). Counts each (host, path)'s hits."""

    def __init__(self, png: bytes, jpeg: bytes):
        self.png, self.jpeg = png, jpeg
        self.hits: dict[str, int] = {}  # path -> hits
        self.hosts: dict[tuple[str, str], int] = {}  # (Host header's name, path) -> hits
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="image-server", daemon=True)
        self._thread.start()
        assert self._ready.wait(WAIT)
        self.url = f"http://127.0.0.1:{self.port}"

    def _app(self) -> web.Application:
        async def count(request, handler):
            self.hits[request.path] = self.hits.get(request.path, 0) + 1
            key = (request.host.rsplit(":", 1)[0], request.path)
            self.hosts[key] = self.hosts.get(key, 0) + 1
            return await handler(request)

        async def endless(request):
            resp = web.StreamResponse()  # chunked: no Content-Length to refuse it by
            await resp.prepare(request)
            while True:
                await resp.write(b"\0" * 4096)

        async def hang(request):
            await self._stop.wait()
            return web.Response()

        app = web.Application(middlewares=[web.middleware(count)])
        async def png(request):
            return web.Response(body=self.png, content_type="image/png")

        async def jpeg(request):
            return web.Response(body=self.jpeg)

        async def moved(request):
            raise web.HTTPFound("/img.png")

        async def away(request):
            raise web.HTTPFound(f"http://localhost:{self.port}/img.png")

        async def loop(request):
            raise web.HTTPFound("/loop")

        async def text(request):
            return web.Response(text="not an image")

        app.router.add_get("/img.png", png)
        app.router.add_get("/img.jpg", jpeg)
        app.router.add_get("/moved", moved)
        app.router.add_get("/away", away)
        app.router.add_get("/loop", loop)
        app.router.add_get("/text", text)
        app.router.add_get("/endless", endless)
        app.router.add_get("/hang", hang)
        return app

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._stop = asyncio.Event()
        runner = web.AppRunner(self._app(), access_log=None, shutdown_timeout=0.1)
        self._loop.run_until_complete(runner.setup())
        site = web.TCPSite(runner, "127.0.0.1", 0)
        self._loop.run_until_complete(site.start())
        self.port = runner.addresses[0][1]
        self._ready.set()
        self._loop.run_until_complete(self._stop.wait())
        self._loop.run_until_complete(runner.cleanup())
        self._loop.close()

    def close(self) -> None:
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(WAIT)
