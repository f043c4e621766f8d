"""One entry point for the benchmarks: the machine's matmul peak, TRL's PPO and ppojax's PPO on the same work,
back to back, then the ratios ppojax / TRL and the model FLOP utilisation (MFU) of each.

    python -m benchmarks.run [--quick] [--json out.json] [--only trl|ppojax] [--sizes tiny,smollm2]
                             [--threads 1,2] [--smollm2-dir DIR] [--updates N] [--interleave]
                             [--ppojax-mixed | --ppojax-precisions float32|mixed|float32,mixed]
    python -m benchmarks.run --merge REPORT [REPORT ...] [--json out.json]

- peak: ``benchmarks.peak`` in a fresh process per backend (jax here; torch in the TRL interpreter);
- TRL: ``benchmarks.trl_ppo`` in the ``.venv-bench`` interpreter (``bash benchmarks/install.sh``; or
  ``$PPOJAX_BENCH_PYTHON``, a path or a command name), once per torch thread count; the fastest (steady
  episodes/s) is reported, with the thread count;
- ppojax: ``benchmarks.ppojax_ppo.run(config) -> dict`` in a fresh process of this interpreter, if that
  module exists (the contract is in ``benchmarks/common.py``); otherwise reported as not available.

``--interleave``: TRL (the largest ``--threads`` count) and ppojax run as two live processes whose updates
alternate (``run_interleaved``), so both sides meet the machine's same fast and slow spells; the default runs
them back to back.

The report (``--json``) is rewritten after every side, with ``"complete": false`` until the run ends: a run
cut off keeps what it measured. ``--merge`` makes one report (ratios included) of runs that measured different
sides on ONE host, e.g. three processes pinned to separate cores at once (``benchmarks/device_check.sh``).

Every side runs in its own process so that thread settings and peak RSS are its own. ``--quick``: the tiny
size only, few updates, TRL with 2 threads only, small matmuls (under two minutes).

Timings on a shared machine are noisy. Each measurement records ``other_load_cores`` (cores that other
processes kept busy meanwhile; 0 = a quiet machine), and ``--wait-quiet S`` waits up to S seconds for a
quiet machine before each one.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path

from benchmarks.common import make_config, machine_info, peak_rss_mb, source_commit
from ppojax.io.strict_json import write_text_atomic
from ppojax.models.flops import Dims, ppo_update_flops
from ppojax.trainer.config import IN_PLACE_MATMULS, MATMUL_IMPLEMENTATIONS, PPOConfig

DEFAULT_REMAT = PPOConfig().remat  # ppojax's default, so the benchmark runs what a user's run does

REPO = Path(__file__).resolve().parent.parent
SCHEMA = 1
RATIO_KEYS = ("episodes_per_s", "episodes_per_cpu_s", "generation_tokens_per_s", "update_tokens_per_s",
              "time_to_first_update_s", "setup_and_first_update_s", "peak_rss_mb")


def default_smollm2_dir() -> str | None:
    """The converted SmolLM2-135M-Instruct checkpoint, when the converter has written it (else random init)."""
    path = REPO / ".cache" / "ppojax" / "smollm2-135m-instruct"
    return str(path) if (path / "model.safetensors").exists() and (path / "config.json").exists() else None


def trl_python() -> Path:
    """TRL's interpreter: ``$PPOJAX_BENCH_PYTHON`` (a path, or a command name found on PATH such as ``python3``),
    else ``.venv-bench``'s."""
    named = os.environ.get("PPOJAX_BENCH_PYTHON")
    if not named:
        return REPO / ".venv-bench" / "bin" / "python"
    found = shutil.which(named) if os.sep not in named else None
    return Path(found or named)


def _no_trl_reason(py: Path) -> str:
    return (f"{py} not found: install TRL's environment with `bash benchmarks/install.sh`, or set "
            "PPOJAX_BENCH_PYTHON to an interpreter that has TRL")


def _env(extra: dict | None = None) -> dict:
    env = dict(os.environ, **(extra or {}))
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    env.setdefault("PYTHONWARNINGS", "ignore")
    return env


