"""``aiobroadcast relay``: the command around ``aiobroadcast.relay``."""

from __future__ import annotations

import argparse
from typing import Any

import anyio

from .._handle import Handle
from .._relay import relay
from ._common import EXIT_OK


def register(sub: Any) -> None:
    p = sub.add_parser(
        "relay",
        help="re-publish a remote channel into a shared-memory ring on this host",
        description=(
            "Read the channel named by UPSTREAM (a handle file) over TCP and re-publish every "
            "message into a new shared-memory channel here, whose handle is written to --out "
            "(mode 0600). Local readers then cost the upstream writer one TCP stream."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
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

    def ready(h: Handle) -> None:
        h.save(args.out)
        print(f"relaying {upstream.tcp} into {h.name}; handle in {args.out}", flush=True)

    anyio.run(
        lambda: relay(
            upstream,
            name=args.name,
            capacity=args.capacity,
            slot_bytes=args.slot_bytes,
            max_readers=args.max_readers,
            tcp=args.tcp,
            on_ready=ready,
        )
    )
    return EXIT_OK
