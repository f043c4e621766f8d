"""keep_freed_memory: freed large buffers are reused instead of being unmapped and faulted in again."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

_CHILD = r"""
import ctypes, json, resource
from ppojax.host_memory import keep_freed_memory
applied = keep_freed_memory()
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
size = 64 * 2**20  # a buffer as XLA:CPU allocates one: plain malloc, written, freed
faults = []
for _ in range(6):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    buffer = libc.malloc(size)
    ctypes.memset(buffer, 1, size)
    libc.free(buffer)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps({"applied": applied, "faults": faults}))
"""


def _child(**env):
    proc = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True, cwd=REPO, timeout=120,
                          env={**os.environ, **env})
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc mallopt")
def test_freed_buffers_are_reused_without_page_faults():
    on = _child(PPOJAX_KEEP_FREED_MEMORY="1")
    off = _child(PPOJAX_KEEP_FREED_MEMORY="0")
    assert on["applied"] is True and off["applied"] is False
    pages = 64 * 2**20 // 4096
    # Without it every 64 MB buffer is faulted in again; with it only the first one is.
    assert min(off["faults"][1:]) > pages // 4, off
    assert max(on["faults"][1:]) < pages // 20, on