def _busy_cpu_s() -> float | None:
    """Seconds of CPU time the whole machine has spent busy (all cores), from /proc/stat."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def _children_cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


WAIT_QUIET = {"max_s": 0.0, "below_cores": 0.25}  # set from --wait-quiet


def _machine_load(window_s: float = 3.0) -> float | None:
    """Cores kept busy (by anyone) over the next ``window_s`` seconds."""
    b0 = _busy_cpu_s()
    time.sleep(window_s)
    b1 = _busy_cpu_s()
    return None if b0 is None or b1 is None else (b1 - b0) / window_s


def wait_until_quiet() -> dict | None:
    """With ``--wait-quiet S``: before a measurement, wait (up to S seconds) until other processes keep fewer
    than ``below_cores`` cores busy. Returns what it saw, or None when not asked."""
    if WAIT_QUIET["max_s"] <= 0:
        return None
    t0 = time.perf_counter()
    load = _machine_load()
    while (load is not None and load >= WAIT_QUIET["below_cores"]
           and time.perf_counter() - t0 < WAIT_QUIET["max_s"]):
        load = _machine_load(10.0)
    return {"waited_s": round(time.perf_counter() - t0, 1), "load_cores_at_start": load,
            "quiet": load is not None and load < WAIT_QUIET["below_cores"]}


def _other_load_cores(busy0: float | None, child0: float, wall: float) -> float | None:
    """Cores that processes other than this one's children kept busy since ``busy0`` / ``child0`` (machine busy
    seconds and children's CPU seconds then), over ``wall`` seconds: the noise indicator of a shared machine."""
    busy1, child1 = _busy_cpu_s(), _children_cpu_s()
    if busy0 is None or busy1 is None:
        return None
    return max(0.0, (busy1 - busy0) - (child1 - child0)) / wall


def _subprocess_json(cmd: list[str], out: Path, timeout: float, log: Path, env: dict | None = None) -> dict:
    """Run ``cmd`` (which writes JSON to ``out``); on failure a dict with ``error``.

    Adds ``process_wall_s`` and ``other_load_cores``: the average number of cores that OTHER processes kept
    busy meanwhile (machine busy time minus the child's CPU time, over the wall time) — the noise indicator
    of a shared machine (0 = the benchmark had the machine to itself)."""
    quiet = wait_until_quiet()
    t0 = time.perf_counter()
    busy0, child0 = _busy_cpu_s(), _children_cpu_s()
    try:
        with open(log, "w") as logf:
            proc = subprocess.run(cmd, cwd=REPO, env=_env(env), stdout=logf, stderr=subprocess.STDOUT,
                                  timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"available": False, "error": f"timed out after {timeout:.0f} s: {' '.join(cmd)}",
                "log_tail": _tail(log)}
    wall = time.perf_counter() - t0
    other = _other_load_cores(busy0, child0, wall)
    if proc.returncode != 0 or not out.exists():
        return {"available": False, "error": f"exit code {proc.returncode}: {' '.join(cmd)}",
                "log_tail": _tail(log)}
    result = json.loads(out.read_text())
    result.setdefault("available", True)
    result["process_wall_s"] = wall
    result["other_load_cores"] = other
    if quiet is not None:
        result["wait_quiet"] = quiet
    return result


def _tail(path: Path, n: int = 2000) -> str:
    try:
        return path.read_text()[-n:]
    except OSError:
        return ""


# ---------------------------------------------------------------------------------------------------------


def run_peak(tmp: Path, quick: bool) -> dict:
    sizes, reps = ("2048", 5) if quick else ("2048,4096", 10)
    result: dict = {}
    runs = [("jax", sys.executable)]
    torch_py = str(trl_python()) if trl_python().exists() else (
        sys.executable if importlib.util.find_spec("torch") else None)
    if torch_py:
        runs.append(("torch", torch_py))
    else:
        result["torch"] = {"available": False, "error": "no interpreter with torch"}
    for backend, py in runs:
        out = tmp / f"peak_{backend}.json"
        r = _subprocess_json([py, "-m", "benchmarks.peak", "--backend", backend, "--sizes", sizes,
                              "--reps", str(reps), "--json", str(out)], out, 300, tmp / f"peak_{backend}.log")
        result[backend] = dict(r.get(backend, {}), **{k: v for k, v in r.items() if k != backend})
    rates = [v["flops_per_s"] for v in result.values() if isinstance(v, dict) and "flops_per_s" in v]
    result["peak_flops_per_s"] = max(rates) if rates else None
    return result


def run_trl(config_path: Path, tmp: Path, threads: list[int], timeout: float) -> dict:
    py = trl_python()
    if not py.exists():
        return {"available": False, "reason": _no_trl_reason(py)}
    by_threads = {}
    for t in threads:
        out = tmp / f"trl_{config_path.stem}_{t}.json"
        by_threads[str(t)] = _subprocess_json(
            [str(py), "-m", "benchmarks.trl_ppo", "--config", str(config_path), "--threads", str(t),
             "--json", str(out)], out, timeout, tmp / f"trl_{config_path.stem}_{t}.log")
    ok = {t: r for t, r in by_threads.items() if r.get("available") and "episodes_per_s" in r}
    if not ok:
        return {"available": False, "reason": "every TRL run failed", "by_threads": by_threads}
    best_t = max(ok, key=lambda t: ok[t]["episodes_per_s"])
    best = dict(ok[best_t])
    best["by_threads"] = {t: {k: r.get(k) for k in ("episodes_per_s", "episodes_per_cpu_s", "time_to_first_update_s",
                                                    "generation_tokens_per_s", "update_tokens_per_s",
                                                    "peak_rss_mb", "other_load_cores", "error")}
                          for t, r in by_threads.items()}
    best["threads_tried"] = [int(t) for t in by_threads]
    return best


