"""reexec_with_huge_pages: the process runs again with glibc's huge-page tunable and mimalloc preloaded; a large
buffer as XLA:CPU allocates one (malloc, written, freed, every step) then faults in 2 MiB pages instead of 4 KiB
ones under glibc, and is not faulted in again at all under mimalloc."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ppojax.backends.cpu import host_memory

REPO = Path(__file__).resolve().parents[1]
PAGES = 64 * 2**20 // 4096  # 4 KiB pages of the 64 MiB buffer

_CHILD = r"""
import ctypes, json, os, resource
from ppojax.backends.cpu.host_memory import reexec_with_huge_pages
reexec_with_huge_pages()
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
size = 64 * 2**20
faults = []
for _ in range(4):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    buffer = libc.malloc(size)
    ctypes.memset(buffer, 1, size)
    libc.free(buffer)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps({"tunables": os.environ.get("GLIBC_TUNABLES"), "faults": faults}))
"""

usable = pytest.mark.skipif(not host_memory.transparent_huge_pages_usable(),
                            reason="needs glibc >= 2.35 and transparent huge pages 'always' or 'madvise'")


# The same rounds through the process's own malloc (mimalloc when it is preloaded), and what is mapped.
_ALLOCATOR_CHILD = _CHILD.replace('ctypes.CDLL("libc.so.6")', "ctypes.CDLL(None)").replace(
    '"faults": faults}', '"faults": faults, "preload": os.environ.get("LD_PRELOAD"), '
    '"purge_delay": os.environ.get("MIMALLOC_PURGE_DELAY"), "mapped": "libmimalloc" in open("/proc/self/maps").read()}')

_START_VARIABLES = (*host_memory.START_VARIABLES, host_memory.OFF_SWITCH, host_memory.MIMALLOC_OFF_SWITCH)


def _child(script=_CHILD, **env):
    environ = {k: v for k, v in os.environ.items() if k not in _START_VARIABLES}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO, timeout=120,
                          env={**environ, **env})
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@usable
def test_reexec_adds_the_tunable_and_keeps_the_users_own():
    assert _child()["tunables"] == host_memory.TUNABLE
    assert _child(GLIBC_TUNABLES="glibc.malloc.arena_max=2")["tunables"] == \
        f"glibc.malloc.arena_max=2:{host_memory.TUNABLE}"
    assert _child(GLIBC_TUNABLES="glibc.malloc.arena_max=2", PPOJAX_HUGE_PAGES="0")["tunables"] == \
        "glibc.malloc.arena_max=2"


@usable
def test_a_large_buffer_faults_in_huge_pages_and_is_still_returned():
    on = _child()
    off = _child(PPOJAX_HUGE_PAGES="0")
    assert off["tunables"] is None
    # every round maps the buffer afresh (freed memory goes back to the kernel): 4 KiB faults without the
    # tunable, 2 MiB ones with it
    assert min(off["faults"]) > PAGES // 2, off
    assert max(on["faults"]) < PAGES // 8, on


def test_usable_follows_the_kernels_transparent_huge_page_mode(tmp_path, monkeypatch):
    mode = tmp_path / "enabled"
    monkeypatch.setattr(host_memory, "_THP_MODE", str(mode))
    monkeypatch.setattr(host_memory, "_glibc_has_hugetlb_tunable", lambda: True)
    monkeypatch.setattr(host_memory.sys, "platform", "linux")
    for text, expected in (("always [madvise] never", True), ("[always] madvise never", True),
                           ("always madvise [never]", False)):
        mode.write_text(text + "\n")
        assert host_memory.transparent_huge_pages_usable() is expected, text
    mode.unlink()
    assert host_memory.transparent_huge_pages_usable() is False  # no such file: not Linux's THP
    monkeypatch.setattr(host_memory, "_glibc_has_hugetlb_tunable", lambda: False)
    mode.write_text("[always] madvise never\n")
    assert host_memory.transparent_huge_pages_usable() is False  # musl, or glibc before 2.35


def test_glibc_version_gate(monkeypatch):
    for libc, expected in ((("glibc", "2.36"), True), (("glibc", "2.35"), True), (("glibc", "2.31"), False),
                           (("musl", "1.2"), False), (("", ""), False)):
        monkeypatch.setattr(host_memory.platform, "libc_ver", lambda libc=libc: libc)
        assert host_memory._glibc_has_hugetlb_tunable() is expected, libc


mimalloc = pytest.mark.skipif(host_memory.mimalloc_library() is None,
                              reason="needs the cmeel-mimalloc wheel (a Linux dependency of ppojax)")


@mimalloc
def test_mimalloc_keeps_a_freed_block_for_the_next_one():
    on = _child(_ALLOCATOR_CHILD)
    assert on["mapped"] and on["preload"] == host_memory.mimalloc_library(), on
    assert host_memory.mimalloc_preloaded({"LD_PRELOAD": on["preload"]})
    assert on["purge_delay"] == host_memory.MIMALLOC_PURGE_DELAY_MS
    # the first round faults the block in; the next ones get the same memory back, already mapped
    assert on["faults"][0] > 16 and max(on["faults"][1:]) < 8, on
    off = _child(_ALLOCATOR_CHILD, PPOJAX_MIMALLOC="0")
    assert not off["mapped"] and off["preload"] is None and not host_memory.mimalloc_preloaded({})
    assert min(off["faults"]) > 16, off  # glibc maps every round afresh (2 MiB or 4 KiB pages)
    own = _child(_ALLOCATOR_CHILD, MIMALLOC_PURGE_DELAY="250")
    assert own["purge_delay"] == "250"  # the user's setting wins


def test_start_environment_asks_once_and_leaves_the_users_preload_alone(monkeypatch):
    monkeypatch.setattr(host_memory, "mimalloc_library", lambda: "/x/libmimalloc.so")
    monkeypatch.setattr(host_memory, "transparent_huge_pages_usable", lambda: True)
    first = host_memory.start_environment({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"})
    assert first == {"GLIBC_TUNABLES": f"glibc.malloc.arena_max=2:{host_memory.TUNABLE}",
                     "LD_PRELOAD": "/x/libmimalloc.so", "MIMALLOC_PURGE_DELAY": host_memory.MIMALLOC_PURGE_DELAY_MS}
    assert host_memory.start_environment(first) == {}  # the re-executed process asks for nothing more
    assert host_memory.start_environment({"LD_PRELOAD": "/usr/lib/libjemalloc.so.2"}) == \
        {"GLIBC_TUNABLES": host_memory.TUNABLE}
    assert host_memory.start_environment({"PPOJAX_MIMALLOC": "off", "PPOJAX_HUGE_PAGES": "0"}) == {}
    assert host_memory.start_environment({"MIMALLOC_PURGE_DELAY": "-1"})["MIMALLOC_PURGE_DELAY"] == "-1"
    with pytest.raises(SystemExit, match=r"MIMALLOC_PURGE_DELAY='1s' is not a whole number.*PPOJAX_MIMALLOC=0"):
        host_memory.start_environment({"MIMALLOC_PURGE_DELAY": "1s"})  # mimalloc alone would ignore it silently
    assert host_memory.start_environment({"MIMALLOC_PURGE_DELAY": "1s", "PPOJAX_MIMALLOC": "0",
                                          "PPOJAX_HUGE_PAGES": "0"}) == {}  # not preloading: not ours to judge
    monkeypatch.setattr(host_memory, "mimalloc_library", lambda: None)  # not installed, or not Linux
    assert host_memory.start_environment({}) == {"GLIBC_TUNABLES": host_memory.TUNABLE}
    monkeypatch.undo()
    monkeypatch.setattr(host_memory.sys, "platform", "darwin")
    assert host_memory.mimalloc_library() is None


def test_the_allocator_reexec_is_cpu_only(monkeypatch, tmp_path):
    """No re-exec (no LD_PRELOAD, no tunable) where the run computes on a GPU or TPU, or with ppojax's CPU backend
    off; JAX_PLATFORMS decides where it is set, else the host's accelerator device files."""
    from ppojax.backends.cpu import capabilities

    monkeypatch.setattr(host_memory, "mimalloc_library", lambda: "/x/libmimalloc.so")
    monkeypatch.setattr(host_memory, "transparent_huge_pages_usable", lambda: True)
    monkeypatch.setattr(capabilities, "ACCELERATOR_DEVICE_FILES", (str(tmp_path / "nvidia[0-9]*"),))
    assert host_memory.start_environment({})["LD_PRELOAD"] == "/x/libmimalloc.so"  # a CPU host
    for environ in ({"JAX_PLATFORMS": "cuda"}, {"JAX_PLATFORMS": "tpu,cpu"}, {"PPOJAX_CPU_BACKEND": "0"}):
        assert host_memory.start_environment(environ) == {}, environ
    (tmp_path / "nvidia0").touch()  # a GPU host
    assert capabilities.accelerator_host({}) == f"this host has an accelerator ({tmp_path / 'nvidia0'})"
    assert host_memory.start_environment({}) == {}
    assert host_memory.start_environment({"JAX_PLATFORMS": "cpu"})["LD_PRELOAD"] == "/x/libmimalloc.so"
