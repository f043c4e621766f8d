"""The size and checksums of every file under a directory, and the check of a directory against them.

Used by checkpoints (``checkpoint.py``) to tell an intact checkpoint from a damaged one: a truncated, missing or
grown file is found from ``stat`` alone; bytes changed in place are found by the checksums.

Why CRC32 (``zlib.crc32``): the manifest guards against accidental damage (a full disk, a partial copy, a
deleted file, flipped bytes), not against an adversary, so a cryptographic hash buys nothing. CRC32 is the
fastest checksum in Python's standard library (several times sha256 and blake2b on one core), detects every
error burst up to 32 bits and misses a random corruption with probability 2^-32, and releases the GIL, so the
blocks of a file are checksummed in parallel threads. Files are checksummed per block of ``BLOCK_SIZE`` bytes:
a multi-GB file of a checkpoint spreads over all cores, and a mismatch names the damaged byte range.

Manifest (JSON)::

    {"version": 1, "checksum": "crc32", "block_size": 67108864,
     "files": {"train_state/_METADATA": {"size": 1441, "crc32": ["0a1b2c3d"]}, ...}}

File names are relative to the directory, ``/``-separated; ``crc32`` has one hex checksum per block.
"""
from __future__ import annotations

import os
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Iterable, Optional

__all__ = ["BLOCK_SIZE", "build_manifest", "check_manifest", "crc32_hex", "manifest_signature"]

BLOCK_SIZE = 64 << 20  # checksum granularity (bytes); read in READ_SIZE pieces so memory stays small
READ_SIZE = 4 << 20
MANIFEST_VERSION = 1


def crc32_hex(data: bytes) -> str:
    return f"{zlib.crc32(data):08x}"


def _workers() -> int:
    return max(1, min(8, os.cpu_count() or 1))


def _block_crc(path: Path, offset: int, length: int) -> Optional[str]:
    """CRC32 of ``length`` bytes of ``path`` from ``offset``; None if the file ends (or vanishes) before."""
    crc = 0
    buffer = memoryview(bytearray(min(READ_SIZE, max(length, 1))))
    try:
        with open(path, "rb", buffering=0) as f:
            f.seek(offset)
            remaining = length
            while remaining:
                n = f.readinto(buffer[: min(READ_SIZE, remaining)])
                if not n:
                    return None
                crc = zlib.crc32(buffer[:n], crc)
                remaining -= n
    except OSError:
        return None
    return f"{crc:08x}"


def _blocks(size: int, block_size: int) -> list[tuple[int, int]]:
    """(offset, length) of each block; an empty file is one empty block."""
    return [(o, min(block_size, size - o)) for o in range(0, size, block_size)] or [(0, 0)]


def _checksum_files(root: Path, sizes: dict[str, int], block_size: int) -> dict[str, list[Optional[str]]]:
    """Per-file block checksums of ``sizes``' files, all blocks of all files in one thread pool."""
    tasks = [(name, offset, length) for name, size in sizes.items() for offset, length in _blocks(size, block_size)]
    with ThreadPoolExecutor(_workers()) as pool:
        crcs = list(pool.map(lambda t: _block_crc(root / t[0], t[1], t[2]), tasks))
    out: dict[str, list[Optional[str]]] = {name: [] for name in sizes}
    for (name, _, _), crc in zip(tasks, crcs):
        out[name].append(crc)
    return out


def _walk_files(root: Path, skip: Iterable[str]) -> list[str]:
    skip = set(skip)
    names = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for filename in sorted(filenames):
            name = Path(dirpath, filename).relative_to(root).as_posix()
            if name not in skip:
                names.append(name)
    return names


def build_manifest(root, skip: Iterable[str] = ()) -> dict:
    """The manifest of every file under ``root`` except the top-level names in ``skip``."""
    root = Path(root)
    sizes = {name: (root / name).stat().st_size for name in _walk_files(root, skip)}
    crcs = _checksum_files(root, sizes, BLOCK_SIZE)
    if any(c is None for blocks in crcs.values() for c in blocks):  # a file changed while being read
        raise OSError(f"a file under {root} changed while its manifest was being written")
    return {"version": MANIFEST_VERSION, "checksum": "crc32", "block_size": BLOCK_SIZE,
            "files": {name: {"size": sizes[name], "crc32": crcs[name]} for name in sizes}}


def manifest_signature(root, manifest: dict) -> tuple:
    """Identity and timestamps of the manifest's files: unchanged signature <=> files not rewritten since."""
    root = Path(root)
    out = []
    for name in sorted(manifest["files"]):
        try:
            st = os.stat(root / name)
        except OSError:
            out.append((name, None))
            continue
        out.append((name, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns))
    return tuple(out)


def check_manifest(root, manifest: dict, *, checksums: bool = True,
                   describe: Callable[[str], str] = str) -> Optional[str]:
    """The first way ``root`` differs from ``manifest`` as one line, or None if it matches.

    Every file is first checked for presence and size (cheap: ``stat``), then, if ``checksums``, read and
    checksummed. ``describe(name)`` words a file's name in the message (e.g. "model state file <name>").
    """
    root = Path(root)
    files = manifest["files"]
    block_size = int(manifest["block_size"])
    for name, entry in files.items():
        path = root / name
        if not path.exists():
            return f"{describe(name)} is missing"
        if not path.is_file():
            return f"{describe(name)} is not a file"
        size, want = path.stat().st_size, int(entry["size"])
        if size != want:
            how = "truncated" if size < want else "it grew"
            return f"{describe(name)} is {size:,} bytes, the manifest says {want:,} ({how})"
    if not checksums:
        return None
    crcs = _checksum_files(root, {name: int(entry["size"]) for name, entry in files.items()}, block_size)
    for name, entry in files.items():
        for index, (have, want) in enumerate(zip(crcs[name], entry["crc32"])):
            if have != want:
                start = index * block_size
                end = min(start + block_size, int(entry["size"])) - 1
                if have is None:
                    return f"{describe(name)} changed while being checked (bytes {start:,}-{end:,} unreadable)"
                return (f"{describe(name)} has changed contents: bytes {start:,}-{end:,} do not match the "
                        f"manifest's checksum (same size)")
        if len(crcs[name]) != len(entry["crc32"]):
            return f"{describe(name)}: the manifest's checksums do not cover its {int(entry['size']):,} bytes"
    return None
