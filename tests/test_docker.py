"""docker/: the compose file run for real on a Docker engine, and what can be checked without one.

1. compose.yaml follows the rules of the compose specification that the topology relies on
   (checked here rule by rule, for engines and compose versions other than the one the real run
   uses; ``docker-compose config`` also validates it when installed).
2. The topology is the one the README promises: a writer, two readers sharing its ring through a
   tmpfs volume (which outlives the writer's restarts), one remote reader in its own IPC namespace
   reading over TCP on the compose network with CurveZMQ and keys that stay the same across the
   writer's restarts, the handle shared through a volume; every reader follows the writer's
   restarts; one image, built once.
3. Every command the services run (and the healthcheck) exists in the CLI with exactly those
   flags, and the Dockerfile installs that CLI as the entry point from a small build context.
4. The real run: docker-compose builds the image and starts the services on a Docker engine, and
   the test checks from outside what the README promises (namespaces, transports, the same ticks
   everywhere, a killed reader dropped, the readers re-attaching after ``docker compose restart
   writer``, ``stop`` and ``down -v`` ending and removing everything).
   The engine comes from ../shared/tools/docker-engine.sh (beside the repository, as root); where
   none can be had the test is skipped with the reason, or fails where AIOBROADCAST_REQUIRE_DOCKER
   is set (CI sets it: there the run must happen).
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import re
import secrets
import shutil
import socket
import subprocess
import threading
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import pytest
import yaml

from aiobroadcast._shm.layout import Layout
from aiobroadcast.cli import build_parser

ROOT = Path(__file__).resolve().parent.parent
DOCKER = ROOT / "docker"
COMPOSE = DOCKER / "compose.yaml"
DOCKERFILE = DOCKER / "Dockerfile"

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


def ring_mount(writer: dict[str, Any]) -> str:
    """The writer's volume mount (``source:target``) of its ring's directory (``--directory``)."""
    directory = parse(cli_args(writer)).directory
    mounts = [v for v in writer.get("volumes", []) if v.split(":")[1] == directory]
    assert len(mounts) == 1, f"the writer's --directory {directory} must be a volume the local readers mount"
    return str(mounts[0])


def topology() -> Topology:
    svcs = services()
    writers = [n for n, s in svcs.items() if cli_args(s)[0] == "publish"]
    readers = [n for n, s in svcs.items() if cli_args(s)[0] == "subscribe"]
    assert len(writers) == 1 and len(readers) == 3
    writer = writers[0]
    ring = ring_mount(svcs[writer])
    local = [n for n in readers if ring in svcs[n].get("volumes", [])]
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
    # The ring is in a volume of its own, in memory (tmpfs), big enough for it, which the writer
    # and the local readers mount at the same place: unlike the writer's IPC namespace and
    # /dev/shm, it outlives the writer's restarts (a restarted container gets new ones).
    ring_volume = ring_mount(w).split(":")[0]
    opts = (yaml.load(COMPOSE.read_text(), Loader=_StrictLoader)["volumes"][ring_volume] or {}).get("driver_opts", {})
    assert opts.get("type") == "tmpfs" and opts.get("device") == "tmpfs", opts
    size = re.search(r"(?:^|,)size=(\w+)", opts.get("o", ""))
    ring = Layout(w_args.capacity, (w_args.slot_bytes + 63) // 64 * 64, w_args.max_readers + 1).size
    assert size and byte_value(size.group(1)) >= 4 * ring, opts
    assert "uid=10001" in opts["o"], "the services' user (Dockerfile) must own the ring's directory"
    # It serves TCP on every interface of its container, and readers are told its service name.
    m = re.fullmatch(r"tcp://0\.0\.0\.0:(\d+)", w_args.tcp)
    assert m, w_args.tcp
    assert m.group(1) in [str(p) for p in w.get("expose", [])]
    assert w_args.advertise == t.writer
    assert not w_args.insecure  # CurveZMQ: the readers' keys travel in the handle file
    # Fixed keys (made at the first start) and a fixed port: a restarted writer is the same
    # channel. The key file (the server's secret) is in a volume that no reader mounts.
    assert w_args.keys and w_args.make_keys
    keys_volume = next(v.split(":")[0] for v in w["volumes"] if v.split(":")[1] == os.path.dirname(w_args.keys))
    assert keys_volume != t.volume
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
        assert args.follow  # a restarted writer: re-attach with the handle held
        assert not any(v.split(":")[0] == keys_volume for v in svc["volumes"]), name
    for name in t.local:
        svc = svcs[name]
        assert ring_mount(w) in svc["volumes"]
        assert parse(cli_args(svc)).transport in ("shm", "auto")
        assert svc.get("network_mode") == "none"  # shared memory only: no network at all
    remote = svcs[t.remote]
    assert parse(cli_args(remote)).transport == "tcp"
    assert remote.get("ipc", "private") == "private"  # its own IPC namespace and /dev/shm
    assert not any(v.split(":")[0] == ring_volume for v in remote["volumes"])  # nor the ring's volume
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
    """.dockerignore semantics for plain patterns: the last pattern that matches the path or one
    of its folders wins (``*`` here also matches ``/``, so ``**/x`` matches x at any depth)."""
    parts = path.split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    ignored = False
    for p in patterns:
        negate = p.startswith("!")
        pat = p.removeprefix("!").rstrip("/")
        if any(fnmatch.fnmatch(prefix, pat) for prefix in prefixes):
            ignored = not negate
    return ignored


def test_dockerfile_installs_the_cli_as_the_entry_point() -> None:
    steps = _dockerfile()
    known = {"FROM", "ENV", "WORKDIR", "COPY", "RUN", "USER", "ENTRYPOINT", "CMD", "LABEL", "ARG", "EXPOSE"}
    assert {w for w, _ in steps} <= known
    assert steps[0][0] == "FROM"
    for word, rest in steps:  # every stage (the first builds the wheel) on the same base
        if word == "FROM":
            m = re.fullmatch(r"python:3\.(\d+)(-slim)?( AS \w+)?", rest)
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
        if word == "COPY" and not rest.startswith("--from="):  # not from another stage
            *sources, _dest = rest.split()
            for src in sources:
                assert (ROOT / src).exists(), src
                assert not _ignored(src, ignore), f"{src} is excluded by .dockerignore"
                copied.add(src)
    assert {"pyproject.toml", "setup.py", "README.md", "aiobroadcast"} <= copied  # what `pip install` needs
    assert not _ignored("aiobroadcast/cli/_main.py", ignore)
    for path in (
        ".venv/bin/python",
        ".git/HEAD",
        "tests/test_docker.py",
        "aiobroadcast/__pycache__/_open.pyc",
        "aiobroadcast/cli/__pycache__/_main.pyc",
        "aiobroadcast/_shm/_atomics.cpython-311-x86_64-linux-gnu.so",  # an editable install's build
    ):
        assert _ignored(path, ignore), path
    runs = " ".join(rest for word, rest in steps if word == "RUN")
    # The project is built into a wheel in the first stage (with the compiler its extension needs),
    # and the image installs that wheel.
    assert "pip wheel --no-deps -w /wheels /src" in runs and "pip install --no-deps /wheels/*.whl" in runs
    assert ("COPY", "--from=build /wheels /wheels") in steps
    users = [rest for word, rest in steps if word == "USER"]
    assert users and users[-1] not in ("root", "0")
    handle_dir = topology().handle_dir
    assert f"mkdir -p {handle_dir}" in runs and f"chown {users[-1]}:{users[-1]} {handle_dir}" in runs
    entry = [rest for word, rest in steps if word == "ENTRYPOINT"]
    assert entry and json.loads(entry[-1]) == ["aiobroadcast"]  # exec form: signals reach the CLI


# --- 4. the real run, on a Docker engine ---------------------------------------------------------
ENGINE_SCRIPT = ROOT.parent / "shared" / "tools" / "docker-engine.sh"


def _max_context_bytes() -> int:
    """The most the build context may hold: what .dockerignore lets through (pyproject.toml,
    setup.py, README.md and the package, without ``__pycache__`` and compiled ``*.so``), about
    1 MB, and the tar headers around it (512 bytes a file, and padding), not more: a checkout's
    .venv alone is 250 MB, its tests 1.4 MB. Read from the working tree, as docker sends it."""
    files = [ROOT / "pyproject.toml", ROOT / "setup.py", ROOT / "README.md"]
    files += [
        f
        for f in (ROOT / "aiobroadcast").rglob("*")
        if f.is_file() and "__pycache__" not in f.parts and not f.name.endswith(".so")
    ]
    return sum(f.stat().st_size for f in files) + (256 << 10)


def _engine_env() -> dict[str, str]:
    """The environment for docker and docker-compose, once the engine script has made sure an
    engine runs. Where none can be had: skipped with the precise reason, or failed where
    AIOBROADCAST_REQUIRE_DOCKER is set (.ci/run sets it)."""
    why: str | None = None
    host = None
    if os.geteuid() != 0:
        why = f"a Docker engine needs root here ({ENGINE_SCRIPT.name} installs and starts one as root)"
    elif not ENGINE_SCRIPT.is_file():
        why = f"no {ENGINE_SCRIPT} beside the repository to start a Docker engine with"
    else:
        res = subprocess.run(["bash", str(ENGINE_SCRIPT)], capture_output=True, text=True, timeout=900, check=False)
        host = re.fullmatch(r"export DOCKER_HOST=(unix://\S+)", res.stdout.strip())
        if res.returncode != 0 or host is None:
            tail = " | ".join(res.stderr.strip().splitlines()[-5:])
            why = f"{ENGINE_SCRIPT} failed (exit {res.returncode}): {tail or res.stdout.strip()}"
        elif shutil.which("docker") is None or shutil.which("docker-compose") is None:
            why = f"{ENGINE_SCRIPT} succeeded but docker or docker-compose is not on PATH"
    if why is not None:
        if os.environ.get("AIOBROADCAST_REQUIRE_DOCKER"):
            pytest.fail(f"AIOBROADCAST_REQUIRE_DOCKER is set, but: {why}")
        pytest.skip(why)
    assert host is not None
    return {**os.environ, "DOCKER_HOST": host.group(1)}


class CountingRelay:
    """A Unix socket in front of the engine's that counts the bytes clients send through it. What
    ``docker-compose build`` sends is the build context, and a few kB of API requests."""

    def __init__(self, engine: str, path: Path) -> None:
        self.path = str(path)
        self.sent = 0
        self._engine = engine
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._sockets: list[socket.socket] = []
        self._threads: list[threading.Thread] = []
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(self.path)
        self._listener.listen(16)
        self._listener.settimeout(0.1)
        self._spawn(self._accept)

    def _spawn(self, target: Any, *args: Any) -> None:
        t = threading.Thread(target=target, args=args, daemon=True)
        self._threads.append(t)
        t.start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            client.settimeout(None)
            engine = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            engine.connect(self._engine)
            self._sockets += [client, engine]
            self._spawn(self._pump, client, engine, True)
            self._spawn(self._pump, engine, client, False)

    def _pump(self, src: socket.socket, dst: socket.socket, count: bool) -> None:
        try:
            while data := src.recv(1 << 16):
                dst.sendall(data)
                if count:
                    with self._lock:
                        self.sent += len(data)
            dst.shutdown(socket.SHUT_WR)
        except OSError:
            pass  # the other side went away: so does this connection

    def close(self) -> None:
        self._stop.set()
        for s in self._sockets:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for t in self._threads:
            t.join(10)
        for s in [self._listener, *self._sockets]:
            s.close()


@dataclass
class Deployment:
    """One compose project on the engine, under names of its own (concurrent runs never meet)."""

    env: dict[str, str]
    project: str = field(default_factory=lambda: f"aiobroadcast-test-{secrets.token_hex(4)}")
    image: str = field(default_factory=lambda: f"aiobroadcast:test-{secrets.token_hex(4)}")

    def run(
        self, argv: list[str], timeout: float, env: dict[str, str] | None = None
    ) -> subprocess.CompletedProcess[str]:
        full_env = {**self.env, "AIOBROADCAST_IMAGE": self.image, **(env or {})}
        return subprocess.run(argv, env=full_env, capture_output=True, text=True, timeout=timeout, check=False)

    def compose(self, *args: str, timeout: float = 120, env: dict[str, str] | None = None) -> str:
        res = self.run(["docker-compose", "-p", self.project, "-f", str(COMPOSE), *args], timeout, env)
        assert res.returncode == 0, f"docker-compose {' '.join(args)}: {res.stdout}{res.stderr}"
        return res.stdout + res.stderr

    def docker(self, *args: str, timeout: float = 60) -> str:
        res = self.run(["docker", *args], timeout)
        assert res.returncode == 0, f"docker {' '.join(args)}: {res.stdout}{res.stderr}"
        return res.stdout

    def left(self, kind: str) -> list[str]:
        """The project's containers, volumes or networks still on the engine."""
        label = f"label=com.docker.compose.project={self.project}"
        listing = {"container": ["ps", "-aq"], "volume": ["volume", "ls", "-q"], "network": ["network", "ls", "-q"]}
        return self.docker(*listing[kind], "--filter", label).split()

    def containers(self) -> dict[str, dict[str, Any]]:
        """``docker inspect`` of each service's container, by service name."""
        ids = self.left("container")
        if not ids:
            return {}
        info = json.loads(self.docker("inspect", *ids))
        return {c["Config"]["Labels"]["com.docker.compose.service"]: c for c in info}

    def logs(self, container: dict[str, Any]) -> tuple[list[str], list[str]]:
        """A container's stdout and stderr lines."""
        res = self.run(["docker", "logs", container["Id"]], 30)
        assert res.returncode == 0, res.stderr
        return res.stdout.splitlines(), res.stderr.splitlines()

    def stats(self, writer: dict[str, Any], handle_file: str) -> str:
        """``aiobroadcast stats --once`` where the healthcheck runs it: in the writer's container."""
        return self.docker("exec", writer["Id"], "aiobroadcast", "stats", "--once", "--interval", "0", handle_file)

    def clean_up(self) -> None:
        """Whatever a failed run left (the project's containers, volumes, networks), and the image
        with its intermediate layers: the engine keeps only the base image."""
        self.run(["docker-compose", "-p", self.project, "-f", str(COMPOSE), "down", "-v", "-t", "1"], 120)
        self.run(["docker", "rmi", self.image], 60)


