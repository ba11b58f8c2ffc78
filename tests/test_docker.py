"""docker/: what can be checked without a Docker engine (this machine has none).

1. compose.yaml follows the rules of the compose specification that the topology relies on
   (checked here rule by rule; ``docker-compose config`` also validates it when installed).
2. The topology is the one the README promises: a writer, two readers sharing its IPC namespace
   and /dev/shm, one remote reader in its own IPC namespace reading over TCP on the compose network
   with CurveZMQ, the handle shared through a volume.
3. Every command the services run (and the healthcheck) exists in the CLI with exactly those
   flags, and the Dockerfile installs that CLI as the entry point.
4. The same commands run as processes in the same topology: the writer and the remote reader in
   network namespaces of their own joined by a veth pair (as root), the remote reader with a
   private /dev/shm and resolving "writer" as compose's DNS would, the local readers with no
   network at all; on loopback when namespaces cannot be made.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import queue
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from aiobroadcast._cli import build_parser
from aiobroadcast._ring import Layout

ROOT = Path(__file__).resolve().parent.parent
DOCKER = ROOT / "docker"
COMPOSE = DOCKER / "compose.yaml"
DOCKERFILE = DOCKER / "Dockerfile"
CLI = [sys.executable, "-m", "aiobroadcast"]
HOST = socket.gethostname().encode()[:16].decode("utf-8", "ignore")  # this host's name, as the ring keeps it

# --- the compose specification's rules we rely on (compose-spec, schema/compose-spec.json) ------
TOP_LEVEL_KEYS = {"version", "name", "include", "services", "models", "networks", "volumes", "secrets", "configs"}
SERVICE_KEYS = {
    "develop", "deploy", "annotations", "attach", "build", "blkio_config", "cap_add", "cap_drop", "cgroup",
    "cgroup_parent", "command", "configs", "container_name", "cpu_count", "cpu_percent", "cpu_shares",
    "cpu_quota", "cpu_period", "cpu_rt_period", "cpu_rt_runtime", "cpus", "cpuset", "credential_spec",
    "depends_on", "device_cgroup_rules", "devices", "dns", "dns_opt", "dns_search", "domainname", "entrypoint",
    "env_file", "label_file", "environment", "expose", "extends", "provider", "external_links", "extra_hosts",
    "gpus", "group_add", "healthcheck", "hostname", "image", "init", "ipc", "isolation", "labels", "links",
    "logging", "mac_address", "mem_limit", "mem_reservation", "mem_swappiness", "memswap_limit", "network_mode",
    "models", "networks", "oom_kill_disable", "oom_score_adj", "pid", "pids_limit", "platform", "ports",
    "post_start", "pre_stop", "privileged", "profiles", "pull_policy", "pull_refresh_after", "read_only",
    "restart", "runtime", "scale", "security_opt", "shm_size", "secrets", "sysctls", "stdin_open",
    "stop_grace_period", "stop_signal", "storage_opt", "tmpfs", "tty", "ulimits", "use_api_socket", "user",
    "uts", "userns_mode", "volumes", "volumes_from", "working_dir",
}  # fmt: skip
BUILD_KEYS = {"context", "dockerfile", "args", "labels", "target", "platforms", "tags", "network", "shm_size"}
HEALTHCHECK_KEYS = {"disable", "interval", "retries", "test", "timeout", "start_period", "start_interval"}
NAME = re.compile(r"^[a-zA-Z0-9._-]+$")
DURATION = re.compile(r"^(\d+(\.\d+)?(ns|us|ms|s|m|h))+$")
BYTES = re.compile(r"^(\d+)([bkmg]?)b?$", re.IGNORECASE)
DEPENDS_CONDITIONS = {"service_started", "service_healthy", "service_completed_successfully"}
IPC_MODES = re.compile(r"^(|none|private|shareable|host|service:[a-zA-Z0-9._-]+|container:.+)$")
VOLUME_MODES = {"ro", "rw", "z", "Z", "nocopy"}


class _StrictLoader(yaml.SafeLoader):
    """YAML as compose reads it: merge keys allowed, duplicate keys refused (PyYAML would keep
    the last one silently; compose rejects them)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[str] = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge" or not isinstance(key_node, yaml.ScalarNode):
                continue
            key = str(key_node.value)
            if key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r}", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def load_compose() -> dict[str, Any]:
    data = yaml.load(COMPOSE.read_text(), Loader=_StrictLoader)  # a SafeLoader
    assert isinstance(data, dict)
    return data


