"""A remote reader of its own process, at the protocol's level, that keeps everything it is
given: ``python _revoked_reader.py HANDLE_FILE`` (tests/test_tcp_revoke_wire.py).

It connects with the handle's credentials (its own CurveZMQ key pair), says HELLO, takes the
WELCOME and every KEYS, opens and acknowledges what comes on its data connection, and prints
one JSON line per event: ``{"keys": hex}`` for each keys message it is given, ``{"opened":
[seqs]}``, ``{"refused": reason}``. Once refused it goes on as a revoked reader that will not
let go would, with every key and credential it holds: it says HELLO again on its connection
(``{"hello_again": answer}``), connects anew with the same credentials (``{"reconnect":
"failed_auth" | "succeeded" | ...}``), and keeps its data connection open, printing any body it
is still sent and whether one opens (``{"late": seq, "opens": bool}``), until its stdin closes.
"""

from __future__ import annotations

import json
import os
import select
import sys
import time
from typing import Any

import zmq
import zmq.utils.monitor

from aiobroadcast._base.handle import Handle
from aiobroadcast._tcp import seal, wire


def say(**event: Any) -> None:
    print(json.dumps(event), flush=True)


def hello(handle: Handle) -> list[bytes]:
    body = {
        "version": wire.PROTOCOL_VERSION,
        "name": "revoked",
        "pid": os.getpid(),
        "host": "h",
        "window": 64,
        "resume": None,
        "channel": handle.token,
    }
    return [wire.HELLO, wire.encode_json(body)]


def curve(sock: zmq.Socket[Any], handle: Handle) -> None:
    assert handle.server_key and handle.client_public_key and handle.client_secret_key
    sock.curve_serverkey = handle.server_key.encode()
    sock.curve_publickey = handle.client_public_key.encode()
    sock.curve_secretkey = handle.client_secret_key.encode()


def reconnect(ctx: zmq.Context[Any], handle: Handle) -> str:
    """A new connection with the same credentials: how its handshake ends."""
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    curve(sock, handle)
    mon = sock.get_monitor_socket()
    assert handle.tcp is not None
    sock.connect(handle.tcp)
    sock.send_multipart(hello(handle))
    deadline = time.monotonic() + 10
    try:
        while time.monotonic() < deadline:
            if not mon.poll(200):
                continue
            event = zmq.utils.monitor.recv_monitor_message(mon)["event"]
            if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                return "failed_auth"
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                return "succeeded"
        return "no_answer"
    finally:
        sock.disable_monitor()
        mon.close(linger=0)
        sock.close(linger=0)


def main() -> None:
    handle = Handle.load(sys.argv[1])
    ctx: zmq.Context[Any] = zmq.Context()
    ctrl = ctx.socket(zmq.DEALER)
    data = ctx.socket(zmq.DEALER)
    for sock in (ctrl, data):
        sock.linger = 0
    ctrl.routing_id = data.routing_id = os.urandom(16)
    curve(ctrl, handle)
    assert handle.tcp is not None
    ctrl.connect(handle.tcp)
    ctrl.send_multipart(hello(handle))
    holders: list[seal.Opener] = []  # one per keys message: every key it was ever given
    opener = seal.Opener(handle.token.encode())
    mac: seal.WriterMac | None = None
    next_seq: int | None = None
    refused = False
    last_ack = 0.0
    poller = zmq.Poller()
    poller.register(ctrl, zmq.POLLIN)
    poller.register(data, zmq.POLLIN)
    poller.register(sys.stdin, zmq.POLLIN)

    def take_keys(message: bytes) -> None:
        opener.install(message)
        held = seal.Opener(handle.token.encode())
        held.install(message)
        holders.append(held)
        say(keys=message.hex())

    while True:
        ready = dict(poller.poll(200))
        if sys.stdin.fileno() in ready and select.select([sys.stdin], [], [], 0)[0] and not sys.stdin.read(1):
            return  # the test closed our stdin
        if ctrl in ready:
            frames = ctrl.recv_multipart()
            kind = frames[0]
            if kind == wire.WELCOME and mac is None:
                w = wire.decode_json(frames[1])
                take_keys(bytes.fromhex(w["keys"]))
                mac = seal.WriterMac(bytes.fromhex(w["mac_key"]))
                next_seq = w["start"]
                data.plain_username = wire.PLAIN_USER
                data.plain_password = w["data_token"].encode()
                data.connect(f"{handle.tcp.rsplit(':', 1)[0]}:{w['data_port']}")
            elif kind == wire.KEYS:
                take_keys(frames[1])
            elif kind == wire.REFUSED and not refused:
                refused = True
                say(refused=frames[1].decode())
                ctrl.send_multipart(hello(handle))  # on the connection it still has
                answer = ctrl.recv_multipart() if ctrl.poll(10_000) else [b"(nothing)"]
                say(hello_again=b" ".join(answer).decode(errors="replace"))
                say(reconnect=reconnect(ctx, handle))
        if data in ready:
            frames = data.recv_multipart()
            if frames[0] == wire.BATCH and mac is not None:
                frames = mac.check(frames)
                first, items = wire.decode_batch(frames[1], frames[2:])
                for k, (body, flags) in enumerate(items):
                    opens = any(_opens(h, first + k, flags, bytes(body)) for h in holders)
                    if refused:
                        say(late=first + k, opens=opens)
                if not refused:
                    opened = []
                    for k, (body, flags) in enumerate(items):
                        opener.open(first + k, flags, bytes(body))
                        opened.append(first + k)
                    say(opened=opened)
                    next_seq = first + len(items)
        if not refused and next_seq is not None and time.monotonic() - last_ack > 0.2:
            ctrl.send_multipart([wire.ACK, wire.U64.pack(next_seq)])
            last_ack = time.monotonic()


def _opens(opener: seal.Opener, seq: int, flags: int, body: bytes) -> bool:
    try:
        opener.open(seq, flags, body)
    except seal.SealError:
        return False
    return True


if __name__ == "__main__":
    main()
