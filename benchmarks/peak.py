"""The machine's measured float32 matmul FLOP/s, with jax and with torch (best of several square matmuls).

    python -m benchmarks.peak [--backend jax|torch|all] [--sizes 2048,4096] [--reps 10] [--threads N] [--json F]

Each backend is imported only when asked for, so this runs in the project venv (jax; torch too when the test
extras are installed) and in ``.venv-bench`` (torch only). ``run.py`` calls it once per backend in a fresh
process. A matmul of two n×n matrices is counted as 2·n³ FLOPs; the figure is the best (shortest) of
``reps`` timed runs after one warm-up, the best over sizes. ``flops_per_cpu_s`` divides by the process's
CPU seconds instead (all threads): on a shared machine it stays near the per-core rate while the wall-clock
figure drops; ``cores × flops_per_cpu_s`` bounds what an idle machine would give.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from ppojax.io.strict_json import write_json


def _best(fn, reps: int) -> tuple[float, float]:
    """(best wall seconds, best process-CPU seconds) of ``fn`` over ``reps`` runs after a warm-up."""
    fn()  # warm-up (compilation, allocation, thread-pool start)
    best, best_cpu = float("inf"), float("inf")
    for _ in range(reps):
        t0, c0 = time.perf_counter(), time.process_time()
        fn()
        best = min(best, time.perf_counter() - t0)
        best_cpu = min(best_cpu, time.process_time() - c0)
    return best, best_cpu


def measure_jax(sizes=(2048, 4096), reps: int = 10) -> dict:
    import jax
    import jax.numpy as jnp

    out = {"backend": "jax", "version": jax.__version__, "device": str(jax.devices()[0]), "by_size": {},
           "per_cpu_s_by_size": {}}
    matmul = jax.jit(jnp.matmul)
    for n in sizes:
        ka, kb = jax.random.split(jax.random.key(0))
        a = jax.random.normal(ka, (n, n), jnp.float32)
        b = jax.random.normal(kb, (n, n), jnp.float32)
        secs, cpu = _best(lambda: matmul(a, b).block_until_ready(), reps)
        out["by_size"][str(n)] = 2 * n**3 / secs
        out["per_cpu_s_by_size"][str(n)] = 2 * n**3 / cpu
    out["flops_per_s"] = max(out["by_size"].values())
    out["flops_per_cpu_s"] = max(out["per_cpu_s_by_size"].values())
    return out


def measure_torch(sizes=(2048, 4096), reps: int = 10, threads: int | None = None) -> dict:
    import torch

    if threads:
        torch.set_num_threads(threads)
    out = {"backend": "torch", "version": torch.__version__, "threads": torch.get_num_threads(), "by_size": {},
           "per_cpu_s_by_size": {}}
    g = torch.Generator().manual_seed(0)
    for n in sizes:
        a = torch.randn(n, n, generator=g, dtype=torch.float32)
        b = torch.randn(n, n, generator=g, dtype=torch.float32)
        c = torch.empty(n, n, dtype=torch.float32)
        secs, cpu = _best(lambda: torch.matmul(a, b, out=c), reps)
        out["by_size"][str(n)] = 2 * n**3 / secs
        out["per_cpu_s_by_size"][str(n)] = 2 * n**3 / cpu
    out["flops_per_s"] = max(out["by_size"].values())
    out["flops_per_cpu_s"] = max(out["per_cpu_s_by_size"].values())
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", default="all", choices=["jax", "torch", "all"])
    p.add_argument("--sizes", default="2048,4096", help="comma-separated matrix sizes")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own)")
    p.add_argument("--json", default=None, help="write the result here (default: stdout)")
    a = p.parse_args(argv)
    if a.threads:
        os.environ.setdefault("OMP_NUM_THREADS", str(a.threads))
    sizes = tuple(int(s) for s in a.sizes.split(","))
    result = {}
    if a.backend in ("jax", "all"):
        result["jax"] = measure_jax(sizes, a.reps)
    if a.backend in ("torch", "all"):
        result["torch"] = measure_torch(sizes, a.reps, a.threads)
    if a.json:
        write_json(a.json, result, indent=1)
    else:
        print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
