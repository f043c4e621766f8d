"""One probe decides every CPU-specific path (ppojax/backends/cpu/capabilities.py): the three kinds of host ppojax has
met, simulated by mocking the probe, and the PPOJAX_CPU_ISA cap that makes an AVX-512 host run as an AVX2 one."""
from pathlib import Path

import pytest

from ppojax.backends.cpu import adam_in_place
from ppojax.backends.cpu import xla_options as xla_cpu_options
from ppojax.backends.cpu import capabilities
from ppojax.backends.cpu.capabilities import parse_cpuinfo
from ppojax.errors import ConfigError
from ppojax.backends.cpu import stacked_matmul

# /proc/cpuinfo as each kind of host shows it (the first processor; flags abridged to those of interest + baseline)
BASELINE = "fpu sse sse2 ssse3 sse4_1 sse4_2 popcnt avx f16c bmi1 bmi2 hypervisor"
ZEN3 = f"""processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 25
model\t\t: 1
model name\t: AMD EPYC 7B13
flags\t\t: {BASELINE} avx2 fma
"""
ZEN4 = f"""processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 25
model\t\t: 17
model name\t: AMD EPYC 9B14
flags\t\t: {BASELINE} avx2 fma avx512f avx512dq avx512cd avx512bw avx512vl avx512ifma avx512vbmi avx512_vbmi2 \
avx512_vnni avx512_bitalg avx512_vpopcntdq avx512_bf16
"""
INTEL_AMX = f"""processor\t: 0
vendor_id\t: GenuineIntel
cpu family\t: 6
model\t\t: 143
model name\t: Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz
flags\t\t: {BASELINE} avx2 fma avx512f avx512dq avx512cd avx512bw avx512vl avx512ifma avx512vbmi avx512_vbmi2 \
avx512_vnni avx512_bitalg avx512_vpopcntdq avx_vnni avx512_bf16 avx512_fp16 amx_bf16 amx_tile amx_int8
"""
HOSTS = {"zen3": ZEN3, "zen4": ZEN4, "intel_amx": INTEL_AMX}

# What each path is expected to pick on each host, written out by hand from the hosts' instruction sets.
EXPECTED = {
    "zen3": {"xla_float32": ["default", "ynn_dot", "no_xnnpack", "concurrent", "onednn_dot"],
             "xla_bf16": ["default", "ynn_dot", "no_xnnpack", "concurrent"],
             "defines": ("-DPPOJAX_MAX_ISA_AVX2",)},
    "zen4": {"xla_float32": ["default", "ynn_dot", "no_xnnpack", "concurrent", "vector_512", "onednn_dot"],
             "xla_bf16": ["default", "ynn_dot", "no_xnnpack", "concurrent", "vector_512", "onednn_dot"],
             "defines": ()},
    "intel_amx": {"xla_float32": ["default", "ynn_dot", "no_xnnpack", "concurrent", "vector_512", "onednn_dot"],
                  "xla_bf16": ["default", "ynn_dot", "no_xnnpack", "concurrent", "vector_512", "onednn_dot"],
                  "defines": ()},
}


@pytest.fixture
def host(request, monkeypatch):
    """Mock the probe as the named host; every CPU-specific path asks `capabilities.probe()`."""
    cpu = parse_cpuinfo(HOSTS[request.param])
    monkeypatch.setattr(capabilities, "probe", lambda: cpu)
    monkeypatch.setattr(capabilities, "backend_off", lambda: "")  # the fast lane turns it off; the host has it
    return request.param, cpu


def _build_flags(monkeypatch, built):
    """The compiler flags `built` (a cached `_built`, run uncached) passes to `build_cached`: no compiler runs."""
    seen = []
    module = built.__module__
    import sys

    monkeypatch.setattr(sys.modules[module], "build_cached", lambda *args, flags=(), **kw: seen.append(
        tuple(args[3]) if len(args) > 3 else tuple(flags)) or (None, "not built in this test"))
    built.__wrapped__(*(("onednn",) if module.endswith("stacked_matmul") else ()))
    return seen[0]


@pytest.mark.parametrize("host", list(HOSTS), indirect=True)
def test_each_host_gets_the_paths_its_instruction_sets_allow(host, monkeypatch):
    name, cpu = host
    want = EXPECTED[name]
    # XLA:CPU option sets worth timing, per kind of matmul
    assert [s.name for s in xla_cpu_options.candidates(xla_cpu_options.this_cpu(), "float32")] == want["xla_float32"]
    assert [s.name for s in xla_cpu_options.candidates(xla_cpu_options.this_cpu(), "bf16")] == want["xla_bf16"]
    # the C++ handlers (in-place GEMMs' few-rows kernels, the Adam step's clones) are built within the CPU's sets
    assert capabilities.build_defines() == want["defines"]
    monkeypatch.setattr(stacked_matmul, "_library_file", lambda library: (stacked_matmul.Path("/lib.so"), ""))
    assert _build_flags(monkeypatch, stacked_matmul._built) == stacked_matmul.LIBRARIES["onednn"] + want["defines"]
    assert _build_flags(monkeypatch, adam_in_place._built) == adam_in_place.FLAGS + want["defines"]


