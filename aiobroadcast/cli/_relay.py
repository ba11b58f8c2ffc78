"""``aiobroadcast relay``: the command around ``aiobroadcast.relay``."""

from __future__ import annotations

import argparse
from typing import Any

from .._base.errors import TransportError, plural
from .._base.handle import Handle
from .._broadcast.relay import RelayEnd, relay
from ._common import EXIT_FAILED, HelpFormatter, error, fail, run_async, stop_on_signals
from ._pubsub import _remove_if_ours


# argparse, spelled out per command as in the other cli modules: a table or wrapper of
# add_parser/add_argument calls would only hide argparse's own API.
def register(sub: Any) -> None:
    p = sub.add_parser(
        "relay",
        help="re-publish a remote channel into a shared-memory ring on this host",
        description=(
            "Read the channel named by UPSTREAM (a handle file) over TCP and re-publish every "
            "message into a new shared-memory channel here, whose handle is written to --out "
            "(mode 0600, removed at exit). Local readers then cost the upstream writer one TCP stream. "
            "Runs until the upstream channel ends, then closes the local one (its readers get what was "
            "relayed, then the end: the channel's end if upstream closed it, WriterGone if upstream's "
            "writer died). Exit codes: 0 stopped by SIGTERM (the local channel closed cleanly), "
            "1 the upstream channel ended (closed, its writer died, or its stream broke), 2 usage error "
            "(missing or bad handle file, upstream unreachable), 130 Ctrl-C."
        ),
        formatter_class=HelpFormatter,
    )
    p.add_argument("upstream", help="handle file of the upstream channel")
    p.add_argument("--out", required=True, help="where to write the local channel's handle")
    p.add_argument(
        "--name", default=None, help="the relay's reader name upstream, unique there (default: reader-PID-N)"
    )
    p.add_argument("--capacity", type=int, default=None, help="slots of the local ring (default: upstream's)")
    p.add_argument("--slot-bytes", type=int, default=None, help="bytes per slot (default: upstream's)")
    p.add_argument("--max-readers", type=int, default=16, help="local readers")
    p.add_argument("--tcp", default=None, help="also serve the local channel on this endpoint")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    upstream = Handle.load(args.upstream)
    return run_async(lambda: _relay(args, upstream))


async def _relay(args: argparse.Namespace, upstream: Handle) -> int:
    local: list[Handle] = []

    def ready(h: Handle) -> None:
        try:
            h.save(args.out)
        except OSError as exc:
            fail(f"cannot write the handle file {args.out!r}: {exc.strerror or exc}")
        local.append(h)
        print(f"relaying {upstream.tcp} into {h.name}; handle in {args.out}", flush=True)

    end: RelayEnd | None = None
    try:
        async with stop_on_signals() as stop:
            end = await relay(
                upstream,
                name=args.name,
                capacity=args.capacity,
                slot_bytes=args.slot_bytes,
                max_readers=args.max_readers,
                tcp=args.tcp,
                on_ready=ready,
            )
    except TransportError as exc:
        if not local:
            raise  # upstream unreachable: a usage error, said by the command line (exit code 2)
        error(f"the upstream stream broke ({exc}); the local channel was closed, its readers get WriterGone")
        return EXIT_FAILED
    finally:
        if local:
            _remove_if_ours(args.out, local[0])
    if stop.exit_code is not None:
        return stop.exit_code
    assert end is not None
    relayed = plural(end.relayed, "message")
    if end.how == "closed":
        error(f"the upstream channel {upstream.name} closed after {relayed}; the local channel is closed too")
    else:
        error(
            f"the upstream writer (pid {upstream.writer_pid}) died without closing its channel, after {relayed}; "
            "the local channel was closed, its readers get WriterGone"
        )
    return EXIT_FAILED
