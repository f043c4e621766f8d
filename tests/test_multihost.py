"""Two processes on 127.0.0.1 with ``jax.distributed`` (2 CPU devices each) run the same PPO updates as one
process on one device, and agree within 1e-5; so does an asynchronous run (``max_staleness`` 1: sampling,
scoring and learning in one program across both processes, the batch in flight included), also with in-flight
weight updates (the part-decoded batch and its KV cache in flight).

Each worker (``tests/sharding_helpers.py worker``) starts ``jax.distributed`` from ``PPOJAX_COORDINATOR`` /
``PPOJAX_NUM_PROCESSES`` / ``PPOJAX_PROCESS_ID``, builds the mesh (data=1, fsdp=2, tensor=2) over the 4
devices of both processes, loads only its own rows of the experience (``process_local_rows`` +
``host_local_batch_to_global``) and runs the sharded update; process 0 writes the metrics and the gathered
parameters. The single-process reference runs alongside (``sharding_helpers.py single``). Every
subprocess runs under a timeout and is killed in a ``finally`` block.
"""
import os
import socket
import subprocess
import sys

import numpy as np

from tests.sharding_helpers import B
from tests.xla_test_flags import CHEAP_COMPILES

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HELPER = os.path.join(REPO, "tests", "sharding_helpers.py")
TIMEOUT_S = 420


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_match_a_single_process_run(tmp_path):
    port = free_port()
    base = dict(os.environ, JAX_PLATFORMS="cpu")
    flags = base.get("XLA_FLAGS", "")
    runs = {  # name: (argv, extra environment)
        "single": (["single", str(tmp_path / "single.npz")], {"XLA_FLAGS": f"{flags} {CHEAP_COMPILES}"}),
    }
    for process_id in range(2):
        runs[f"worker{process_id}"] = (["worker", str(tmp_path / "distributed.npz")], {
            "PPOJAX_COORDINATOR": f"127.0.0.1:{port}", "PPOJAX_NUM_PROCESSES": "2",
            "PPOJAX_PROCESS_ID": str(process_id),
            "XLA_FLAGS": f"{flags} --xla_force_host_platform_device_count=2 {CHEAP_COMPILES}"})
    procs, logs = {}, {}
    try:
        for name, (argv, extra) in runs.items():
            logs[name] = open(tmp_path / f"{name}.log", "w+")
            procs[name] = subprocess.Popen([sys.executable, HELPER, *argv], cwd=REPO, env={**base, **extra},
                                           stdout=logs[name], stderr=subprocess.STDOUT)
        for proc in procs.values():
            proc.wait(timeout=TIMEOUT_S)
        failed = {name: proc.returncode for name, proc in procs.items() if proc.returncode != 0}
        if failed:
            report = []
            for name, code in failed.items():
                logs[name].seek(0)
                report.append(f"{name} exited {code}:\n{logs[name].read()[-3000:]}")
            raise AssertionError("\n\n".join(report))
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for log in logs.values():
            log.close()

    with np.load(tmp_path / "distributed.npz") as got, np.load(tmp_path / "single.npz") as expected:
        np.testing.assert_array_equal(got["rows"], np.arange(B // 2))  # process 0 held the first half
        np.testing.assert_allclose(got["metrics"], expected["metrics"], atol=1e-5, rtol=1e-5)
        params = [name for name in expected.files if name.startswith("param")]
        assert len(params) > 10 and set(params) <= set(got.files)
        for name in params:
            np.testing.assert_allclose(got[name], expected[name], atol=1e-5, rtol=1e-5, err_msg=name)
        # the asynchronous runs (max_staleness 1, one program): sampled, scored and learned across both processes;
        # with in-flight weight updates the part-decoded batch (its KV cache included) is split over both
        for prefix in ("async", "swap"):
            np.testing.assert_allclose(got[f"{prefix}_metrics"], expected[f"{prefix}_metrics"], atol=1e-5,
                                       rtol=1e-5, err_msg=prefix)
            state = [name for name in expected.files if name.startswith(f"{prefix}param")]
            assert any("in_flight" in name for name in state) and set(state) <= set(got.files)
            for name in state:
                if np.issubdtype(expected[name].dtype, np.integer):  # the tokens and versions in flight
                    np.testing.assert_array_equal(got[name], expected[name], err_msg=name)
                else:
                    np.testing.assert_allclose(got[name], expected[name], atol=1e-4, rtol=1e-4, err_msg=name)
        assert any("keys" in name for name in expected.files if name.startswith("swapparam"))
