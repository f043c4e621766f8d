"""Peak memory and page faults of the SmolLM2 benchmark's ``train_step`` under four malloc set-ups.

    python -m benchmarks.heap_growth [--steps 5] [--modes kept_heap,plain,huge_pages,mimalloc] [--json F]

Each mode runs in a fresh process: build the benchmark's PPO state (``benchmarks.ppojax_ppo.build``), compile
the ``train_step``, run ``--steps`` steps, and record after each the step's seconds and the process's peak RSS
(ru_maxrss), and at the end its minor page faults and kernel CPU time. Modes:

- ``kept_heap``: what ppojax did before ``ppojax/backends/cpu/host_memory.py`` used huge pages: ``mallopt`` one arena, no
  ``mmap``, never trim (freed memory stays in the heap for reuse);
- ``plain``: glibc's defaults (large blocks mapped and unmapped every step, 4 KiB page faults);
- ``huge_pages``: ``GLIBC_TUNABLES=glibc.malloc.hugetlb=1`` (what the ppojax command and benchmarks used
  before mimalloc, and still do where the ``cmeel-mimalloc`` wheel is missing);
- ``mimalloc``: the huge-page tunable and mimalloc preloaded with its purge delay, what
  ``ppojax.backends.cpu.host_memory.start_environment`` gives the ppojax command and the benchmarks now.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import resource
import subprocess
import sys
import time

MODES = ("kept_heap", "plain", "huge_pages", "mimalloc")
MODEL_DIR = ".cache/ppojax/smollm2-135m-instruct"


def child(mode: str, steps: int) -> dict:
    """In a fresh process started with the mode's environment."""
    if mode == "kept_heap":  # M_ARENA_MAX 1, M_MMAP_MAX 0, M_TRIM_THRESHOLD never (before JAX starts threads)
        mallopt = ctypes.CDLL("libc.so.6").mallopt
        mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
        assert all(mallopt(p, v) == 1 for p, v in ((-8, 1), (-4, 0), (-1, -1)))
    import jax
    import numpy as np

    from benchmarks import ppojax_ppo
    from benchmarks.common import make_config, peak_rss_mb
    from ppojax.rl.program import make_train_step

    config = make_config("smollm2", num_updates=steps, model_dir=MODEL_DIR if os.path.isdir(MODEL_DIR) else None)
    program, state, shardings = ppojax_ppo.build(dict(config, scan=1, phases=False))
    jax.block_until_ready(state)
    step = make_train_step(program, shardings)
    prompts, rows = np.asarray(config["prompts"], np.int32), config["batch_size"]
    records = [{"after": "build", "peak_rss_mb": peak_rss_mb()}]
    for u in range(steps):
        batch = prompts[(u % (len(prompts) // rows)) * rows:][:rows]
        start = time.perf_counter()
        state, metrics = step(state, batch, jax.random.key(u))
        jax.block_until_ready((state, metrics))
        records.append({"after": f"step {u}", "seconds": time.perf_counter() - start,
                        "peak_rss_mb": peak_rss_mb()})
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return {"mode": mode, "records": records, "minor_faults": usage.ru_minflt, "system_cpu_s": usage.ru_stime,
            "user_cpu_s": usage.ru_utime, "glibc_tunables": os.environ.get("GLIBC_TUNABLES"),
            "ld_preload": os.environ.get("LD_PRELOAD")}


def run(mode: str, steps: int) -> dict:
    from ppojax.backends.cpu import host_memory

    env = {k: v for k, v in os.environ.items() if k not in host_memory.START_VARIABLES}
    if mode == "mimalloc":
        if host_memory.mimalloc_library() is None:
            return {"mode": mode, "error": "the cmeel-mimalloc wheel is not installed (Linux only)"}
        env.update(host_memory.start_environment(env))
    elif mode == "huge_pages":
        env["GLIBC_TUNABLES"] = "glibc.malloc.hugetlb=1"
    # the ppojax code under test must not re-exec the child into another mode
    env[host_memory.OFF_SWITCH] = env[host_memory.MIMALLOC_OFF_SWITCH] = "0"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.heap_growth", "--child", mode, "--steps", str(steps)],
                          capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        return {"mode": mode, "error": proc.stderr[-3000:]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--json", default=None)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args.steps)))
        return
    from benchmarks.common import machine_info

    results = {"machine": machine_info(), "steps": args.steps, "modes": []}
    for mode in args.modes.split(","):
        result = run(mode, args.steps)
        results["modes"].append(result)
        if "error" in result:
            print(f"{mode}: failed\n{result['error']}")
            continue
        seconds = " ".join(f"{r['seconds']:5.1f}" for r in result["records"] if "seconds" in r)
        peaks = " ".join(f"{r['peak_rss_mb']:6.0f}" for r in result["records"])
        print(f"{mode:11s} step s {seconds} | peak RSS MB {peaks} | minor faults "
              f"{result['minor_faults'] / 1e6:.2f} M, kernel CPU {result['system_cpu_s']:.1f} s", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
