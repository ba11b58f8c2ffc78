"""An HTTP server whose handlers ``await reader.get()`` and stream broadcasts to clients.

Every ``GET /events`` opens its own reader on the channel and streams each message as a
server-sent event, so every client receives every broadcast, in order, from the moment it
connected. ``POST /publish`` (a JSON body) broadcasts one message; a background task also
broadcasts a tick every ``--tick`` seconds. The channel uses policy ``"lag"``: a slow HTTP client
never holds back the writer or the other clients; it is told how many messages it missed.

    pip install starlette uvicorn
    python examples/async_server.py --port 8000
    curl -N http://127.0.0.1:8000/events            # in two terminals: both see the same stream
    curl -d '{"hello": "world"}' http://127.0.0.1:8000/publish

The readers could as well live in other processes (or other hosts, over TCP): start several
servers with ``--handle FILE`` pointing at a channel made by ``aiobroadcast publish FILE``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.routing import Route

import aiobroadcast as ab

PAGE = """<!doctype html><title>aiobroadcast</title><pre id="log"></pre><script>
const log = document.getElementById("log");
new EventSource("/events").onmessage = (e) => { log.textContent += e.data + "\\n"; };
</script>"""


class Channel:
    """The server's side of the channel: the writer (when this server owns it) and its handle."""

    def __init__(self) -> None:
        self.writer: ab.Writer[Any] | None = None
        self.handle: ab.Handle | None = None
        self.clients = itertools.count(1)


def sse(event: str, data: Any, ident: int | None = None) -> str:
    """One server-sent event."""
    head = f"id: {ident}\n" if ident is not None else ""
    return f"{head}event: {event}\ndata: {json.dumps(data)}\n\n"


def build_app(args: argparse.Namespace) -> Starlette:
    channel = Channel()

    async def events(request: Request) -> Response:
        assert channel.handle is not None
        name = f"http-client-{next(channel.clients)}"
        try:
            reader = await ab.open_reader(channel.handle, name=name, trust_pickle=False)
        except ab.TooManyReaders:
            return JSONResponse({"error": "too many clients, try again later"}, status_code=503)
        except ab.InvalidHandle as exc:  # the channel is gone (its writer exited)
            return JSONResponse({"error": str(exc)}, status_code=503)

        async def stream() -> AsyncIterator[str]:
            # Starlette cancels this generator when the client disconnects: a cancelled get()
            # takes nothing, and closing the reader releases its place at once.
            async with reader:
                yield sse("ready", {"reader": name})
                n = 0
                while True:
                    try:
                        msg = await reader.get()
                    except ab.ReaderLagged as exc:
                        yield sse("lagged", {"missed": exc.missed})
                        continue
                    except (ab.EndOfStream, ab.WriterGone):
                        yield sse("end", {"received": n})
                        return
                    n += 1
                    yield sse("message", msg, ident=n)

        return StreamingResponse(stream(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    async def publish(request: Request) -> Response:
        if channel.writer is None:
            return JSONResponse({"error": "this server only reads (started with --handle)"}, status_code=405)
        try:
            body = await request.json()
        except ValueError:
            return JSONResponse({"error": "the body must be JSON"}, status_code=400)
        try:
            await channel.writer.put(body)
            sent = channel.writer.statistics().sent
        except ab.ClosedResourceError:
            return JSONResponse({"error": "shutting down"}, status_code=503)
        return JSONResponse({"sent": sent})

    async def index(request: Request) -> Response:
        return HTMLResponse(PAGE)

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        if args.handle is not None:
            channel.handle = ab.Handle.load(args.handle)
            yield
            return
        async with ab.open_writer(capacity=1024, slot_bytes=4096, max_readers=64, policy="lag", codec="json") as w:
            channel.writer, channel.handle = w, w.handle
            async with anyio.create_task_group() as tg:
                if args.tick > 0:
                    tg.start_soon(ticks, w, args.tick)
                yield
                tg.cancel_scope.cancel()

    app = Starlette(
        routes=[Route("/", index), Route("/events", events), Route("/publish", publish, methods=["POST"])],
        lifespan=lifespan,
    )
    app.state.channel = channel
    return app


async def ticks(writer: ab.Writer[Any], every: float) -> None:
    for n in itertools.count():
        try:
            await writer.put({"tick": n})
        except ab.ClosedResourceError:  # shutting down
            return
        await anyio.sleep(every)


class Server(uvicorn.Server):
    """uvicorn waits for open responses before shutting down, and event streams never end by
    themselves: close the channel first, so that every stream ends with an ``end`` event."""

    def __init__(self, config: uvicorn.Config, channel: Channel) -> None:
        super().__init__(config)
        self.channel = channel

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started and sockets:
            host, port = sockets[0].getsockname()[:2]
            print(f"listening on http://{host}:{port}", flush=True)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        if self.channel.writer is not None:
            await self.channel.writer.aclose()
        await super().shutdown(sockets)


def main() -> None:
    parser = argparse.ArgumentParser(description="An HTTP server that streams broadcasts to its clients.")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000, help="0: any free port")
    parser.add_argument("--tick", type=float, default=1.0, help="seconds between ticks (0: no ticks)")
    parser.add_argument("--handle", default=None, help="read this channel (a handle file) instead of owning one")
    args = parser.parse_args()
    app = build_app(args)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((args.host, args.port))
    config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5)
    server = Server(config, app.state.channel)
    try:
        server.run(sockets=[sock])  # Ctrl-C or SIGTERM: every stream ends, then the channel is removed
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