def _until(what: str, check: Any, timeout: float) -> Any:
    """Poll ``check()`` until it returns something true; fail naming ``what`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    while not (result := check()):
        assert time.monotonic() < deadline, f"not within {timeout:.0f} s: {what}"
        time.sleep(0.5)
    return result


def _ticks(lines: list[str]) -> list[dict[str, Any]]:
    ticks = [json.loads(line) for line in lines]
    seqs = [t["seq"] for t in ticks]
    assert seqs and seqs == list(range(seqs[0], seqs[0] + len(seqs))), seqs  # in order, no gap
    return ticks


def _in_container_pid(container: dict[str, Any]) -> int:
    """The pid, in its container's pid namespace, of the command under the container's init."""
    children = psutil.Process(container["State"]["Pid"]).children()
    assert len(children) == 1, children
    status = Path(f"/proc/{children[0].pid}/status").read_text()
    return int(re.search(r"^NSpid:.*\s(\d+)$", status, re.M).group(1))  # type: ignore[union-attr]


@pytest.mark.timeout(900)
def test_compose_runs_on_a_docker_engine(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    env = _engine_env()
    t = topology()
    svcs = services()
    d = Deployment(env)
    t0 = time.monotonic()
    try:
        # Build, through a relay that measures the context docker-compose sends.
        relay = CountingRelay(env["DOCKER_HOST"].removeprefix("unix://"), tmp_path / "engine.sock")
        try:
            out = d.compose("build", timeout=600, env={"DOCKER_HOST": f"unix://{relay.path}"})
        finally:
            relay.close()
        built_in = time.monotonic() - t0
        assert re.findall(r"^Building ([\w.-]+)$", out, re.M) == [t.writer], out  # once
        for name in [*t.local, t.remote]:
            assert f"{name} uses an image, skipping" in out, out
        assert relay.sent < _max_context_bytes(), f"the build context is {relay.sent} bytes: see .dockerignore"

        # Up: the readers start once the writer's healthcheck passes.
        d.compose("up", "-d")
        c = d.containers()
        assert set(c) == set(svcs)
        assert c[t.writer]["State"]["Health"]["Status"] == "healthy"
        ipc = {name: os.readlink(f"/proc/{info['State']['Pid']}/ns/ipc") for name, info in c.items()}
        ring_dir = parse(cli_args(svcs[t.writer])).directory

        def ring_of(name: str) -> list[tuple[str, str]]:
            return [(m["Type"], m["Name"]) for m in c[name]["Mounts"] if m["Destination"] == ring_dir]

        assert ring_of(t.writer) and ring_of(t.writer)[0][0] == "volume"
        for name in t.local:  # the writer's ring volume, and no network: shared memory only
            assert ring_of(name) == ring_of(t.writer), name
            assert c[name]["HostConfig"]["NetworkMode"] == "none"
        assert ipc[t.remote] != ipc[t.writer] and not ring_of(t.remote)
        readers = [*t.local, t.remote]

        def got(n: int) -> dict[str, tuple[list[str], list[str]]] | None:
            logs = {name: d.logs(c[name]) for name in readers}
            return logs if all(len(out) >= n for out, _ in logs.values()) else None

        logs = _until("8 ticks for every reader", lambda: got(8), 60)
        for name in t.local:
            assert any(f"{name}: attached to" in e and "local, over shared memory" in e for e in logs[name][1])
        assert any(f"remote, over TCP tcp://{t.writer}:" in e for e in logs[t.remote][1]), logs[t.remote][1]
        # Every reader prints every tick from the one it joined at, in order; the same ticks.
        by_seq = [{tick["seq"]: tick for tick in _ticks(out)} for out, _ in logs.values()]
        common = set.intersection(*(set(b) for b in by_seq))
        assert len(common) >= 5 and all(b[s] == by_seq[0][s] for b in by_seq for s in common)

        # stats, where the healthcheck runs it: each reader by name, its pid in its own container,
        # and where it lives (the container's host name), beside the TCP server and the writer's.
        host = {name: info["Config"]["Hostname"] for name, info in c.items()}
        report = d.stats(c[t.writer], t.handle_file)
        assert f"writer pid {_in_container_pid(c[t.writer])} on {host[t.writer]} " in report.splitlines()[0], report
        for name in t.local:
            row = rf"^\s+\d+\s+{name}\s+{_in_container_pid(c[name])}\s+{host[name]}\s+yes\s"
            assert re.search(row, report, re.M), report
        row = rf"^\s+tcp\s+{t.remote}\s+{_in_container_pid(c[t.remote])}\s+{host[t.remote]}\s+yes\s"
        assert re.search(row, report, re.M), report

        # A SIGKILLed shared-memory reader: the writer drops it once it waits for it (a full ring),
        # saying who and where; the other readers carry on without a gap.
        victim, survivor = t.local[1], t.local[0]
        victim_pid = _in_container_pid(c[victim])
        d.docker("kill", "-s", "KILL", c[victim]["Id"])
        before = {name: len(d.logs(c[name])[0]) for name in (survivor, t.remote)}
        dropped = (
            rf"reader '{victim}' \(pid {victim_pid} on {host[victim]}, place \d+\) died at entry \d+ of \d+; dropped it"
        )
        _until("the writer drops the killed reader", lambda: re.search(dropped, "\n".join(d.logs(c[t.writer])[1])), 60)
        capacity = parse(cli_args(svcs[t.writer])).capacity
        _until(
            "the other readers carry on past a full ring",
            lambda: all(len(d.logs(c[n])[0]) > before[n] + capacity for n in before),
            60,
        )
        report = d.stats(c[t.writer], t.handle_file)
        assert victim not in report and re.search(rf"^\s+\d+\s+{survivor}\s", report, re.M), report
        # Started again, it joins again (a place is free), so that all four end below.
        d.docker("start", c[victim]["Id"])
        _until(
            "the restarted reader attaches again",
            lambda: sum("local, over shared memory" in e for e in d.logs(c[victim])[1]) == 2,
            60,
        )

        # `docker compose restart writer`: SIGTERM closes the channel (every reader drains), and
        # the writer starts again with the same keys and port, so it is the same channel: the
        # readers (--follow) re-attach with the handle they hold and print the new run's ticks.
        restarted_at = time.time()
        d.compose("restart", "writer")
        reattached = "writer restarted; re-attached"

        def new_run(name: str) -> bool:
            out, err = d.logs(c[name])
            return any(reattached in e for e in err) and any(json.loads(o)["time"] > restarted_at for o in out)

        _until("every reader re-attaches and reads the new run", lambda: all(map(new_run, readers)), 60)
        for name in readers:
            err = d.logs(c[name])[1]
            assert any("the writer closed the channel" in e for e in err), err
            assert any(re.search(rf"{name}: {reattached}, .*; messages missed: unknown$", e) for e in err), err
        assert any(f"remote, over TCP tcp://{t.writer}:" in e for e in d.logs(c[t.remote])[1] if reattached in e)

        # `docker compose stop` (SIGTERM to each, the readers first): every reader stops and exits
        # 0, the writer closes the channel and exits 0; `down -v` then removes everything.
        d.compose("stop")
        c = _until(
            "every container exits",
            lambda: (x := d.containers()) and not any(i["State"]["Running"] for i in x.values()) and x,
            60,
        )
        for name, info in c.items():
            assert info["State"]["ExitCode"] == 0, (name, d.logs(info))
        for name in readers:
            assert re.search(r"received \d+ messages?$", d.logs(c[name])[1][-1]), d.logs(c[name])
        d.compose("down", "-v")
        for kind in ("container", "volume", "network"):
            assert d.left(kind) == [], kind
        with capsys.disabled():
            print(
                f"\n  docker: build context {relay.sent / 1024:.0f} KiB; image built in {built_in:.0f} s; "
                f"whole run {time.monotonic() - t0:.0f} s"
            )
    finally:
        d.clean_up()
