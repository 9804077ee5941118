"""``keep_freed_memory`` against glibc's own accounting (``mallinfo2``): a 16 MiB block comes from the heap and stays there.

With glibc's default policy a fresh 16 MiB block is mapped on its own (above
the 128 KiB mmap threshold) and unmapped when freed, so the next one faults
its pages again; with the policy it is carved from the heap, and freeing it
leaves the heap's pages mapped for the next step. The performance this buys
is measured in docs/benchmarks.md (issue 25: particle-mesh D3 on 2 ranks).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

# In a fresh process, mallinfo2 around malloc + write + free of 16 MiB: bytes mapped on their own (hblkhd) while held,
# bytes in use in the heap (uordblks) while held, the heap's shrink (arena) at the free, and mapped bytes left after it.
_PROBE = """
import ctypes, ctypes.util, sys
from halopipe.allocator import keep_freed_memory

class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]

applied = keep_freed_memory() if sys.argv[1] == "on" else False
libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.mallinfo2.restype = MallInfo2
libc.malloc.restype = ctypes.c_void_p
start = libc.mallinfo2()
block = libc.malloc(16 << 20)
ctypes.memset(block, 1, 16 << 20)
held = libc.mallinfo2()
libc.free(ctypes.c_void_p(block))
freed = libc.mallinfo2()
print(applied, held.hblkhd - start.hblkhd, held.uordblks - start.uordblks, held.arena - freed.arena, freed.hblkhd - start.hblkhd)
"""

MIB = 1 << 20


def _probe(mode: str, env: dict | None = None) -> tuple[bool, int, int, int, int]:
    done = subprocess.run([sys.executable, "-c", _PROBE, mode], capture_output=True, text=True, timeout=60, env=env, check=True)
    applied, *sizes = done.stdout.split()
    return (applied == "True", *(int(s) for s in sizes))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mallopt and mallinfo2 are glibc's")
def test_a_freed_block_stays_in_the_heap() -> None:
    applied, mapped, in_heap, shrink, mapped_after_free = _probe("on")
    assert applied
    assert mapped == 0 and in_heap >= 16 * MIB, (mapped, in_heap)  # carved from the heap, not mapped on its own
    assert shrink == 0, shrink  # and the heap kept its pages after the free
    _, mapped, in_heap, _, mapped_after_free = _probe("off")
    assert mapped >= 16 * MIB and in_heap < MIB and mapped_after_free <= 0, (mapped, in_heap, mapped_after_free)  # glibc's default


def test_the_environment_turns_it_off() -> None:
    applied, mapped, *_ = _probe("on", dict(os.environ, HALOPIPE_KEEP_FREED_MEMORY="0"))
    assert not applied and mapped >= 16 * MIB