def test_the_cap_removes_what_lies_above_its_level(tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(INTEL_AMX)
    full = capabilities.read_cpu({}, cpuinfo)
    assert full.cap == "" and {"avx512f", "avx512_bf16", "amx_tile", "avx_vnni"} <= full.flags
    avx2 = capabilities.read_cpu({"PPOJAX_CPU_ISA": "AVX2"}, cpuinfo)
    # as Zen 3: nothing of AVX-512, its BF16, AVX-VNNI or AMX; the baseline and AVX2/FMA kept
    assert avx2.cap == "avx2" and avx2.flags == parse_cpuinfo(ZEN3).flags
    assert avx2.signature == "Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz [avx2 fma]"
    avx512 = capabilities.read_cpu({"PPOJAX_CPU_ISA": "avx512"}, cpuinfo)
    assert "avx512f" in avx512.flags and not {"avx512_bf16", "avx512_fp16", "amx_tile"} & avx512.flags
    bf16 = capabilities.read_cpu({"PPOJAX_CPU_ISA": "avx512_bf16"}, cpuinfo)
    assert "avx512_bf16" in bf16.flags and not any(f.startswith("amx") for f in bf16.flags)
    # a cap never adds what the CPU lacks
    cpuinfo.write_text(ZEN3)
    assert capabilities.read_cpu({"PPOJAX_CPU_ISA": "avx512_bf16"}, cpuinfo).flags == parse_cpuinfo(ZEN3).flags
    # the message of a capped CPU says so
    assert "capped by PPOJAX_CPU_ISA=avx2" in avx2.lacks("onednn_bf16", "x", "y")
    with pytest.raises(ConfigError, match="PPOJAX_CPU_ISA='avx3' is not a level: use one of avx2, avx512"):
        capabilities.read_cpu({"PPOJAX_CPU_ISA": "avx3"}, cpuinfo)


def test_a_bad_cap_is_one_line_from_the_ppojax_command(tmp_path):
    """`PPOJAX_CPU_ISA=avx3 ppojax train ...`: exit 2, one line naming the value and the levels, before anything
    is loaded."""
    import os
    import subprocess
    import sys

    code = "import sys; from ppojax.trainer.cli import main; sys.argv = ['ppojax'] + sys.argv[1:]; sys.exit(main())"
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    done = subprocess.run([sys.executable, "-c", code, "train", "configs/tiny.yaml", f"output_dir={tmp_path / 'run'}"],
                          env=dict(env, PPOJAX_CPU_ISA="avx3", JAX_PLATFORMS="cpu"), capture_output=True, text=True,
                          timeout=300, cwd=Path(__file__).resolve().parents[1])
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.splitlines() == [
        "ppojax: error: PPOJAX_CPU_ISA='avx3' is not a level: use one of avx2, avx512, avx512_bf16 (or unset it to "
        "use every instruction set this CPU has)"]
    assert not (tmp_path / "run").exists()


def test_the_cap_reaches_the_libraries_and_leaves_the_users_settings():
    env = {"PPOJAX_CPU_ISA": "avx2", "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
           "MKL_ENABLE_INSTRUCTIONS": "SSE4_2"}
    assert capabilities.apply_cap(env) == "avx2"
    assert env["XLA_FLAGS"] == "--xla_force_host_platform_device_count=2 --xla_cpu_max_isa=AVX2"
    assert env["ONEDNN_MAX_CPU_ISA"] == "AVX2" and env["ATEN_CPU_CAPABILITY"] == "avx2"
    assert env["MKL_ENABLE_INSTRUCTIONS"] == "SSE4_2"  # the user's own
    assert capabilities.apply_cap(env) == "avx2" and env["XLA_FLAGS"].count("--xla_cpu_max_isa") == 1
    untouched = {"XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    assert capabilities.apply_cap(untouched) == "" and untouched == {
        "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    # the XLA options' start-up step applies it too (the one place XLA_FLAGS are chosen)
    started = {"PPOJAX_CPU_ISA": "avx2", "XDG_CACHE_HOME": "/nonexistent"}
    xla_cpu_options.apply(started, announce=False)
    assert started["XLA_FLAGS"] == "--xla_cpu_max_isa=AVX2"


def test_xla_honours_the_cap_in_a_fresh_process():
    """XLA:CPU started under PPOJAX_CPU_ISA=avx2 compiles and runs (its code generation capped at AVX2), and the
    probe in that process reports no AVX-512."""
    import os
    import subprocess
    import sys

    code = ("from ppojax.backends.cpu.capabilities import apply_cap, probe; apply_cap(); import jax, jax.numpy as jnp;"
            "print(float(jax.jit(lambda x: (x @ x.T).sum())(jnp.ones((33, 17)))), "
            "sorted(f for f in probe().flags if f.startswith('avx512')), probe().cap)")
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    done = subprocess.run([sys.executable, "-c", code], env=dict(env, PPOJAX_CPU_ISA="avx2", JAX_PLATFORMS="cpu"),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["18513.0", "[]", "avx2"]
