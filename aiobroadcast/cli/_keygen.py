"""``aiobroadcast keygen``: fixed CurveZMQ keys for a channel served over TCP.

Without keys, every ``open_writer(tcp=...)`` makes fresh ones and puts the readers' share in the
handle (saved with mode 0600), so handing out the handle file is handing out the keys. A key
file gives the same keys across writer restarts: ``aiobroadcast publish --keys FILE`` (or
``open_writer(keys=CurveKeys.load(FILE))``); with a fixed port the restarted writer is the same
channel, and accepts the handles of its earlier runs. The file is ``CurveKeys`` as JSON, mode 0600.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from .._handle import CurveKeys
from ._common import EXIT_OK, HelpFormatter, fail, run_sync


def register(sub: Any) -> None:
    p = sub.add_parser(
        "keygen",
        help="generate fixed CurveZMQ keys for a channel served over TCP (publish --keys)",
        description=(
            "Generate CurveZMQ keys: the writer's pair (server_public, server_secret) and the pair every "
            "reader presents (client_public, client_secret), Z85-encoded, as the JSON of aiobroadcast.CurveKeys. "
            "With --out FILE they are written with mode 0600 (an existing FILE only with --force); otherwise "
            "printed. 'aiobroadcast publish --tcp tcp://HOST:PORT --keys FILE' (a fixed PORT) then serves with these "
            "keys at every start and is the same channel each time, so its handle (which carries the readers' pair) "
            "stays valid across restarts: readers attached to the old run end, and 'subscribe --follow' "
            "re-attaches. Without --keys the writer makes fresh keys each time and the handle file alone is "
            "enough for remote readers."
        ),
        formatter_class=HelpFormatter,
    )
    p.add_argument("--out", "-o", default=None, metavar="FILE", help="write the keys here (mode 0600)")
    p.add_argument("--force", action="store_true", help="replace FILE if it exists")
    p.add_argument("--public", action="store_true", help="print only the public keys")
    p.set_defaults(func=_run)


def public_part(keys: CurveKeys) -> dict[str, str]:
    return {"server_public": keys.server_public, "client_public": keys.client_public}


def _run(args: argparse.Namespace) -> int:
    return run_sync(lambda: _keygen(args))


def _keygen(args: argparse.Namespace) -> int:
    import zmq  # only this command needs it: the others start without loading ZeroMQ

    try:
        keys = CurveKeys.generate()
    except zmq.ZMQError as exc:  # pragma: no cover - a libzmq built without CURVE
        fail(f"this libzmq cannot make CurveZMQ keys ({exc}); install pyzmq's wheel")
    if args.out is None:
        print(json.dumps(public_part(keys) if args.public else keys.model_dump(), indent=2))
        return EXIT_OK
    if os.path.lexists(args.out) and not args.force:
        fail(f"{args.out} exists; pass --force to replace it (writers and readers using the old keys stop matching)")
    try:
        keys.save(args.out)
    except OSError as exc:
        fail(f"cannot write {args.out}: {exc.strerror or exc}")
    print(f"wrote CurveZMQ keys to {args.out} (mode 0600)", file=sys.stderr)
    if args.public:
        print(json.dumps(public_part(keys), indent=2))
    return EXIT_OK
