"""A channel's shared-memory segment: creation, attachment, sweeping stale files, and the
liveness locks (open-file-description byte locks) that tell a live peer from a dead one.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import mmap
import os
import re
import stat
import struct
import time

from .._base import fork as _fork
from .._base import tuning as _tuning
from .._base.errors import BroadcastError, InsufficientSharedMemory, InvalidHandle, os_error
from .._base.files import unlink_quietly
from .atomic import Words
from .layout import (
    EMPTY,
    HOST_BYTES,
    LAYOUT_VERSION,
    MAGIC,
    NAME_BYTES,
    R_ACTIVE,
    R_CURSOR,
    R_GENERATION,
    R_HOST_OFFSET,
    R_NAME_LEN,
    R_NAME_OFFSET,
    R_PID,
    RECORD_BYTES,
    RECORD_WORDS,
    W_CAPACITY,
    W_CODEC,
    W_MAGIC,
    W_MAX_READERS,
    W_POLICY,
    W_SLOT_BYTES,
    W_TOKEN,
    W_VERSION,
    W_WRITER_HOST,
    W_WRITER_PID,
    W_WRITER_PIDNS,
    WAITING_OFFSET,
    Layout,
    check_platform,
    host_name,
    name_key,
    pack_host,
    pid_namespace,
    unpack_host,
)

NAME_RE = re.compile(r"^aiobroadcast-[0-9a-f]{32}$")

# --- liveness locks (open-file-description byte locks) ---------------------------------------
_FLOCK = struct.Struct("hhqqi4x")


def _lock_arg(kind: int, start: int, length: int = 1) -> bytes:
    return _FLOCK.pack(kind, os.SEEK_SET, start, length, 0)


def try_lock(fd: int, start: int, length: int = 1) -> bool:
    """Take an exclusive lock on ``length`` bytes at ``start`` (0: to the end) without waiting."""
    try:
        fcntl.fcntl(fd, fcntl.F_OFD_SETLK, _lock_arg(fcntl.F_WRLCK, start, length))
    except OSError as exc:
        if exc.errno in (errno.EAGAIN, errno.EACCES):
            return False
        raise
    return True


def unlock(fd: int, start: int, length: int = 1) -> None:
    fcntl.fcntl(fd, fcntl.F_OFD_SETLK, _lock_arg(fcntl.F_UNLCK, start, length))


def is_locked(fd: int, start: int) -> bool:
    """Whether another open file description holds a lock on byte ``start``."""
    res = fcntl.fcntl(fd, fcntl.F_OFD_GETLK, _lock_arg(fcntl.F_WRLCK, start))
    return bool(_FLOCK.unpack(res)[0] != fcntl.F_UNLCK)


WRITER_LOCK_BYTE = 0


def reader_lock_byte(index: int) -> int:
    return 1 + index


#: Reader names are claimed with locks too (docs/design.md, "Reader names"): a reader holds the
#: byte ``name_lock_byte(name)`` of this range, far beyond the file's end (a lock needs no byte
#: to exist), for as long as it is attached under that name.
NAME_LOCK_BASE = 1 << 62
_NAME_HASH_MASK = (1 << 61) - 1


def name_lock_byte(name: str) -> int:
    """The lock byte whose holder holds the reader name ``name`` on this channel: 61 bits of a
    BLAKE2b digest of ``name_key(name)`` above ``NAME_LOCK_BASE``."""
    digest = hashlib.blake2b(name_key(name), digest_size=8, person=b"abcast-name").digest()
    return NAME_LOCK_BASE + (int.from_bytes(digest, "little") & _NAME_HASH_MASK)


# --- the segment -----------------------------------------------------------------------------
def record_name(buf: memoryview, layout: Layout, index: int) -> str:
    """Reader ``index``'s name, from any mapping of the segment (read-only too)."""
    off = layout.records_offset + RECORD_BYTES * index
    n = int.from_bytes(buf[off + 8 * R_NAME_LEN : off + 8 * R_NAME_LEN + 8], "little")
    return bytes(buf[off + R_NAME_OFFSET : off + R_NAME_OFFSET + min(n, NAME_BYTES)]).decode("utf-8", "replace")


def record_host(buf: memoryview, layout: Layout, index: int) -> str:
    """Where reader ``index`` lives ("" if its process did not say)."""
    off = layout.records_offset + RECORD_BYTES * index + R_HOST_OFFSET
    return unpack_host(bytes(buf[off : off + HOST_BYTES]))


def writer_host(buf: memoryview) -> str:
    return unpack_host(bytes(buf[8 * W_WRITER_HOST : 8 * W_WRITER_HOST + HOST_BYTES]))


