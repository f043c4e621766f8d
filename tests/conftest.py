import atexit
import gc
import importlib.util
import os
import shutil
import subprocess
import tempfile
from collections import Counter
from pathlib import Path

import pytest

from ppojax.backends.cpu.absent_tpu import skip_absent_tpu
from ppojax.backends.cpu.capabilities import apply_cap
from tests.lowering_contexts import share_lowering_contexts
from tests.xla_test_flags import switched_on, use_cheap_compiles

# PPOJAX_CPU_ISA=avx2 runs the suite as an AVX2-only host would: the probe and the libraries (XLA, oneDNN, MKL,
# torch) capped before any of them starts; subprocesses inherit the environment.
apply_cap()
# libtpu installed (the tpu extra, tests/test_tpu_compile.py) on a host without TPU chips: every test process would
# load it and take its machine-wide lock file; the suite runs on the CPU (subprocesses inherit the variable).
skip_absent_tpu()

# The fast lane for development (`make test-fast`, PPOJAX_TESTS_FAST=1): the pure-XLA / optax path that
# accelerator users run (ppojax's CPU backend off and its test files left out: no C++ is built), the unit tests
# only (no test marked slow, no whole-run file: END_TO_END_TESTS), and a test that starts a subprocess (the multi-device
# and multi-process suites) is skipped where it starts one. `make test` runs everything.
FAST_LANE = switched_on("PPOJAX_TESTS_FAST")
if FAST_LANE:
    os.environ.setdefault("PPOJAX_CPU_BACKEND", "0")
use_cheap_compiles()  # before jax starts its backend: the suite's compiles without LLVM's optimisation
share_lowering_contexts()  # each thread lowers its programs into one MLIR context, not a new one per program
# Tracing and lowering JAX programs, most of a test's time after XLA's compile, allocates millions of short-lived
# objects; at Python's default thresholds (a young collection every 700 allocations) the cyclic collector runs
# thousands of times per test file, each full pass over a heap that holds every module and compiled program. The
# suite's processes collect far less often (their memory is small beside the host's); a user's run keeps Python's
# defaults (arrays held by garbage cycles would hold accelerator memory longer).
gc.set_threshold(50_000, 20, 20)
if importlib.util.find_spec("torch") is not None:  # the tests that compare against torch import it themselves
    import torch

    torch.set_num_threads(1)


def _session_directory(variable: str, prefix: str) -> str:
    """``os.environ[variable]``: unless already set, a new temporary directory that this process removes at exit
    (xdist workers and subprocesses inherit the variable)."""
    if variable not in os.environ:
        os.environ[variable] = tempfile.mkdtemp(prefix=prefix)
        atexit.register(shutil.rmtree, os.environ[variable], ignore_errors=True)
    return os.environ[variable]


# PPOTrainer turns on JAX's persistent compilation cache ('auto'); keep the tests' entries out of the
# user's ~/.cache, in one directory per test session (xdist workers and subprocesses, e.g. the CLI tests,
# inherit it).
_session_directory("JAX_COMPILATION_CACHE_DIR", "ppojax-tests-xla-")
# The processes the suite starts (xdist's workers, the runs) store every program, not only those that compile in over
# a second (JAX's default): with cheap compiles most take less, and the runs compile the same programs again and again.
# (This process imported jax above: it keeps JAX's defaults, and a run without xdist no persistent cache of its own.)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
# The same for ppojax's per-machine records and builds under $XDG_CACHE_HOME/ppojax (the GEMM handlers, the matmul
# library "auto" measured, recorded XLA:CPU options): the suite neither reads the user's nor leaves its own.
os.environ["XDG_CACHE_HOME"] = _session_directory("PPOJAX_TESTS_CACHE_HOME", "ppojax-tests-cache-")
# And the temporary files of the processes the suite starts, which a killed run cannot remove (wandb's media and
# tables of the runs the logging tests SIGKILL): one directory per session, removed with it. This process keeps the
# system's temporary directory, chosen first, so pytest's tmp_path stays where it was.
tempfile.gettempdir()
os.environ["TMPDIR"] = _session_directory("PPOJAX_TESTS_TMPDIR", "ppojax-tests-tmp-")
os.environ.setdefault("TPU_LOG_DIR", os.path.join(os.environ["TMPDIR"], "tpu_logs"))  # libtpu's, else /tmp/tpu_logs


