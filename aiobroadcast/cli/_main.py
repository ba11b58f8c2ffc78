"""``aiobroadcast`` command line: the parser of every command, and what a failure exits with.
Errors a user can fix are one line on stderr, exit code 2 (``_common.EXIT_USAGE``)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from .. import __version__
from .._base.errors import BroadcastError
from . import _bench, _demo, _keygen, _pubsub, _relay, _stats
from ._common import EXIT_INTERRUPTED, EXIT_USAGE


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="aiobroadcast",
        description="Broadcast Python objects from one async writer to many async readers.",
    )
    parser.add_argument(
        "--version", action="version", version=f"aiobroadcast {__version__}", help="print the version and exit"
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _demo.register(sub)
    _relay.register(sub)
    _pubsub.register(sub)
    _stats.register(sub)
    _keygen.register(sub)
    _bench.register(sub)
    return parser


def run(argv: Sequence[str]) -> int:
    parser = build_parser()
    args = parser.parse_args(list(argv))
    try:
        code: int = args.func(args)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BroadcastError as exc:
        print(f"aiobroadcast: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    return code