class Segment:
    """One mapping of a channel's file. The creator owns the file; attachers only map it.

    Two open file descriptions of the file: ``fd`` carries this process's liveness lock and
    nothing else; the mapping is made from another one, which never carries a lock. A mapping
    keeps the description it was made from alive for as long as it exists (CPython's ``mmap``
    keeps a duplicate descriptor of it, too), and a view of the ring a user still holds (a
    zero-copy message) keeps the mapping: were the lock on that description, it would outlive
    ``close``, and in a fork child it would outlive the parent. Closing ``fd`` releases the lock
    whatever else is alive (docs/design.md, "Fork").
    """

    def __init__(self, path: str, fd: int, layout: Layout) -> None:
        self.path = path
        self.fd = fd
        self.layout = layout
        self._mmap = _map(path, fd, layout.size)
        self.buf = memoryview(self._mmap)
        # The words processes share, read with load-acquire and written with store-release
        # (atomic.py; docs/design.md, "Memory ordering").
        self.words = Words(self.buf)
        r0, n = layout.records_offset // 8, layout.max_readers
        self.rec_active = Words(self.buf, r0 + R_ACTIVE, RECORD_WORDS, n)
        self.rec_cursor = Words(self.buf, r0 + R_CURSOR, RECORD_WORDS, n)
        self.waiting = Words(self.buf, WAITING_OFFSET // 8, 1, n)
        self._views: list[Words | memoryview] = [self.rec_active, self.rec_cursor, self.waiting, self.words, self.buf]
        _fork.track(self)

    @property
    def token(self) -> str:
        return _token_of(self.words)

    def sock_path(self, who: str) -> str:
        return f"{self.path}-{who}.sock"

    def read_name(self, index: int) -> str:
        return record_name(self.buf, self.layout, index)

    def read_host(self, index: int) -> str:
        return record_host(self.buf, self.layout, index)

    def write_name(self, index: int, name: str) -> None:
        raw = name_key(name)
        off = self.layout.records_offset + RECORD_BYTES * index + R_NAME_OFFSET
        self.buf[off : off + len(raw)] = raw
        self.words[self.layout.record_word(index, R_NAME_LEN)] = len(raw)

    def write_host(self, index: int, host: str) -> None:
        off = self.layout.records_offset + RECORD_BYTES * index + R_HOST_OFFSET
        self.buf[off : off + HOST_BYTES] = pack_host(host)

    def close(self) -> None:
        _fork.untrack(self)
        self._unmap()
        os.close(self.fd)

    def _forget_in_child(self) -> None:
        """A fork child's copy: drop the lock's descriptor and unmap, writing nothing. Views
        handed out before the fork release their own mapping when they are freed."""
        with contextlib.suppress(OSError):  # a descriptor the child closed already
            os.close(self.fd)
        self._unmap()

    def _unmap(self) -> None:
        for v in self._views:
            try:
                v.release()
            except BufferError:  # exported right now (in a fork child: by a call another thread was in)
                pass
        try:
            self._mmap.close()
        except BufferError:
            pass  # a view of the ring is still referenced (a kept message or traceback): unmapped when freed


def _map(path: str, fd: int, size: int) -> mmap.mmap:
    """Map the file of ``fd`` through a description of its own, opened here (see ``Segment``)."""
    try:
        map_fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
    except FileNotFoundError as exc:
        raise InvalidHandle(f"the channel's segment {path} is gone (the writer closed or exited)") from exc
    try:
        a, b = os.fstat(fd), os.fstat(map_fd)
        if (a.st_dev, a.st_ino) != (b.st_dev, b.st_ino):
            raise InvalidHandle(f"the channel's segment {path} was replaced while it was being opened")
        return mmap.mmap(map_fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(map_fd)


def create_segment(
    directory: str, token: str, capacity: int, slot_bytes: int, max_readers: int, policy: int, codec: int
) -> Segment:
    """Create, size and initialise a channel's file, and take the writer's lock on it."""
    check_platform()
    layout = Layout(capacity, slot_bytes, max_readers)
    path = os.path.join(directory, f"aiobroadcast-{token}")
    try:
        st = os.statvfs(directory)
    except OSError as exc:
        raise os_error(BroadcastError, f"cannot use {directory!r} for shared memory", exc) from exc
    available = st.f_bavail * st.f_frsize
    if layout.size > available:
        raise InsufficientSharedMemory(layout.size, available, directory)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except OSError as exc:
        raise os_error(BroadcastError, f"cannot create the channel's segment in {directory!r}", exc) from exc
    try:
        if not try_lock(fd, WRITER_LOCK_BYTE):  # pragma: no cover - the file is new
            raise BroadcastError(f"cannot lock new segment {path}")
        try:
            os.posix_fallocate(fd, 0, layout.size)
            seg = Segment(path, fd, layout)
        except OSError as exc:
            if exc.errno == errno.ENOSPC:
                raise InsufficientSharedMemory(layout.size, available, directory) from exc
            raise os_error(BroadcastError, f"cannot size or map the channel's segment {path}", exc) from exc
    except BaseException:
        os.close(fd)
        os.unlink(path)
        raise
    w = seg.words
    w[W_VERSION] = LAYOUT_VERSION
    w[W_CAPACITY] = capacity
    w[W_SLOT_BYTES] = slot_bytes
    w[W_MAX_READERS] = max_readers
    w[W_POLICY] = policy
    w[W_CODEC] = codec
    w[W_WRITER_PID] = os.getpid()
    w[W_WRITER_PIDNS] = pid_namespace()
    seg.buf[8 * W_WRITER_HOST : 8 * W_WRITER_HOST + HOST_BYTES] = pack_host(host_name())
    raw = bytes.fromhex(token)
    w[W_TOKEN] = int.from_bytes(raw[:8], "little")
    w[W_TOKEN + 1] = int.from_bytes(raw[8:], "little")
    for k in range(capacity):
        w[layout.slot_offset(k) // 8] = EMPTY
    w[W_MAGIC] = MAGIC
    return seg


def attach_segment(path: str, token: str, capacity: int, slot_bytes: int, max_readers: int) -> Segment:
    """Map an existing channel's file, checking that it is the channel the handle names."""
    check_platform()
    layout = Layout(capacity, slot_bytes, max_readers)
    fd = _open_channel_file(path, layout, os.O_RDWR)
    try:
        try:
            seg = Segment(path, fd, layout)
        except OSError as exc:
            raise os_error(InvalidHandle, f"cannot map the channel's segment {path}", exc) from exc
    except BaseException:
        os.close(fd)
        raise
    problems = _header_problems(seg.words, token, layout)
    if problems:
        seg.close()
        raise InvalidHandle(f"segment {path} does not match the handle ({', '.join(problems)})")
    return seg


class SegmentView:
    """A read-only mapping of a channel's file, for looking without taking part (``aiobroadcast
    stats``): no lock is taken, nothing is stored, and read permission is enough."""

    def __init__(self, path: str, token: str, capacity: int, slot_bytes: int, max_readers: int) -> None:
        self.layout = layout = Layout(capacity, slot_bytes, max_readers)
        self.fd = _open_channel_file(path, layout, os.O_RDONLY)
        try:
            self._mmap = mmap.mmap(self.fd, layout.size, mmap.MAP_SHARED, mmap.PROT_READ)
        except OSError as exc:
            os.close(self.fd)
            raise os_error(InvalidHandle, f"cannot map the channel's segment {path}", exc) from exc
        self.buf = memoryview(self._mmap)
        self.words = Words(self.buf)
        problems = _header_problems(self.words, token, layout)
        if problems:
            self.close()
            raise InvalidHandle(f"segment {path} does not belong to this handle ({', '.join(problems)})")

    def close(self) -> None:
        self.words.release()
        self.buf.release()
        self._mmap.close()
        os.close(self.fd)


def _token_of(w: Words) -> str:
    return (w[W_TOKEN].to_bytes(8, "little") + w[W_TOKEN + 1].to_bytes(8, "little")).hex()


def _open_channel_file(path: str, layout: Layout, mode: int) -> int:
    """Open a channel's file (never through a symbolic link: the handle names a file in the
    channel's directory) and check it is a regular file of ``layout``'s size."""
    try:
        fd = os.open(path, mode | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError as exc:
        raise InvalidHandle(f"the channel's segment {path} is gone (the writer closed or exited)") from exc
    except OSError as exc:
        raise os_error(InvalidHandle, f"cannot open the channel's segment {path}", exc) from exc
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise InvalidHandle(f"{path} is not a channel's segment (not a regular file)")
        if st.st_size != layout.size:
            raise InvalidHandle(
                f"segment {path} is {st.st_size} bytes, the handle's layout needs {layout.size}: "
                "it belongs to another layout or another version"
            )
    except BaseException:
        os.close(fd)
        raise
    return fd


def _header_problems(w: Words, token: str, layout: Layout) -> list[str]:
    """How the segment's header disagrees with the handle (nothing: it is the handle's channel)."""
    problems = []
    if w[W_MAGIC] != MAGIC or w[W_VERSION] != LAYOUT_VERSION:
        problems.append("magic/version")
    for word, want, what in (
        (W_CAPACITY, layout.capacity, "capacity"),
        (W_SLOT_BYTES, layout.slot_bytes, "slot_bytes"),
        (W_MAX_READERS, layout.max_readers, "max_readers"),
    ):
        if w[word] != want:
            problems.append(f"{what} {w[word]} != {want}")
    if not problems and _token_of(w) != token:
        problems.append("token")
    return problems


def sweep_stale(directory: str) -> list[str]:
    """Remove channel files (and their sockets) left by writers that died with no reader left.

    A file is stale when nobody holds any lock on it: the writer's and every reader's lock
    died with their processes. Only regular files of this user are looked at, never through a
    symbolic link (``/dev/shm`` is writable by everyone).
    """
    removed: list[str] = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    for name in names:
        if not NAME_RE.match(name):
            _sweep_orphan(directory, name)
            continue
        path = os.path.join(directory, name)
        try:
            st = os.lstat(path)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
                continue
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            continue
        try:
            st = os.fstat(fd)
            young = time.time() - st.st_mtime < _tuning.STALE_MIN_AGE_S
            if stat.S_ISREG(st.st_mode) and not young and try_lock(fd, 0, 0) and not _kept_for_a_reader(fd):
                for extra in os.listdir(directory):
                    m = _ORPHAN_RE.match(extra)
                    if m is not None and m.group(1) == name:
                        unlink_quietly(os.path.join(directory, extra))
                unlink_quietly(path)
                removed.append(path)
        finally:
            os.close(fd)
    return removed


def take_over_dead(directory: str, token: str) -> None:
    """Before a writer with a fixed channel id (``open_writer(channel=...)``, or fixed keys and
    endpoint) creates its segment: remove what an earlier run of the channel left at that path
    if its writer is dead (the segment, its sockets, report and arena). Readers still attached
    to it keep their mapping, and see the writer gone. ``BroadcastError`` if a live writer holds
    it (two writers of one channel cannot be open at once), or the path is not this user's
    regular file (``/dev/shm`` is writable by everyone: a file there is never trusted)."""
    name = f"aiobroadcast-{token}"
    path = os.path.join(directory, name)
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return
    except OSError as exc:
        raise os_error(BroadcastError, f"cannot create the channel's segment: {path} is in the way", exc) from exc
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            raise BroadcastError(
                f"cannot create the channel's segment: {path} is in the way (not a regular file of this user)"
            )
        if is_locked(fd, WRITER_LOCK_BYTE):
            head = os.pread(fd, 8 * (W_WRITER_PID + 1), 0)
            pid = int.from_bytes(head[8 * W_WRITER_PID : 8 * W_WRITER_PID + 8], "little")
            raise BroadcastError(
                f"this channel is open already: its writer (pid {pid}) holds {path}; close that writer "
                "first, or give this one another channel name"
            )
        for extra in os.listdir(directory):
            m = _ORPHAN_RE.match(extra)
            if m is not None and m.group(1) == name:
                unlink_quietly(os.path.join(directory, extra))
        unlink_quietly(path)
    finally:
        os.close(fd)


def _kept_for_a_reader(fd: int) -> bool:
    """Whether a reader place of the segment is reserved for a live process that has not taken it
    yet: active, never occupied (generation 0), its pid alive. A fan-in sender reserves its
    collector's place so, and leaves the segment to the collector when it closes (docs/fan-in.md):
    with no lock held, it would look stale until the collector attaches. (A place a reader ever
    joined has generation 1 or more.)"""
    try:
        head = os.pread(fd, 8 * (W_MAX_READERS + 1), 0)
        max_readers = int.from_bytes(head[8 * W_MAX_READERS : 8 * W_MAX_READERS + 8], "little")
        if not 0 < max_readers <= 1 << 16:
            return False
        records = Layout(1, 64, max_readers).records_offset  # depends on max_readers only
        for i in range(max_readers):
            rec = os.pread(fd, 8 * (R_GENERATION + 1), records + RECORD_BYTES * i)
            if len(rec) < 8 * (R_GENERATION + 1):
                return False
            active, pid, generation = (
                int.from_bytes(rec[8 * k : 8 * k + 8], "little") for k in (R_ACTIVE, R_PID, R_GENERATION)
            )
            if active and not generation and pid and _alive(pid):
                return True
    except OSError:
        return False
    return False


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


#: Every other file a channel has beside its segment: wake-up sockets (``-w.sock``, ``-r3.sock``),
#: the TCP server's report (``-tcp.json``) and the temporary file it is written to first
#: (``-tcp.json.tmp``, left behind if the server is killed while writing it), the arena (``-arena.shm``).
_ORPHAN_RE = re.compile(r"^(aiobroadcast-[0-9a-f]{32})-[\w.-]+\.(sock|json|json\.tmp|shm)$")


def _sweep_orphan(directory: str, name: str) -> None:
    """A socket or stats file whose channel file is gone (its owner was killed) is left over."""
    m = _ORPHAN_RE.match(name)
    if m is None or os.path.exists(os.path.join(directory, m.group(1))):
        return
    path = os.path.join(directory, name)
    try:
        st = os.lstat(path)
        if st.st_uid == os.geteuid() and time.time() - st.st_mtime > _tuning.STALE_MIN_AGE_S:
            unlink_quietly(path)
    except FileNotFoundError:
        pass