#: the test files of ppojax's CPU backend (and of the benchmarks, which measure what a CPU user runs): there a run
#: built in the test process chooses the CPU's kernels and optimizer step as on a CPU user's machine. Everywhere
#: else it takes the models' default kernels and optax's step, the pure-XLA path that accelerator users run. (A
#: subprocess, e.g. the CLI tests' `ppojax train`, chooses as a user's process does.)
CPU_BACKEND_TESTS = {"test_stacked_matmul", "test_adam_in_place", "test_cpu_capabilities", "test_cpu_kernels",
                     "test_slot_storage", "test_xla_cpu_options", "test_host_memory", "test_benchmarks"}


@pytest.fixture(autouse=True, scope="module")
def _pure_xla_outside_the_cpu_backend_tests(request):
    if Path(str(request.fspath)).stem in CPU_BACKEND_TESTS:
        yield
        return
    from ppojax import backends

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(backends, "_cpu_backend_on", lambda devices: False)
        yield


@pytest.fixture(autouse=True)
def _fast_lane_starts_no_subprocess(monkeypatch):
    if FAST_LANE:
        def skip(*args, **kwargs):
            pytest.skip("fast lane: this test starts a subprocess (make test runs it)")

        monkeypatch.setattr(subprocess.Popen, "__init__", skip)
    yield


#: whole-run files (a run's directory, resume, signals, logging, the CLI, every estimator, LoRA, the benchmarks, the
#: notebook): `make test` runs them; the fast lane keeps the unit tests of every layer (math, models, sampler,
#: rollout, update, one train_step, sharding, config, checkpoints)
END_TO_END_TESTS = {"test_trust", "test_reliability", "test_trainer", "test_cli", "test_estimator_runs", "test_lora",
                    "test_compile_ahead", "test_benchmarks", "test_quiet_runs", "test_logging", "test_notebook",
                    "test_export_dir", "test_multihost", "test_smollm2_export", "test_assets", "test_plan"}


#: the files that take longest (their tests' times summed; `make test` lists the slowest tests), slowest first. `make
#: test` hands whole files to its two workers in the order of the collection (--no-loadscope-reorder): a long file
#: started last would leave one worker running it alone at the end, so these start first and the many short files
#: fill in after them (by number of tests, as pytest-xdist orders by default).
SLOWEST_FILES = ("test_pipeline", "test_sharding", "test_trust", "test_train_step", "test_stacked_matmul",
                 "test_in_flight_updates", "test_trainer", "test_packing", "test_reliability", "test_docs",
                 "test_multihost", "test_agent_runs", "test_update", "test_tpu_compile", "test_dynamic_sampling",
                 "test_quiet_runs", "test_plan", "test_continuous_sampler", "test_benchmarks", "test_logging",
                 "test_generate")


def _file_order(items) -> dict:
    """Each test file's place in the run: SLOWEST_FILES first, then the rest by number of tests (most first)."""
    counts = Counter(Path(str(item.fspath)).stem for item in items)
    rest = sorted((stem for stem in counts if stem not in SLOWEST_FILES), key=lambda stem: (-counts[stem], stem))
    return {stem: i for i, stem in enumerate([s for s in SLOWEST_FILES if s in counts] + rest)}


def pytest_collection_modifyitems(config, items):
    if FAST_LANE:
        items[:] = [item for item in items if item.get_closest_marker("slow") is None
                    and Path(str(item.fspath)).stem not in END_TO_END_TESTS | CPU_BACKEND_TESTS]
    order = _file_order(items)
    items.sort(key=lambda item: order[Path(str(item.fspath)).stem])  # stable: a file's tests keep their order


def pytest_configure(config):
    """`make test-profile`: each process that runs the suite's tests records where its time goes
    (tests/suite_profile.py); neither an xdist controller (it would record its workers' tests a second time) nor a
    pytest run that a recording test starts (its time is that test's)."""
    directory = os.environ.get("PPOJAX_SUITE_PROFILE")
    if directory and not os.environ.get("PPOJAX_SUITE_PROFILE_RECORDING") and \
            (hasattr(config, "workerinput") or not getattr(config.option, "numprocesses", None)):
        from tests.suite_profile import SuiteProfile  # imports jax: after this file set the environment it reads

        config.pluginmanager.register(SuiteProfile(Path(directory)), "ppojax_suite_profile")