def run_ppojax(config_path: Path, tmp: Path, timeout: float, measured=lambda result: None) -> dict:
    """The measured ppojax run (``measured(result)`` is called with it at once, so that a run cut off during the
    warm-cache run below still keeps it), then the warm-cache run added to the same result."""
    if importlib.util.find_spec("benchmarks.ppojax_ppo") is None:
        return {"available": False, "reason": "benchmarks/ppojax_ppo.py does not exist yet"}
    # JAX's persistent compilation cache (on in ppojax runs), empty for the measured run: its first update
    # includes every compilation, the figure compared with TRL. A second, 2-update run on the filled cache
    # gives the first update of a re-run or a resume (``warm_cache``).
    cache = _compile_cache_env(config_path, tmp)

    def worker(config: Path, name: str) -> dict:
        out = tmp / f"{name}.json"
        return _subprocess_json(_ppojax_worker_cmd(config, out), out, timeout, tmp / f"{name}.log", cache)

    result = worker(config_path, f"ppojax_{config_path.stem}")
    measured(result)
    if result.get("available"):
        _add_warm_cache_run(result, config_path, tmp, timeout)
    return result


def prepare_machine(tmp: Path, timeout: float = 300) -> dict:
    """ppojax's once-per-machine step before its measured runs (as an install is): the in-place GEMM handlers built
    and the library `matmul_implementation: auto` takes measured on this CPU where no record covers it
    (`python -m ppojax.backends.cpu.matmul_tuning`), so that neither lands in a measured first update. -> its seconds
    and what it said."""
    log = tmp / "prepare_machine.log"
    start = time.perf_counter()
    with open(log, "w") as logf:
        try:
            done = subprocess.run([sys.executable, "-m", "ppojax.backends.cpu.matmul_tuning"], cwd=REPO, env=_env(),
                                  stdout=logf, stderr=subprocess.STDOUT, timeout=timeout)
            error = None if done.returncode == 0 else f"exit status {done.returncode}"
        except subprocess.TimeoutExpired:
            error = f"timed out after {timeout} s"
    said = [line for line in log.read_text().splitlines() if "'auto'" in line or "handlers" in line]
    return {"seconds": time.perf_counter() - start, "said": said, "error": error}


def _uses_in_place_matmuls(config: dict) -> bool:
    """Whether ppojax's float32 run of `config` multiplies its layers on the in-place GEMM handlers: a library named,
    or "auto" on a model whose layers are large enough for it (`stacked_matmul.AUTO_MIN_LAYER_ELEMENTS`)."""
    from ppojax.backends.cpu.stacked_matmul import AUTO_MIN_LAYER_ELEMENTS

    implementation = config.get("matmul_implementation", "auto")
    if implementation != "auto":
        return implementation != "xla"
    d = Dims.from_config(_model_shape(config))
    attention = 2 * d.hidden * d.heads * d.head_dim + 2 * d.hidden * d.kv_heads * d.head_dim
    return attention + 3 * d.hidden * d.mlp >= AUTO_MIN_LAYER_ELEMENTS


def _ppojax_worker_cmd(config: Path, out: Path) -> list[str]:
    return [sys.executable, "-m", "benchmarks.run", "--_worker", "ppojax", "--_config", str(config), "--_out", str(out)]


def _compile_cache_env(config_path: Path, tmp: Path) -> dict:
    return {"JAX_COMPILATION_CACHE_DIR": str(tmp / f"xla_cache_{config_path.stem}")}


def _add_warm_cache_run(result: dict, config_path: Path, tmp: Path, timeout: float) -> None:
    """A second ppojax run of 2 updates on the compilation cache the measured run filled: the first update of a
    re-run or a resume (``result["warm_cache"]``)."""
    warm_config = tmp / f"{config_path.stem}_warm.json"
    warm_config.write_text(json.dumps(dict(json.loads(config_path.read_text()), stop_after_updates=2)))
    out = tmp / f"ppojax_{config_path.stem}_warm.json"
    warm = _subprocess_json(_ppojax_worker_cmd(warm_config, out), out, timeout,
                            tmp / f"ppojax_{config_path.stem}_warm.log", _compile_cache_env(config_path, tmp))
    result["warm_cache"] = {k: warm.get(k) for k in ("time_to_first_update_s", "setup_s", "setup_and_first_update_s",
                                                     "error") if k in warm}


