"""Where the suite's time goes, per test and per file: ``make test-profile`` (``PPOJAX_SUITE_PROFILE=DIR``).

A pytest plugin (``tests/conftest.py`` registers it when the variable names a directory) that records, for each
test in each test process: its wall time, the process's CPU time during it, the CPU time of the subprocesses it
started and waited for (``ppojax train`` runs, the multi-device and multi-process suites), and what JAX spent in
that process tracing, lowering and compiling its programs (how many compiles, how many the persistent compilation
cache answered). Each process appends one JSON line per test to ``DIR/<worker>-<pid>.jsonl``. A pytest run that a
test starts (the multi-device suite) records nothing itself: its CPU time is its test's subprocess time.

    python -m tests.suite_profile DIR [--top N] [--tests]

prints the files (or the tests) by CPU time, the totals, and the host's CPU. A subprocess's own split into
compiling and the rest is not seen (only its CPU time), nor are its children that outlive the test.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import time
from collections import defaultdict
from pathlib import Path

from jax import monitoring

SWITCH = "PPOJAX_SUITE_PROFILE"
RECORDING = "PPOJAX_SUITE_PROFILE_RECORDING"  # set in a recording process: the test processes it starts inherit it
#: jax.monitoring's events, by the name a record keeps them under
DURATIONS = {"/jax/core/compile/jaxpr_trace_duration": "trace_s",
             "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower_s",
             "/jax/core/compile/backend_compile_duration": "compile_s"}
COUNTS = {"/jax/core/compile/backend_compile_duration": "compiles"}
EVENTS = {"/jax/compilation_cache/cache_hits": "cache_hits"}
FIELDS = ("cpu_s", "children_s", "wall_s", "compile_s", "compiles", "cache_hits", "trace_s", "lower_s")


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


class SuiteProfile:
    """The plugin: one record per test, appended to ``directory/<worker>-<pid>.jsonl`` when the test ends."""

    def __init__(self, directory: Path):
        os.environ[RECORDING] = "1"
        worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        directory.mkdir(parents=True, exist_ok=True)
        self.path = directory / f"{worker}-{os.getpid()}.jsonl"
        self.current = None  # the running test's record; JAX's events outside a test are not counted
        self.started = (0.0, 0.0, 0.0)  # the running test's start: wall clock, process CPU, subprocesses' CPU
        monitoring.register_event_duration_secs_listener(self._duration)
        monitoring.register_event_listener(self._event)

    def _duration(self, event: str, seconds: float, **_) -> None:
        if self.current is not None and event in DURATIONS:
            self.current[DURATIONS[event]] += seconds
            if event in COUNTS:
                self.current[COUNTS[event]] += 1

    def _event(self, event: str, **_) -> None:
        if self.current is not None and event in EVENTS:
            self.current[EVENTS[event]] += 1

    def pytest_runtest_logstart(self, nodeid, location):
        self.current = defaultdict(float, test=nodeid)
        self.started = (time.perf_counter(), time.process_time(), _children_cpu())

    def pytest_runtest_logfinish(self, nodeid, location):
        record, self.current = self.current, None
        if record is None:
            return
        wall, cpu, children = self.started
        record.update(wall_s=time.perf_counter() - wall, cpu_s=time.process_time() - cpu,
                      children_s=_children_cpu() - children)
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")


def read(directory: Path) -> list[dict]:
    """Every test's record in ``directory`` (all processes)."""
    return [json.loads(line) for path in sorted(directory.glob("*.jsonl")) for line in path.read_text().splitlines()]


def totals(records: list[dict], key) -> dict[str, dict]:
    """The records summed per ``key(test id)``: {key: {field: sum}}."""
    sums = defaultdict(lambda: dict.fromkeys(FIELDS, 0.0))
    for record in records:
        row = sums[key(record["test"])]
        for field in FIELDS:
            row[field] += record.get(field, 0.0)
    return dict(sums)


def table(sums: dict[str, dict], top: int) -> str:
    """The rows by CPU time (the test processes' and their subprocesses'), the largest first, and their total."""
    def cpu(row):
        return row["cpu_s"] + row["children_s"]

    head = f"{'cpu s':>8} {'subproc':>8} {'wall s':>8} {'compile':>8} {'n':>6} {'hits':>6} {'trace':>7} {'lower':>7}"
    rows = sorted(sums.items(), key=lambda item: -cpu(item[1]))
    total = {field: sum(row[field] for row in sums.values()) for field in FIELDS}
    lines = [head] + [f"{cpu(row):8.1f} {row['children_s']:8.1f} {row['wall_s']:8.1f} {row['compile_s']:8.1f} "
                      f"{int(row['compiles']):6d} {int(row['cache_hits']):6d} {row['trace_s']:7.1f} "
                      f"{row['lower_s']:7.1f}  {name}" for name, row in rows[:top] + [("total", total)]]
    return "\n".join(lines)


def main(argv=None) -> None:
    from benchmarks.common import machine_info  # noqa: PLC0415 - only the report names the host

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("directory", type=Path)
    parser.add_argument("--top", type=int, default=30, help="rows to print (default 30)")
    parser.add_argument("--tests", action="store_true", help="one row per test instead of per file")
    args = parser.parse_args(argv)
    records = read(args.directory)
    if not records:
        raise SystemExit(f"{args.directory}: no records; run `make test-profile` (or set {SWITCH}) first")
    key = (lambda test: test) if args.tests else (lambda test: test.split("::")[0])
    machine = machine_info()
    print(f"{machine['cpu_model']} ({machine['cores']} cores; {', '.join(machine['simd'])}): {len(records)} tests")
    print(table(totals(records, key), args.top))


if __name__ == "__main__":
    main()
