"""``aiobroadcast keygen``: fixed CurveZMQ keys for a channel served over TCP.

Without keys, every ``open_writer(tcp=...)`` makes fresh ones and puts the readers' share in the
handle (saved with mode 0600), so handing out the handle file is handing out the keys. A key
file gives the same keys across writer restarts: ``aiobroadcast publish --keys FILE`` (or
``open_writer(keys=CurveKeys.load(FILE))``); with a fixed port the restarted writer is the same
channel, and accepts the handles of its earlier runs. The file is ``CurveKeys`` as JSON, mode 0600.

Per-reader credentials (docs/security.md, "Revoking a reader"): ``keygen --reader NAME
--allow-list FILE --handle HANDLE --out READER.json`` draws a key pair for one reader, adds its
public key to the writer's allow list (``publish --allow-list FILE``, ``open_writer(allow_list=)``)
and writes that reader's handle: the writer's, with the reader's own pair in place of the shared
one. ``keygen --revoke NAME --allow-list FILE`` takes it off the list; a running writer reads
the list again at its next heartbeats (or at once on SIGHUP to its TCP server process), drops
the reader, refuses it from then on and changes the group key past every key it held.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from .._base.errors import InvalidArgument
from .._base.handle import AllowList, CurveKeys
from ._common import EXIT_OK, HelpFormatter, fail, load_handle, run_sync


# argparse, spelled out per command as in the other cli modules: a table or wrapper of
# add_parser/add_argument calls would only hide argparse's own API.
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
            "enough for remote readers. Per-reader credentials, which can be revoked one by one: "
            "'keygen --reader NAME --allow-list LIST --handle HANDLE --out READER.json' gives reader NAME a key pair "
            "of its own (in READER.json, its handle) and allows it in LIST, which the writer serves with "
            "('publish --allow-list LIST'); 'keygen --revoke NAME --allow-list LIST' removes it for good."
        ),
        formatter_class=HelpFormatter,
    )
    p.add_argument(
        "--out",
        "-o",
        default=None,
        metavar="FILE",
        help="write the keys (with --reader: the reader's handle) here (mode 0600)",
    )
    p.add_argument("--force", action="store_true", help="replace FILE if it exists")
    p.add_argument("--public", action="store_true", help="print only the public keys")
    p.add_argument(
        "--reader",
        default=None,
        metavar="NAME",
        help="issue credentials of one remote reader: a CurveZMQ key pair of its own, its public key added as NAME "
        "to --allow-list FILE (made if missing), and its handle (--handle, with its own pair instead of the "
        "shared one) written to --out",
    )
    p.add_argument(
        "--revoke",
        default=None,
        metavar="NAME",
        help="take reader NAME (or a public key) off --allow-list FILE: a writer serving with that list drops it "
        "within a few heartbeats (at once on SIGHUP to its TCP server), refuses it from then on, and changes the "
        "group key so that nothing sealed later opens with the keys it held",
    )
    p.add_argument(
        "--allow-list",
        default=None,
        metavar="FILE",
        help="the writer's allow list of reader keys (publish --allow-list FILE), for --reader and --revoke",
    )
    p.add_argument(
        "--handle",
        default=None,
        metavar="FILE",
        help="with --reader: the writer's handle file (a writer with fixed --keys and a fixed port keeps it valid)",
    )
    p.set_defaults(func=_run)


def public_part(keys: CurveKeys) -> dict[str, str]:
    return {"server_public": keys.server_public, "client_public": keys.client_public}


def _run(args: argparse.Namespace) -> int:
    return run_sync(lambda: _keygen(args))


def _revoke(args: argparse.Namespace) -> int:
    if args.allow_list is None:
        fail("--revoke NAME needs --allow-list FILE (the writer's list)")
    try:
        allowed = AllowList.load(args.allow_list).without(args.revoke)
        allowed.save(args.allow_list)
    except InvalidArgument as exc:
        fail(str(exc))
    except OSError as exc:
        fail(f"cannot write {args.allow_list}: {exc.strerror or exc}")
    print(
        f"revoked {args.revoke!r} in {args.allow_list}: a writer serving with it drops that reader within a few "
        "heartbeats (at once on SIGHUP to its TCP server process)",
        file=sys.stderr,
    )
    return EXIT_OK


def _issue(args: argparse.Namespace) -> int:
    import zmq

    if args.allow_list is None or args.handle is None or args.out is None:
        fail("--reader NAME needs --allow-list FILE, --handle FILE (the writer's) and --out FILE (the reader's handle)")
    if os.path.lexists(args.out) and not args.force:
        fail(f"{args.out} exists; pass --force to replace it")
    handle = load_handle(args.handle)
    if handle.tcp is None or handle.insecure or handle.server_key is None:
        fail(f"{args.handle} is not the handle of a writer serving TCP with CurveZMQ: readers of it need no keys")
    try:
        allowed = AllowList.load(args.allow_list) if os.path.lexists(args.allow_list) else AllowList()
        public, secret = (k.decode() for k in zmq.curve_keypair())
        allowed = allowed.with_reader(args.reader, public)
        mine = handle.model_copy(update={"client_public_key": public, "client_secret_key": secret})
        mine.save(args.out)
        allowed.save(args.allow_list)
    except InvalidArgument as exc:
        fail(str(exc))
    except OSError as exc:
        fail(f"cannot write {exc.filename}: {exc.strerror or exc}")
    print(f"wrote the handle of reader {args.reader!r} to {args.out} (mode 0600) and allowed it in {args.allow_list}")
    return EXIT_OK


def _keygen(args: argparse.Namespace) -> int:
    import zmq  # only this command needs it: the others start without loading ZeroMQ

    if args.reader is not None and args.revoke is not None:
        fail("--reader and --revoke are two commands: give one")
    if args.revoke is not None:
        return _revoke(args)
    if args.reader is not None:
        return _issue(args)
    if args.allow_list is not None or args.handle is not None:
        fail("--allow-list and --handle go with --reader NAME or --revoke NAME")

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