def byte_value(value: int | str) -> int:
    if isinstance(value, int):
        return value
    m = BYTES.match(value)
    assert m, f"not a byte value: {value!r}"
    unit = {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}[m.group(2).lower()]
    return int(m.group(1)) * unit


def services() -> dict[str, dict[str, Any]]:
    svc = load_compose()["services"]
    assert isinstance(svc, dict)
    return svc


def cli_args(svc: dict[str, Any]) -> list[str]:
    command = svc["command"]
    assert isinstance(command, list) and all(isinstance(a, str) for a in command), "use the exec (list) form"
    return command


def parse(args: list[str]) -> argparse.Namespace:
    try:
        return build_parser().parse_args(args)
    except SystemExit as exc:
        raise AssertionError(f"the CLI rejects {args}") from exc


def option(args: list[str], name: str) -> str | None:
    return args[args.index(name) + 1] if name in args else None


# --- 1. the spec's rules ------------------------------------------------------------------------
def test_compose_file_follows_the_specification_rules_it_relies_on() -> None:
    doc = load_compose()
    assert set(doc) - TOP_LEVEL_KEYS <= {k for k in doc if k.startswith("x-")}, set(doc)
    networks = doc.get("networks") or {}
    volumes = doc.get("volumes") or {}
    for name in [*networks, *volumes]:
        assert NAME.match(name)
    svcs = services()
    assert svcs
    for name, svc in svcs.items():
        where = f"service {name}"
        assert NAME.match(name), where
        assert set(svc) <= SERVICE_KEYS, f"{where}: {set(svc) - SERVICE_KEYS}"
        assert isinstance(svc["image"], str)
        if "build" in svc:
            build = svc["build"]
            assert isinstance(build, dict) and set(build) <= BUILD_KEYS, where
            context = (COMPOSE.parent / build["context"]).resolve()
            assert context.is_dir(), where
            assert (context / build["dockerfile"]).resolve() == DOCKERFILE, where
        cli_args(svc)
        assert isinstance(svc.get("init", False), bool)
        assert re.fullmatch(r"linux/(amd64|arm64)", svc.get("platform", "linux/amd64"))
        ipc = svc.get("ipc", "")
        assert isinstance(ipc, str) and IPC_MODES.match(ipc), f"{where}: ipc {ipc!r}"
        if ipc.startswith("service:"):
            owner = ipc.removeprefix("service:")
            assert svcs[owner].get("ipc") == "shareable", f"{where}: {owner} must be ipc: shareable"
            assert owner in svc.get("depends_on", {}), f"{where}: start after {owner}"
            assert "shm_size" not in svc, f"{where}: /dev/shm is {owner}'s; its shm_size applies"
        if "shm_size" in svc:
            assert byte_value(svc["shm_size"]) > 0
        assert not ("network_mode" in svc and "networks" in svc), f"{where}: network_mode excludes networks"
        mode = svc.get("network_mode")
        assert mode is None or mode in ("none", "host", "bridge") or mode.startswith(("service:", "container:"))
        for net in svc.get("networks", []):
            assert net in networks, f"{where}: network {net} is not declared"
        for port in svc.get("expose", []):
            assert re.fullmatch(r"\d+(-\d+)?(/(tcp|udp))?", str(port)), where
        for vol in svc.get("volumes", []):
            assert isinstance(vol, str), where
            source, target, *mode_ = vol.split(":")
            assert target.startswith("/"), where
            if not source.startswith((".", "/", "~")):
                assert source in volumes, f"{where}: volume {source} is not declared"
            assert all(m in VOLUME_MODES for part in mode_ for m in part.split(",")), where
        for dep, spec in (svc.get("depends_on") or {}).items():
            assert dep in svcs and dep != name, where
            assert spec["condition"] in DEPENDS_CONDITIONS, where
            if spec["condition"] == "service_healthy":
                assert "healthcheck" in svcs[dep], f"{where}: {dep} has no healthcheck to wait for"
        if "healthcheck" in svc:
            hc = svc["healthcheck"]
            assert set(hc) <= HEALTHCHECK_KEYS
            assert isinstance(hc["test"], list) and hc["test"][0] in ("CMD", "CMD-SHELL", "NONE")
            for key in ("interval", "timeout", "start_period", "start_interval"):
                assert key not in hc or DURATION.match(hc[key]), f"{where}: {key}"
            assert isinstance(hc.get("retries", 3), int)
    # No dependency cycle (depends_on and ipc: service:X both order the start).
    order: list[str] = []

    def visit(name: str, path: tuple[str, ...]) -> None:
        assert name not in path, f"dependency cycle {(*path, name)}"
        svc = svcs[name]
        deps = set(svc.get("depends_on") or {})
        if str(svc.get("ipc", "")).startswith("service:"):
            deps.add(svc["ipc"].removeprefix("service:"))
        for dep in sorted(deps):
            visit(dep, (*path, name))
        if name not in order:
            order.append(name)

    for name in svcs:
        visit(name, ())


