"""``make test-profile`` (tests/suite_profile.py) records what each test cost: a pytest run of three tests with the
suite's conftest and the recording on, against what the tests did (the programs they compiled, the CPU time their
subprocesses spent; a pytest run one of them starts is its subprocess, not tests of its own)."""
import os
import subprocess
import sys

from tests import suite_profile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SAMPLE = '''
import subprocess, sys
import jax
import numpy as np


def test_two_shapes():
    double = jax.jit(lambda x: x * 2)
    for n in (3, 4, 3):  # two programs: the third call runs the first again
        double(np.ones(n, np.float32))


def test_a_subprocess():
    busy = "import time\\nt = time.process_time()\\nwhile time.process_time() - t < 0.5: pass"
    subprocess.run([sys.executable, "-c", busy], check=True)


def test_a_pytest_run():
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "tests.conftest",
                    "inner.py"], check=True)
'''


def test_each_test_is_recorded_with_its_compiles_and_its_subprocesses_cpu(tmp_path, capsys):
    (tmp_path / "test_sample.py").write_text(SAMPLE)
    (tmp_path / "inner.py").write_text("def test_inner():\n    pass\n")
    records = tmp_path / "profile"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "PPOJAX_TESTS_", suite_profile.SWITCH))}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "tests.conftest",
                           "test_sample.py"], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env=dict(env, PYTHONPATH=REPO, PPOJAX_SUITE_PROFILE=str(records)))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    by_test = {record["test"]: record for record in suite_profile.read(records)}
    assert sorted(by_test) == ["test_sample.py::test_a_pytest_run", "test_sample.py::test_a_subprocess",
                               "test_sample.py::test_two_shapes"]  # none of the inner run's
    shapes, child = by_test["test_sample.py::test_two_shapes"], by_test["test_sample.py::test_a_subprocess"]
    assert shapes["compiles"] == 2 and shapes["compile_s"] > 0 and shapes["trace_s"] > 0 and shapes["lower_s"] > 0
    assert shapes["children_s"] == 0
    assert child["children_s"] >= 0.45 and child["cpu_s"] < 0.25 and child.get("compiles", 0) == 0
    assert child["wall_s"] >= 0.45
    assert by_test["test_sample.py::test_a_pytest_run"]["children_s"] > 0.5  # a Python start, pytest, the conftest

    suite_profile.main([str(records), "--tests"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].endswith(": 3 tests")
    rows = {line.split()[-1]: line.split() for line in lines[2:]}
    assert set(rows) == set(by_test) | {"total"}
    assert float(rows["total"][0]) >= float(rows["test_sample.py::test_a_subprocess"][0]) >= 0.45
    assert int(rows["total"][4]) == 2  # the compiles, summed
    cpu = [float(line.split()[0]) for line in lines[2:-1]]
    assert cpu == sorted(cpu, reverse=True)  # the most CPU first
