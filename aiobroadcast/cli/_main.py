"""``aiobroadcast`` command line. Errors a user can fix are one line on stderr, exit code 2."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from .._exceptions import BroadcastError

EXIT_OK, EXIT_ERROR, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="aiobroadcast",
        description="Broadcast Python objects from one async writer to many async readers.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    from . import _demo, _keygen, _pubsub, _relay, _stats

    _demo.register(sub)
    _relay.register(sub)
    _pubsub.register(sub)
    _stats.register(sub)
    _keygen.register(sub)
    try:
        bench = importlib.import_module(f"{__package__}._bench")
    except ImportError:  # pragma: no cover - while the benchmark module does not exist
        pass
    else:
        bench.register(sub)
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