def _await_file(path: Path, proc: subprocess.Popen, deadline: float) -> str | None:
    """Wait until ``path`` exists. Returns None, or why not (the process ended first, or the deadline)."""
    while not path.exists():
        if proc.poll() is not None:
            return f"exited with code {proc.returncode} before {path.name}"
        if time.perf_counter() > deadline:
            return f"timed out waiting for {path.name}"
        time.sleep(0.01)
    return None


def grant_turns(turn_dir: Path, procs: dict, num_updates: int, deadline: float) -> dict:
    """The orchestrator's half of ``common.Turns``: once every side is ready, update u of each side in turn (the
    order of ``procs`` in even rounds, reversed in odd ones), each started only after the previous one is done.
    Returns {side: None, or why it failed (it exited, or the deadline passed)}; stops at the first failure."""
    errors = {side: _await_file(turn_dir / f"{side}.ready", proc, deadline) for side, proc in procs.items()}
    sides = list(procs)
    for u in range(num_updates if not any(errors.values()) else 0):
        for side in (sides if u % 2 == 0 else sides[::-1]):
            (turn_dir / f"{side}.go.{u}").touch()
            errors[side] = _await_file(turn_dir / f"{side}.done.{u}", procs[side], deadline)
            if errors[side]:
                return errors
    return errors


def run_interleaved(config_path: Path, tmp: Path, threads: int, timeout: float) -> tuple[dict, dict]:
    """(TRL's result, ppojax's result) from two live processes whose updates ALTERNATE: TRL's update u, then
    ppojax's update u (ppojax first in odd rounds), each alone on the machine and timed from the start of its
    turn (``common.Turns``). A shared or virtual machine drifts between fast and slow spells over minutes;
    back-to-back runs put the two sides in different spells, interleaved ones in the same. TRL runs with
    ``threads`` torch threads; the sides' set-ups overlap (``setup_s`` is not compared); ppojax's phase
    timings and its warm-cache run follow, alone."""
    py = trl_python()
    if not py.exists():
        return {"available": False, "reason": _no_trl_reason(py)}, run_ppojax(config_path, tmp, timeout)
    stem = config_path.stem
    config = json.loads(config_path.read_text())
    turn_dir = tmp / f"turns_{stem}"
    turn_dir.mkdir()
    shared_config = tmp / f"{stem}_interleaved.json"
    shared_config.write_text(json.dumps(dict(config, turn_dir=str(turn_dir))))
    outs = {side: tmp / f"{side}_{stem}_interleaved.json" for side in ("trl", "ppojax")}
    cmds = {"trl": [str(py), "-m", "benchmarks.trl_ppo", "--config", str(shared_config), "--threads", str(threads),
                    "--json", str(outs["trl"])],
            "ppojax": _ppojax_worker_cmd(shared_config, outs["ppojax"])}
    envs = {"trl": None, "ppojax": _compile_cache_env(config_path, tmp)}
    n = config["num_updates"]
    deadline = time.perf_counter() + 2 * timeout
    t0, busy0, child0 = time.perf_counter(), _busy_cpu_s(), _children_cpu_s()
    procs, logs, errors = {}, {}, {}
    try:
        for side, cmd in cmds.items():
            logs[side] = open(tmp / f"{side}_{stem}_interleaved.log", "w")
            procs[side] = subprocess.Popen(cmd, cwd=REPO, env=_env(envs[side]), stdout=logs[side],
                                           stderr=subprocess.STDOUT)
        errors = grant_turns(turn_dir, procs, n, deadline)
        (turn_dir / f"ppojax.go.{n}").touch()  # ppojax's phase timings, once TRL is done
        for side, proc in procs.items():
            try:
                proc.wait(timeout=max(1.0, deadline - time.perf_counter()))
            except subprocess.TimeoutExpired:
                errors[side] = errors.get(side) or f"timed out after {2 * timeout:.0f} s"
    finally:
        for side, proc in procs.items():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            logs[side].close()
    wall = time.perf_counter() - t0
    other = _other_load_cores(busy0, child0, wall)
    results = {}
    for side in cmds:
        log = tmp / f"{side}_{stem}_interleaved.log"
        if errors.get(side) or procs[side].returncode != 0 or not outs[side].exists():
            reason = errors.get(side) or f"exit code {procs[side].returncode}"
            results[side] = {"available": False, "error": f"{reason}: {' '.join(cmds[side])}", "log_tail": _tail(log)}
            continue
        result = json.loads(outs[side].read_text())
        result.update(available=result.get("available", True), interleaved=True, process_wall_s=wall,
                      other_load_cores=other)
        results[side] = result
    results["trl"].setdefault("threads", threads)
    if results["ppojax"].get("available"):
        _add_warm_cache_run(results["ppojax"], config_path, tmp, timeout)
    return results["trl"], results["ppojax"]


