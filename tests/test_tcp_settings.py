"""The TCP server process's settings and report (``_tcp/settings.py``, ``_tcp/report.py``): a real
server process refuses a settings line it does not know, with a clear error on its stdout and a
non-zero exit; ``read_report`` takes only whole reports this version writes, from real files."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from aiobroadcast._base.handle import CurveKeys
from aiobroadcast._tcp import supervisor
from aiobroadcast._tcp.notices import Notices
from aiobroadcast._tcp.report import (
    RemoteReaderReport,
    ServerReport,
    read_report,
    report_path,
    report_tmp_path,
    write_report,
)
from aiobroadcast._tcp.settings import ServerSettings
from aiobroadcast._tcp.supervisor import read_answer
from aiobroadcast.blocking import open_writer


@pytest.fixture(scope="module")
def settings_line(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A valid settings line, as the writer sends it, for a real channel's handle."""
    directory = str(tmp_path_factory.mktemp("ring"))
    with open_writer(capacity=8, slot_bytes=256, max_readers=2, directory=directory) as writer:
        handle = writer.handle

    class Options:
        insecure = False
        tcp_window = 16
        heartbeat_s = 0.5
        max_readers = 2
        sole_reader = False
        rekey_messages = 1000
        rekey_bytes = 1 << 20
        data_port = 0
        allow_list = None

    settings = ServerSettings.for_writer(Options(), handle, "tcp://127.0.0.1:0", CurveKeys.generate(), None)
    line: dict[str, Any] = json.loads(settings.model_dump_json())
    return line


def _serve(line: bytes) -> tuple[dict[str, Any], int]:
    """Start a real server process, hand it ``line`` on its stdin; its answer and exit code. As
    the supervisor starts it: the package found as installed, nothing added to PYTHONPATH."""
    env = dict(os.environ)
    proc = subprocess.Popen(
        [sys.executable, "-P", "-m", "aiobroadcast._tcp.server"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
    )
    assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
    try:
        proc.stdin.write(line + b"\n")
        proc.stdin.flush()
        answer = read_answer(proc, 30.0)
        proc.stdin.close()
        code = proc.wait(30)
        assert proc.stderr.read() == b""  # refused cleanly: no traceback
        return answer, code
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
        proc.stderr.close()


def test_derived_settings_are_computed_from_the_writer_options(settings_line: dict[str, Any]) -> None:
    assert settings_line["buffer_max"] == 2 * max(16, 8)
    assert settings_line["hb_timeout"] == 6 * 0.5
    assert settings_line["report_path"].endswith("-tcp.json")
    assert ServerSettings.model_validate(settings_line).stop_s == 12 * 0.5


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"windw": 5}, "windw"),  # a field this version does not know (a typo, another version)
        ({"window": "many"}, "window"),  # a wrong type
        ({"report_path": None}, "report_path"),
    ],
)
def test_the_server_refuses_settings_it_does_not_know(
    settings_line: dict[str, Any], change: dict[str, Any], field: str
) -> None:
    answer, code = _serve(json.dumps({**settings_line, **change}).encode())
    assert code == 2
    assert answer["error"].startswith("bad settings on stdin: ")
    assert field in answer["error"]
    assert "Traceback" not in answer["error"]


def test_the_server_refuses_a_settings_line_without_a_field_or_not_json(settings_line: dict[str, Any]) -> None:
    line = {k: v for k, v in settings_line.items() if k != "endpoint"}
    answer, code = _serve(json.dumps(line).encode())
    assert code == 2 and "endpoint" in answer["error"], answer
    answer, code = _serve(b"endpoint=tcp://127.0.0.1:0")
    assert code == 2 and answer["error"].startswith("bad settings on stdin: "), answer


def _report() -> ServerReport:
    reader = RemoteReaderReport(name="r1", pid=123, host="box", received=40, lag=2)
    return ServerReport(pid=os.getpid(), end=42, dropped=1, rejected_frames=3, readers=(reader,))


def test_read_report_reads_what_write_report_wrote(tmp_path: Path) -> None:
    path = report_path(str(tmp_path / "aiobroadcast-x"))
    assert path == str(tmp_path / "aiobroadcast-x-tcp.json")
    write_report(path, _report())
    assert read_report(path) == _report()
    assert not os.path.exists(report_tmp_path(path))


@pytest.mark.parametrize(
    "content",
    [
        b"",
        b"[]",
        b'{"pid": 1, "end": 2, "readers": [{"name": "r1", "pid": 1',  # cut short
        b'{"version": 9, "pid": 1, "clients": []}',  # another version's report
        b'{"pid": 1, "end": 2, "readers": [{"name": "r1", "pid": "many", "received": 0, "lag": 0}]}',
        b"\xff\xfe not text",
    ],
)
def test_read_report_returns_none_for_a_file_that_is_not_a_whole_report(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "aiobroadcast-x-tcp.json"
    path.write_bytes(content)
    assert read_report(str(path)) is None
    # A whole report is read once it replaces the file.
    whole = _report().model_dump_json().encode()
    path.write_bytes(whole[: len(whole) // 2])
    assert read_report(str(path)) is None
    write_report(str(path), _report())
    assert read_report(str(path)) == _report()


def test_read_report_returns_none_for_a_missing_file(tmp_path: Path) -> None:
    assert read_report(str(tmp_path / "gone-tcp.json")) is None


def test_the_server_process_starts_from_the_installed_package(
    settings_line: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``python -P -m aiobroadcast._tcp.server`` from the writer's interpreter finds the package
    as installed (a wheel, or an editable install's finder): nothing puts a path of the source
    tree, built from ``__file__``, on its PYTHONPATH (a wheel has no source tree to point at)."""
    started: list[tuple[list[str], dict[str, Any]]] = []

    class Popen:
        stdin = None

        def __init__(self, cmd: list[str], **kw: Any) -> None:
            started.append((cmd, kw))

    monkeypatch.setattr(subprocess, "Popen", Popen)
    with pytest.raises(AssertionError):  # no stdin to hand the settings to: the start ends there
        supervisor.spawn_server(ServerSettings.model_validate(settings_line))
    ((cmd, kw),) = started
    assert cmd == [sys.executable, "-P", "-m", "aiobroadcast._tcp.server"]
    assert kw.get("env") is None  # the writer's own environment, PYTHONPATH as it is
    assert "__file__" not in Path(supervisor.__file__).read_text()


def test_an_unchanged_report_is_renewed_in_place_and_a_changed_or_missing_one_written_whole(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """An idle server's heartbeat renews its report's time (the writer's process reads that as
    a live server with a current report) instead of writing the same file again."""
    from test_tcp_protocol import Net, admit, publish, server

    srv, net = server(), Net()
    admit(srv, net, b"a")
    path = report_path(str(tmp_path / "aiobroadcast-x"))
    notices = Notices(srv, path)
    notices.write()
    written = os.stat(path)
    os.utime(path, (1.0, 1.0))
    notices.write()
    renewed = os.stat(path)
    assert renewed.st_ino == written.st_ino and renewed.st_mtime > 1.0  # the same file, its time now
    publish(srv, 0)
    notices.write()
    report = read_report(path)
    assert report is not None and report.end == 1 and os.stat(path).st_ino != written.st_ino
    os.unlink(path)  # removed by someone else: written whole, without a complaint
    notices.write()
    report = read_report(path)
    assert report is not None and report.end == 1 and [r.name for r in report.readers] == ["r"]
    assert not caplog.records