def test_compose_file_is_accepted_by_docker_compose() -> None:
    """A second, independent parser and validator, where one is installed (Debian's
    docker-compose 1.29 validates against the compose specification's JSON schema)."""
    tool = shutil.which("docker-compose")
    if tool is None:
        pytest.skip("docker-compose is not installed (apt-get install docker-compose adds this check)")
    res = subprocess.run([tool, "-f", str(COMPOSE), "config", "-q"], capture_output=True, text=True, check=False)
    assert res.returncode == 0, res.stderr


# --- 2. the topology ----------------------------------------------------------------------------
@dataclass
class Topology:
    writer: str
    local: list[str]
    remote: str
    handle_dir: str
    handle_file: str
    volume: str


def topology() -> Topology:
    svcs = services()
    writers = [n for n, s in svcs.items() if cli_args(s)[0] == "publish"]
    readers = [n for n, s in svcs.items() if cli_args(s)[0] == "subscribe"]
    assert len(writers) == 1 and len(readers) == 3
    writer = writers[0]
    local = [n for n in readers if svcs[n].get("ipc") == f"service:{writer}"]
    remote = [n for n in readers if n not in local]
    assert len(local) == 2 and len(remote) == 1
    volume, handle_dir = svcs[writer]["volumes"][0].split(":")[:2]
    handle_file = cli_args(svcs[writer])[1]
    return Topology(writer, local, remote[0], handle_dir, handle_file, volume)


