"""Every access to a word that processes share goes through here (docs/design.md, "Memory
ordering"): the compiled helper ``_atomics`` (``_atomics.c``), which uses the compiler's
``__atomic`` builtins, so the orderings hold on every architecture the ring runs on (x86-64 and
aarch64), not only where the hardware happens to give them.

- ``Words(buffer, start=0, step=1, count=-1)``: 8-byte words of the mapping. ``w[i]`` is one
  8-byte load-acquire, ``w[i] = v`` one 8-byte store-release (single-copy atomic: the words are
  aligned); ``w.tolist()`` and ``w.any()`` load every item with acquire. ``release()`` gives the
  mapping back (later accesses raise ``ValueError``).
- ``fence()``: a full barrier (x86-64 ``mfence``, aarch64 ``dmb ish``): the stores before it are
  visible to every other process before any load after it is performed.
- ``fence_acquire()`` and ``fence_release()``: the seqlock's two halves (policy "lag"): loads
  before ``fence_acquire()`` are performed before anything after it, stores after
  ``fence_release()`` are seen only after everything before it. Nothing on x86-64.

Bulk bytes (message bodies, the slot header after its seq word, names) are copied with plain
accesses: the seq word's release and acquire order them (docs/design.md).
"""

from __future__ import annotations

from ._atomics import Words, fence, fence_acquire, fence_release

__all__ = ["Words", "fence", "fence_acquire", "fence_release"]