def _worker(config_path: str, out_path: str) -> int:
    """Child process: ``benchmarks.ppojax_ppo.run(config)``, plus this process's peak RSS."""
    from ppojax.backends import start_program

    with open(config_path) as f:
        config = json.load(f)
    start_program(config.get("precision", "float32"))  # as the ppojax command does (ppojax.backends.start_program)
    import benchmarks.ppojax_ppo as side

    if not callable(getattr(side, "run", None)):
        result = {"available": False, "reason": "benchmarks.ppojax_ppo has no run(config) -> dict"}
    else:
        result = dict(side.run(config))
        result.setdefault("side", "ppojax")
        result.setdefault("peak_rss_mb", peak_rss_mb())
        result.setdefault("available", True)
    with open(out_path, "w") as f:
        json.dump(result, f, indent=1)
    return 0


# ---------------------------------------------------------------------------------------------------------


def _model_shape(config: dict) -> dict:
    if config.get("model_dir"):
        with open(Path(config["model_dir"]) / "config.json") as f:
            return json.load(f)
    return config["model"]


def _versions() -> dict:
    out = {}
    for pkg in ("jax", "jaxlib", "flax", "optax", "ppojax"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = None
    return out


def run_size(size: str, args, tmp: Path, peak: float | None, entry: dict | None = None,
             save=lambda: None) -> dict:
    """One size's sides, filled into ``entry`` (returned); ``save()`` after each side (and after a ppojax side's
    measured run, before its warm-cache run), so that a run cut off keeps what it measured."""
    model_dir = args.smollm2_dir if size == "smollm2" else None
    config = make_config(size, quick=args.quick, num_updates=args.updates, model_dir=model_dir)
    config["remat"] = args.ppojax_remat  # ppojax's side only (TRL's PPOTrainer runs without checkpointing)
    config["behaviour_logprobs"] = args.ppojax_behaviour_logprobs  # TRL's PPOTrainer takes the sampler's
    config["matmul_implementation"] = args.ppojax_matmul  # ppojax's float32 layer projections
    config_path = tmp / f"{size}.json"
    config_path.write_text(json.dumps(config))
    timeout = 150 if args.quick else (600 if size == "tiny" else 2400)
    shown = {k: v for k, v in config.items() if k != "prompts"}
    flops = ppo_update_flops(_model_shape(config), config["batch_size"], config["prompt_length"],
                             config["response_length"], config["num_ppo_epochs"])
    entry = {} if entry is None else entry
    entry.update(config=shown, flops=flops)

    def measured(key: str):
        def keep(result: dict) -> None:
            entry[key] = result
            add_ratios(entry, peak)
            save()
        return keep

    skipped = {"available": False, "reason": "skipped (--only)"}
    float32, mixed = ("float32" in args.ppojax_precisions, "mixed" in args.ppojax_precisions)
    if float32 and args.only in (None, "ppojax") and _uses_in_place_matmuls(config):
        setup = entry["ppojax_machine_setup"] = prepare_machine(tmp)
        said = setup["said"][-2:] + ([setup["error"]] if setup["error"] else [])
        print(f"[{size}] ppojax's once-per-machine setup ({setup['seconds']:.1f} s): " + "; ".join(said),
              file=sys.stderr, flush=True)
    if args.interleave and args.only is None and float32:
        print(f"[{size}] TRL and ppojax, updates interleaved ...", file=sys.stderr, flush=True)
        entry["trl"], entry["ppojax"] = run_interleaved(config_path, tmp, max(args.threads), timeout)
        save()
    else:
        print(f"[{size}] TRL ...", file=sys.stderr, flush=True)
        entry["trl"] = run_trl(config_path, tmp, args.threads, timeout) if args.only in (None, "trl") else skipped
        save()
        print(f"[{size}] ppojax ...", file=sys.stderr, flush=True)
        if args.only == "trl":
            entry["ppojax"] = skipped
        elif not float32:
            entry["ppojax"] = {"available": False, "reason": "skipped (--ppojax-precisions)"}
        else:
            entry["ppojax"] = run_ppojax(config_path, tmp, timeout, measured("ppojax"))
        save()
    if mixed and args.only in (None, "ppojax"):
        # a separate row, never in place of the same-precision one: bf16 matmuls against TRL's float32
        print(f"[{size}] ppojax, precision mixed ...", file=sys.stderr, flush=True)
        mixed_path = tmp / f"{size}_mixed.json"
        mixed_path.write_text(json.dumps(dict(config, precision="mixed")))
        entry["ppojax_mixed"] = run_ppojax(mixed_path, tmp, timeout, measured("ppojax_mixed"))
        save()
    add_ratios(entry, peak)
    return entry


def mfu(flops: dict, result: dict, peak_flops_per_s: float) -> dict:
    """Model FLOP utilisation of a side from its steady per-phase times (``summarize`` keys): achieved FLOP/s of
    the rollout, of the update and overall, and each over the measured peak."""
    out = {}
    for name, f, secs in (("rollout", flops["rollout"], result["rollout_s"]),
                          ("update", flops["update"], result["update_s"]),
                          ("overall", flops["total"], result["step_s"])):
        rate = f / secs if secs > 0 else float("nan")
        out[f"{name}_flops_per_s"] = rate
        out[f"{name}_mfu"] = rate / peak_flops_per_s if peak_flops_per_s else None
    return out


def add_ratios(entry: dict, peak: float | None) -> None:
    """A size's derived figures from its sides: MFU of each float32 side, ppojax / TRL and ppojax-mixed / TRL."""
    trl, pj, mixed = (entry.get(k) or {} for k in ("trl", "ppojax", "ppojax_mixed"))
    entry["mfu"] = {side: mfu(entry["flops"], entry[side], peak) for side in ("trl", "ppojax")  # float32 peak
                    if (entry.get(side) or {}).get("available") and peak and "rollout_s" in entry[side]}
    if trl.get("available") and mixed.get("available"):
        entry["ratio_ppojax_mixed_over_trl"] = {
            k: mixed[k] / trl[k] for k in RATIO_KEYS if mixed.get(k) is not None and trl.get(k)}
    if trl.get("available") and pj.get("available"):
        entry["ratio_ppojax_over_trl"] = {
            k: pj[k] / trl[k] for k in RATIO_KEYS if pj.get(k) is not None and trl.get(k)}
    else:
        entry["ratio_ppojax_over_trl"] = None


def _read_report(path: str) -> dict:
    """A report of ``--json`` for ``--merge``; a clear exit naming the file when it is not one."""
    try:
        report = json.loads(Path(path).read_text())
    except (OSError, ValueError) as err:
        raise SystemExit(f"--merge: cannot read the report {path}: {err}") from None
    if not (isinstance(report, dict) and isinstance(report.get("machine"), dict) and "sizes" in report):
        raise SystemExit(f"--merge: {path} is not a benchmarks.run report (no 'machine' and 'sizes'); pass the "
                         "files that --json wrote")
    return report


def merge_reports(reports: list[dict]) -> dict:
    """One report from runs of different sides on ONE host (e.g. TRL and ppojax as separate processes pinned
    to separate cores): per size, each side from the first report where it is available; the ratios and MFU
    recomputed against the first report's peak. Refuses reports from different CPUs (``cpu_signature``)."""
    signatures = {r["machine"].get("cpu_signature") for r in reports}
    if len(signatures) != 1:
        raise SystemExit(f"--merge: the reports come from different CPUs {sorted(map(str, signatures))}; "
                         "merge only runs of one host")
    merged = {k: v for k, v in reports[0].items() if k != "sizes"}
    merged["merged_from"] = [r.get("started") for r in reports]
    merged["complete"] = all(r.get("complete", True) for r in reports)
    peak = (merged.get("peak") or {}).get("peak_flops_per_s")
    merged["sizes"] = {}
    for size in dict.fromkeys(s for r in reports for s in r.get("sizes", {})):
        entries = [r["sizes"][size] for r in reports if size in r.get("sizes", {})]
        if any(e["config"] != entries[0]["config"] for e in entries):
            raise SystemExit(f"--merge: the reports ran {size!r} with different settings (e.g. --updates); "
                             "merge only runs of the same work")
        entry = {"config": entries[0]["config"], "flops": entries[0]["flops"]}
        for side in ("trl", "ppojax", "ppojax_mixed"):
            # a measured side, else the report of a side that was tried (its error), else a skip
            tried = sorted((e[side] for e in entries if side in e), key=lambda r: (
                not r.get("available"), str(r.get("reason", "")).startswith("skipped")))
            if tried:
                entry[side] = tried[0]
        entry.setdefault("trl", {"available": False, "reason": "in none of the merged reports"})
        entry.setdefault("ppojax", {"available": False, "reason": "in none of the merged reports"})
        add_ratios(entry, peak)
        merged["sizes"][size] = entry
    return merged


def _fmt(v, unit=""):
    if v is None:
        return "—"
    if isinstance(v, float):
        return f"{v:,.3g}{unit}" if abs(v) < 100 else f"{v:,.0f}{unit}"
    return f"{v}{unit}"


def table(report: dict) -> str:
    lines = []
    pk = report["peak"]
    lines.append("float32 matmul peak: " + ", ".join(
        f"{b} {pk[b]['flops_per_s'] / 1e9:.0f} GFLOP/s ({pk[b].get('flops_per_cpu_s', 0) / 1e9:.0f} per CPU-s)"
        for b in ("jax", "torch")
        if isinstance(pk.get(b), dict) and "flops_per_s" in pk[b]) + "".join(
        f" [{b}: others kept {pk[b]['other_load_cores']:.2f} cores busy]" for b in ("jax", "torch")
        if isinstance(pk.get(b), dict) and pk[b].get("other_load_cores") is not None))
    loads = [pk[b].get("other_load_cores") or 0 for b in ("jax", "torch") if isinstance(pk.get(b), dict)]
    if pk.get("source") == "--peak-gflops":
        lines.append(f"MFU below uses --peak-gflops {pk['peak_flops_per_s'] / 1e9:.0f}")
    elif loads and max(loads) > 0.25:
        lines.append("WARNING: the peak was measured while other processes were busy: MFU is overstated "
                     "(pass --peak-gflops with a quiet-machine figure)")
    rows = [("episodes/s (steady)", "episodes_per_s", ""), ("time to 1st update", "time_to_first_update_s", " s"),
            ("setup + 1st update", "setup_and_first_update_s", " s"),
            ("episodes/CPU-second", "episodes_per_cpu_s", ""),
            ("generation tok/s", "generation_tokens_per_s", ""), ("update tok/s", "update_tokens_per_s", ""),
            ("peak RSS", "peak_rss_mb", " MB")]
    for size, e in report["sizes"].items():
        trl, pj, ratio = e["trl"], e["ppojax"], e.get("ratio_ppojax_over_trl") or {}
        thr = f" ({trl['threads']} thr)" if trl.get("available") else ""
        lines.append("")
        lines.append(f"== {size}: B={e['config']['batch_size']} P={e['config']['prompt_length']} "
                     f"R={e['config']['response_length']} epochs={e['config']['num_ppo_epochs']}, "
                     f"{e['flops']['per_episode'] / 1e9:.3g} GFLOP/episode")
        lines.append(f"{'':22}{'TRL' + thr:>16}{'ppojax':>14}{'ppojax/TRL':>12}")
        for label, k, unit in rows:
            lines.append(f"{label:22}{_fmt(trl.get(k), unit):>16}{_fmt(pj.get(k), unit):>14}"
                         f"{_fmt(ratio.get(k)):>12}")
        warm = (pj.get("warm_cache") or {}).get("time_to_first_update_s")
        if warm is not None:
            trl_first = trl.get("time_to_first_update_s")
            lines.append(f"{'  same, warm cache':22}{'':>16}{_fmt(warm, ' s'):>14}"
                         f"{_fmt(warm / trl_first if trl_first else None):>12}")
        for side in ("trl", "ppojax"):
            m = e["mfu"].get(side)
            if m:
                lines.append(f"MFU {side:7} rollout {m['rollout_mfu']:.1%}  update {m['update_mfu']:.1%}  "
                             f"overall {m['overall_mfu']:.1%}  ({m['overall_flops_per_s'] / 1e9:.0f} GFLOP/s)")
        mixed = e.get("ppojax_mixed")
        if mixed:
            mixed_ratio = e.get("ratio_ppojax_mixed_over_trl") or {}
            lines.append("ppojax, precision mixed (bfloat16 matmuls) against TRL float32, not the same precision:")
            for label, k, unit in rows:
                lines.append(f"{label:22}{'':>16}{_fmt(mixed.get(k), unit):>14}{_fmt(mixed_ratio.get(k)):>12}")
        for side, r in (("TRL", trl), ("ppojax", pj)) + ((("ppojax mixed", mixed),) if mixed else ()):
            if r.get("other_load_cores") is not None:
                lines.append(f"{side}: other processes kept {r['other_load_cores']:.2f} cores busy meanwhile")
            if not r.get("available"):
                lines.append(f"{side}: not available: {r.get('reason') or r.get('error')}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny size, few updates (< 2 minutes)")
    p.add_argument("--json", default=None, help="write the report here")
    p.add_argument("--only", choices=["trl", "ppojax"], default=None, help="run one side only (peak always)")
    p.add_argument("--sizes", default=None, help="comma-separated: tiny,smollm2 (default: both; tiny if --quick)")
    p.add_argument("--threads", default=None,
                   help="torch thread counts to try for TRL (default 1,2; with --quick just 2)")
    p.add_argument("--updates", type=int, default=None, help="PPO updates per run (default per size)")
    p.add_argument("--smollm2-dir", default=os.environ.get("PPOJAX_BENCH_SMOLLM2_DIR"),
                   help="converted SmolLM2-135M HF checkpoint dir (default: .cache/ppojax/smollm2-135m-instruct "
                        "when it exists, else random init of its config); 'random' forces random init")
    p.add_argument("--wait-quiet", type=float, default=0.0, metavar="S",
                   help="before each measurement wait up to S seconds for other processes to use < 0.25 cores")
    p.add_argument("--peak-gflops", type=float, default=None,
                   help="use this float32 peak (GFLOP/s) for MFU instead of the one measured in this run "
                        "(e.g. a quiet-machine figure when the machine is shared)")
    p.add_argument("--ppojax-behaviour-logprobs", default="sampler", choices=["sampler", "forward"],
                   help="where ppojax's behaviour log-probs come from ('sampler': the decode loop's logits, as TRL "
                        "takes them; 'forward': one more policy forward, ppojax's default)")
    p.add_argument("--ppojax-remat", default=DEFAULT_REMAT, choices=["none", "full", "dots"],
                   help="ppojax's rematerialisation of the layer scan (the same gradients; default: ppojax's, "
                        f"{DEFAULT_REMAT!r}; TRL's PPOTrainer keeps every activation)")
    p.add_argument("--ppojax-matmul", default="auto", choices=MATMUL_IMPLEMENTATIONS,
                   help="ppojax's matmul_implementation (default: ppojax's, 'auto'; 'mkl': the in-place "
                        "projections on MKL, the library TRL's torch runs)")
    p.add_argument("--ppojax-mixed", action="store_true",
                   help="also run ppojax with precision 'mixed' (bfloat16 matmuls), reported as a separate row "
                        "against TRL's float32 (back-to-back runs only)")
    p.add_argument("--ppojax-precisions", default=None, choices=["float32", "mixed", "float32,mixed"],
                   help="ppojax's precision policies to run (default float32; --ppojax-mixed = float32,mixed); "
                        "'mixed' alone runs only that row, e.g. as its own process beside another to --merge")
    p.add_argument("--merge", nargs="+", default=None, metavar="REPORT",
                   help="no run: merge these reports of ONE host (sides run as separate processes) into one, "
                        "with the ratios, and print its table (--json writes it)")
    p.add_argument("--interleave", action="store_true",
                   help="run TRL (the largest --threads count) and ppojax as two live processes whose updates "
                        "alternate, so both meet the machine's same fast and slow spells")
    p.add_argument("--_worker", help=argparse.SUPPRESS)
    p.add_argument("--_config", help=argparse.SUPPRESS)
    p.add_argument("--_out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args._worker:
        return _worker(args._config, args._out)
    if args.merge:
        report = merge_reports([_read_report(f) for f in args.merge])
        print(table(report))
        if args.json:
            write_text_atomic(args.json, json.dumps(report, indent=1))
            print(f"wrote {args.json}")
        return 0
    args.ppojax_precisions = (args.ppojax_precisions or ("float32,mixed" if args.ppojax_mixed else "float32")
                              ).split(",")
    if args.ppojax_matmul in IN_PLACE_MATMULS and "mixed" in args.ppojax_precisions:
        p.error(f"--ppojax-matmul {args.ppojax_matmul} multiplies float32 models only, and the mixed row runs "
                "bfloat16 matmuls: run the mixed row without it (a separate --ppojax-precisions mixed process)")
    if args.smollm2_dir is None:
        args.smollm2_dir = default_smollm2_dir()
    elif args.smollm2_dir == "random":
        args.smollm2_dir = None
    WAIT_QUIET["max_s"] = args.wait_quiet
    args.threads = [int(t) for t in (args.threads or ("2" if args.quick else "1,2")).split(",")]
    sizes = (args.sizes or ("tiny" if args.quick else "tiny,smollm2")).split(",")

    if args.json:  # before any measurement: a report that cannot be written is refused now, not after an hour
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    report = {"schema": SCHEMA, "quick": args.quick, "machine": machine_info(), "versions": _versions(),
              "commit": source_commit(),
              "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "complete": False, "sizes": {}}

    def save() -> None:  # after every side: a run cut off (a time limit, a kill) keeps what it measured
        if args.json:
            write_text_atomic(args.json, json.dumps(report, indent=1))

    with tempfile.TemporaryDirectory(prefix="ppojax-bench-") as d:
        tmp = Path(d)
        print("[peak] ...", file=sys.stderr, flush=True)
        report["peak"] = run_peak(tmp, args.quick)
        peak = report["peak"]["peak_flops_per_s"]
        if args.peak_gflops:
            report["peak"]["measured_peak_flops_per_s"] = peak
            peak = report["peak"]["peak_flops_per_s"] = args.peak_gflops * 1e9
            report["peak"]["source"] = "--peak-gflops"
        save()
        for size in sizes:
            run_size(size, args, tmp, peak, report["sizes"].setdefault(size, {}), save)
    report["machine"]["loadavg_1m_end"] = os.getloadavg()[0]
    report["wall_s"] = time.perf_counter() - t0
    report["complete"] = True
    print(table(report))
    print(f"\n(wall {report['wall_s']:.0f} s; load average {report['machine']['loadavg_1m']:.2f} → "
          f"{report['machine']['loadavg_1m_end']:.2f})")
    if args.json:
        save()
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