def test_compose_topology_is_the_promised_one() -> None:
    svcs = services()
    t = topology()
    w = svcs[t.writer]
    w_args = parse(cli_args(w))
    # The writer owns the IPC namespace the local readers join, with a /dev/shm big enough for the ring.
    assert w.get("ipc") == "shareable"
    ring = Layout(w_args.capacity, (w_args.slot_bytes + 63) // 64 * 64, w_args.max_readers + 1).size
    assert byte_value(w["shm_size"]) >= 4 * ring
    # It serves TCP on every interface of its container, and readers are told its service name.
    m = re.fullmatch(r"tcp://0\.0\.0\.0:(\d+)", w_args.tcp)
    assert m, w_args.tcp
    assert m.group(1) in [str(p) for p in w.get("expose", [])]
    assert w_args.advertise == t.writer
    assert not w_args.insecure  # CurveZMQ: the readers' keys travel in the handle file
    # The handle goes to the shared volume; every service mounts it at the same place.
    assert os.path.dirname(t.handle_file) == t.handle_dir
    assert f"{t.volume}:{t.handle_dir}" in w["volumes"]
    hc = w["healthcheck"]["test"]
    assert hc[:2] == ["CMD", "aiobroadcast"] and hc[-1] == t.handle_file
    for name in [*t.local, t.remote]:
        svc = svcs[name]
        args = parse(cli_args(svc))
        assert args.handle_file == t.handle_file
        assert f"{t.volume}:{t.handle_dir}:ro" in svc["volumes"]
        assert svc["depends_on"][t.writer]["condition"] == "service_healthy"
        assert args.name == name and args.wait > 0
    for name in t.local:
        svc = svcs[name]
        assert parse(cli_args(svc)).transport in ("shm", "auto")
        assert svc.get("network_mode") == "none"  # shared memory only: no network at all
    remote = svcs[t.remote]
    assert parse(cli_args(remote)).transport == "tcp"
    assert remote.get("ipc", "private") == "private"  # its own IPC namespace and /dev/shm
    assert "network_mode" not in remote
    assert set(remote["networks"]) & set(w["networks"]), "the remote reader must reach the writer's network"
    # One image, built once (docker-compose 1.29 builds it once per service that has `build`): the
    # writer builds it, and the readers, which start after the writer, run it.
    assert [n for n, s in svcs.items() if "build" in s] == [t.writer]
    assert len({s["image"] for s in svcs.values()}) == 1


# --- 3. the CLI and the image -------------------------------------------------------------------
def _subparsers() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    raise AssertionError("no subcommands")


def test_every_command_the_services_run_exists_in_the_cli() -> None:
    commands = []
    for svc in services().values():
        commands.append(cli_args(svc))
        if "healthcheck" in svc:
            test = svc["healthcheck"]["test"]
            assert test[0] == "CMD" and test[1] == "aiobroadcast"
            commands.append(test[2:])
    subs = _subparsers()
    for args in commands:
        parse(args)
        options = subs[args[0]]._option_string_actions
        for token in args[1:]:
            if token.startswith("-"):
                assert token.split("=")[0] in options, f"{args[0]} has no option {token} (exactly)"


def _dockerfile() -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def _ignored(path: str, patterns: list[str]) -> bool:
    """.dockerignore semantics for plain patterns: the last matching pattern wins."""
    ignored = False
    for p in patterns:
        negate = p.startswith("!")
        pat = p.removeprefix("!").rstrip("/")
        if fnmatch.fnmatch(path, pat) or path.startswith(pat + "/"):
            ignored = not negate
    return ignored


def test_dockerfile_installs_the_cli_as_the_entry_point() -> None:
    steps = _dockerfile()
    known = {"FROM", "ENV", "WORKDIR", "COPY", "RUN", "USER", "ENTRYPOINT", "CMD", "LABEL", "ARG", "EXPOSE"}
    assert {w for w, _ in steps} <= known
    assert steps[0][0] == "FROM"
    m = re.fullmatch(r"python:3\.(\d+)(-slim)?", steps[0][1])
    assert m and int(m.group(1)) >= 11  # requires-python >= 3.11
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert pyproject["project"]["scripts"]["aiobroadcast"] == "aiobroadcast.__main__:main"
    # The build context is the repository root: compose builders read its .dockerignore (docker-compose
    # 1.29 reads no Dockerfile.dockerignore), which must let through what the Dockerfile copies, and
    # nothing else that a checkout holds (the real run measures the context).
    ignore = [
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert not (DOCKER / "Dockerfile.dockerignore").exists()  # BuildKit would prefer it to .dockerignore
    copied = set()
    for word, rest in steps:
        if word == "COPY":
            *sources, _dest = rest.split()
            for src in sources:
                assert (ROOT / src).exists(), src
                assert not _ignored(src, ignore), f"{src} is excluded by .dockerignore"
                copied.add(src)
    assert {"pyproject.toml", "README.md", "aiobroadcast"} <= copied  # what `pip install` needs
    assert not _ignored("aiobroadcast/_cli.py", ignore)
    for path in (".venv/bin/python", ".git/HEAD", "tests/test_docker.py", "aiobroadcast/__pycache__/_cli.pyc"):
        assert _ignored(path, ignore), path
    runs = " ".join(rest for word, rest in steps if word == "RUN")
    assert "pip install --no-deps /src" in runs
    users = [rest for word, rest in steps if word == "USER"]
    assert users and users[-1] not in ("root", "0")
    handle_dir = topology().handle_dir
    assert f"mkdir -p {handle_dir}" in runs and f"chown {users[-1]}:{users[-1]} {handle_dir}" in runs
    entry = [rest for word, rest in steps if word == "ENTRYPOINT"]
    assert entry and json.loads(entry[-1]) == ["aiobroadcast"]  # exec form: signals reach the CLI


# --- 4. the same topology as processes ----------------------------------------------------------
class Service:
    def __init__(self, name: str, argv: list[str]) -> None:
        self.name = name
        self.popen = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        self.out: list[str] = []
        self.err: list[str] = []
        self._ticks: queue.Queue[str] = queue.Queue()
        assert self.popen.stdout is not None and self.popen.stderr is not None
        threading.Thread(target=self._pump, args=(self.popen.stdout, self.out), daemon=True).start()
        threading.Thread(target=self._pump, args=(self.popen.stderr, self.err), daemon=True).start()

    def _pump(self, stream: Any, into: list[str]) -> None:
        into.extend(line.rstrip("\n") for line in iter(stream.readline, ""))

    def wait_lines(self, n: int, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while len(self.out) < n:
            assert self.popen.poll() is None, f"{self.name} exited: {self.err}"
            assert time.monotonic() < deadline, f"{self.name}: {len(self.out)} lines; {self.err}"
            time.sleep(0.05)

    def finish(self, timeout: float = 30.0) -> int:
        code = self.popen.wait(timeout)
        time.sleep(0.05)
        return code

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.kill()
            self.popen.wait()
        for f in (self.popen.stdout, self.popen.stderr):
            if f is not None:
                f.close()


@dataclass
class Namespaces:
    """The writer's and the remote reader's network namespaces, joined by a veth pair."""

    suffix: str = field(default_factory=lambda: secrets.token_hex(3))
    created: list[str] = field(default_factory=list)
    etc_dirs: list[Path] = field(default_factory=list)
    made_etc_netns: bool = False

    @property
    def writer(self) -> str:
        return f"abcw-{self.suffix}"

    @property
    def reader(self) -> str:
        return f"abcr-{self.suffix}"

    def create(self, writer_host: str) -> None:
        for ns in (self.writer, self.reader):
            _ip("netns", "add", ns)
            self.created.append(ns)
            _ip("-n", ns, "link", "set", "lo", "up")
        # Both ends are made inside our namespaces: the host's own network is never touched.
        _ip("-n", self.writer, "link", "add", "eth0", "type", "veth", "peer", "name", "eth0", "netns", self.reader)
        for ns, addr in ((self.writer, "10.232.7.1/24"), (self.reader, "10.232.7.2/24")):
            _ip("-n", ns, "addr", "add", addr, "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
        # `ip netns exec` mounts /etc/netns/NS/hosts over /etc/hosts: "writer" resolves as in compose.
        etc = Path("/etc/netns")
        self.made_etc_netns = not etc.exists()
        d = etc / self.reader
        d.mkdir(parents=True)
        self.etc_dirs.append(d)
        (d / "hosts").write_text(f"127.0.0.1 localhost\n10.232.7.1 {writer_host}\n")

    def destroy(self) -> None:
        for ns in self.created:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)
        for d in self.etc_dirs:
            shutil.rmtree(d, ignore_errors=True)
        if self.made_etc_netns:
            try:
                Path("/etc/netns").rmdir()
            except OSError:
                pass


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


def _namespaces_possible() -> str | None:
    """None if we can make network namespaces here, else why not."""
    if os.environ.get("AIOBROADCAST_TEST_LOOPBACK"):
        return "AIOBROADCAST_TEST_LOOPBACK is set"
    if os.geteuid() != 0:
        return "not root"
    if shutil.which("ip") is None or shutil.which("unshare") is None:
        return "iproute2 or util-linux missing"
    probe = f"abcp-{secrets.token_hex(3)}"
    res = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True, check=False)
    if res.returncode != 0:
        return f"ip netns add failed: {res.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True, check=False)
    return None


@pytest.fixture
def namespaces() -> Iterator[Namespaces | None]:
    why_not = _namespaces_possible()
    if why_not is not None:
        yield None  # loopback instead
        return
    ns = Namespaces()
    try:
        yield ns
    finally:
        ns.destroy()


def test_compose_topology_runs_as_processes(tmp_path: Path, namespaces: Namespaces | None) -> None:
    svcs = services()
    t = topology()
    volume = str(tmp_path)

    def command(args: list[str]) -> list[str]:
        # The volume is a directory here; in loopback mode the writer binds and advertises 127.0.0.1.
        args = [a.replace(t.handle_dir, volume) for a in args]
        if namespaces is None:
            args = [re.sub(r"^tcp://0\.0\.0\.0:\d+$", "tcp://127.0.0.1:0", a) for a in args]
            args = ["127.0.0.1" if a == t.writer and args[i - 1] == "--advertise" else a for i, a in enumerate(args)]
        return [*CLI, *args]

    def in_writer_ns(argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", namespaces.writer, *argv] if namespaces else argv

    if namespaces is not None:
        namespaces.create(t.writer)
    started: list[Service] = []
    try:
        writer = Service(t.writer, in_writer_ns(command(cli_args(svcs[t.writer]))))
        started.append(writer)
        # depends_on: service_healthy: the healthcheck, run where docker runs it (in the writer's namespaces).
        health = in_writer_ns(command(svcs[t.writer]["healthcheck"]["test"][2:]))
        deadline = time.monotonic() + 30
        while subprocess.run(health, capture_output=True, check=False).returncode != 0:
            assert writer.popen.poll() is None, writer.err
            assert time.monotonic() < deadline, "the writer never became healthy"
            time.sleep(0.2)
        for name in t.local:  # network_mode: none; ipc: service:writer (this host's /dev/shm)
            argv = command(cli_args(svcs[name]))
            started.append(Service(name, ["unshare", "--net", *argv] if namespaces else argv))
        remote_argv = command(cli_args(svcs[t.remote]))
        if namespaces is not None:  # its own network namespace, and a /dev/shm of its own
            remote_argv = [
                *["ip", "netns", "exec", namespaces.reader, "unshare", "--mount", "sh", "-c"],
                'mount -t tmpfs tmpfs /dev/shm && exec "$@"',
                "sh",
                *remote_argv,
            ]
        started.append(Service(t.remote, remote_argv))
        readers = started[1:]
        for r in readers:
            r.wait_lines(8)
        # Every reader receives every tick from the one it joined at, in order; the same ticks.
        ticks = {r.name: [json.loads(line) for line in r.out] for r in readers}
        for name, got in ticks.items():
            seqs = [tick["seq"] for tick in got]
            assert seqs == list(range(seqs[0], seqs[0] + len(seqs))), (name, seqs)
        by_seq = [{tick["seq"]: tick for tick in got} for got in ticks.values()]
        common = set.intersection(*(set(b) for b in by_seq))
        assert len(common) >= 5 and all(b[s] == by_seq[0][s] for b in by_seq for s in common)
        for name in t.local:
            r = next(r for r in readers if r.name == name)
            assert any("local, over shared memory" in line for line in r.err), r.err
        remote = readers[-1]
        host = t.writer if namespaces else "127.0.0.1"
        assert any(f"remote, over TCP tcp://{host}:" in line for line in remote.err), remote.err
        # The healthcheck's view: both local readers by name, the remote one from the TCP server.
        res = subprocess.run(health, capture_output=True, text=True, check=False)
        assert res.returncode == 0, res.stderr
        for r in readers[:-1]:
            assert re.search(rf"^\s+\d+\s+{r.name}\s+\d+\s+{HOST}\s+yes\s", res.stdout, re.M), res.stdout
        assert re.search(rf"^\s+tcp\s+{t.remote}\s", res.stdout, re.M), res.stdout
        # `docker compose down`, the writer's part: SIGTERM closes the channel; every reader ends.
        writer.popen.send_signal(signal.SIGTERM)
        assert writer.finish() == 0, writer.err
        for r in readers:
            assert r.finish() == 0, (r.name, r.err)
            assert re.search(r"received \d+ messages$", r.err[-1]), r.err
        assert not os.path.exists(os.path.join(volume, os.path.basename(t.handle_file)))
    finally:
        for s in started:
            s.stop()
