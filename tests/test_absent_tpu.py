"""libtpu installed on a host without TPU chips (ppojax/backends/cpu/absent_tpu.py): JAX is told to start the CPU
only, and only there."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ppojax.backends.cpu import absent_tpu, capabilities

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def cpu_host(monkeypatch, tmp_path):
    monkeypatch.setattr(capabilities, "ACCELERATOR_DEVICE_FILES", (str(tmp_path / "accel[0-9]*"),))
    monkeypatch.setattr(absent_tpu, "tpu_plugin_installed", lambda: True)
    return tmp_path


def test_the_cpu_is_named_only_where_libtpu_is_installed_and_no_accelerator_is_attached(cpu_host, monkeypatch):
    environ = {}
    assert absent_tpu.skip_absent_tpu(environ) and environ == {"JAX_PLATFORMS": "cpu"}
    for chosen in ("tpu", "cuda", "cpu"):  # the user's choice stands
        environ = {"JAX_PLATFORMS": chosen}
        assert not absent_tpu.skip_absent_tpu(environ) and environ == {"JAX_PLATFORMS": chosen}
    (cpu_host / "accel0").touch()  # a TPU VM: JAX starts the chips
    environ = {}
    assert not absent_tpu.skip_absent_tpu(environ) and environ == {}
    (cpu_host / "accel0").unlink()
    monkeypatch.setattr(absent_tpu, "tpu_plugin_installed", lambda: False)  # nothing to skip: leave JAX's default
    environ = {}
    assert not absent_tpu.skip_absent_tpu(environ) and environ == {}


@pytest.mark.skipif(not absent_tpu.tpu_plugin_installed(), reason="libtpu is not installed (pip install 'ppojax[tpu]')")
def test_a_cpu_process_does_not_load_libtpu():
    """The suite's own processes (tests/conftest.py) and the ppojax command run JAX without libtpu mapped in."""
    if capabilities.accelerator_host():
        pytest.skip(f"an accelerator host: {capabilities.accelerator_host()}")
    code = ("from ppojax.backends.cpu.absent_tpu import skip_absent_tpu\n"
            "import jax\n"
            "skip_absent_tpu()\n"
            "jax.numpy.ones(2).block_until_ready()\n"
            "print(jax.default_backend(), any('libtpu' in line for line in open('/proc/self/maps')))\n")
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120,
                          env={**env, "PYTHONPATH": str(REPO)})
    assert done.stdout.split() == ["cpu", "False"], done.stderr[-2000:]


@pytest.mark.skipif(not absent_tpu.tpu_plugin_installed(), reason="libtpu is not installed (pip install 'ppojax[tpu]')")
@pytest.mark.parametrize("imports", ["import ppojax\nimport jax", "import jax\nimport ppojax",
                                     "from ppojax.models import CausalLM\nimport jax"])
def test_a_script_importing_ppojax_prints_nothing_from_libtpu(imports):
    """A user's script in the project's venv (the tpu extra installed) on a host without TPU chips: importing
    ppojax (before or after jax, as long as no JAX operation ran first) keeps JAX off libtpu, so the first
    operation prints nothing: no TPU_WORKER_HOSTNAMES or InitGoogle lines, no warning at all."""
    if capabilities.accelerator_host():
        pytest.skip(f"an accelerator host: {capabilities.accelerator_host()}")
    code = (f"{imports}\n"
            "print(jax.default_backend(), float(jax.numpy.ones(3).sum()),\n"
            "      any('libtpu' in line for line in open('/proc/self/maps')))\n")
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "TPU_SKIP_MDS_QUERY")}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120,
                          env={**env, "PYTHONPATH": str(REPO)})
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["cpu", "3.0", "False"], done.stdout
    assert done.stderr == "", done.stderr[-2000:]
