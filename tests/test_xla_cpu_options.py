"""The run-time choice of XLA:CPU options follows the CPU's features (ppojax/backends/cpu/xla_options.py), with mocked
/proc/cpuinfo texts for three kinds of host; and the measurement's --record rule (xla_options_tuning.py)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ppojax.backends.cpu import xla_options as xo
from ppojax.backends.cpu import capabilities
from ppojax.backends.cpu.xla_options_tuning import RECORD_MARGIN, choose

REPO = Path(__file__).resolve().parents[1]

SAPPHIRE_RAPIDS = """processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz
flags\t\t: fpu sse2 avx avx2 fma avx512f avx512dq avx512bw avx512vl avx512_vnni avx512_bf16 avx512_fp16 \
amx_bf16 amx_tile amx_int8 hypervisor
"""
ZEN3 = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC 7B13
flags\t\t: fpu sse2 avx avx2 fma hypervisor
processor\t: 1
model name\t: AMD EPYC 7B13
flags\t\t: fpu sse2 avx avx2 fma hypervisor
"""
NEOVERSE = """processor\t: 0
BogoMIPS\t: 2100.00
Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid sve bf16
CPU implementer\t: 0x41
CPU part\t: 0xd40
"""


def _with_cap(flags: str) -> str:
    """``flags`` as the `ppojax` command sets them in this environment: after PPOJAX_CPU_ISA's cap, if set."""
    level = capabilities.cap_level()
    cap = capabilities.library_environment(level)["XLA_FLAGS"] if level else ""
    return " ".join(f for f in (cap, flags) if f)


def names(cpu):
    return [s.name for s in xo.candidates(cpu)]


def test_candidates_follow_the_instruction_sets():
    intel, amd, arm = (xo.parse_cpuinfo(t) for t in (SAPPHIRE_RAPIDS, ZEN3, NEOVERSE))
    assert names(intel) == ["default", "ynn_dot", "no_xnnpack", "concurrent", "vector_512", "onednn_dot"]
    assert names(amd) == ["default", "ynn_dot", "no_xnnpack", "concurrent", "onednn_dot"]  # no AVX-512: no 512-bit
    # oneDNN's x86 paths and AVX-512 are not offered
    assert names(arm) == ["default", "ynn_dot", "no_xnnpack", "concurrent"]
    # the signature keeps the units that matter and drops the rest (hypervisor, sse2, ...)
    assert intel.signature == ("Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz [amx_bf16 amx_int8 amx_tile avx2 "
                               "avx512_bf16 avx512_fp16 avx512_vnni avx512bw avx512f avx512vl fma]")
    assert amd.signature == "AMD EPYC 7B13 [avx2 fma]" and arm.signature == "0xd40 [asimd bf16 sve]"


def test_a_recorded_choice_applies_only_to_its_cpu_and_jaxlib(tmp_path, capsys):
    env = {"XDG_CACHE_HOME": str(tmp_path)}
    intel, amd = xo.parse_cpuinfo(SAPPHIRE_RAPIDS), xo.parse_cpuinfo(ZEN3)
    path = xo.record("onednn_dot", {"default": 1.0, "onednn_dot": 0.5}, cpu=intel, jaxlib="9.9", environ=env)
    xo.record("default", {"default": 1.0, "ynn_dot": 0.99}, cpu=amd, jaxlib="9.9", environ=env)
    assert path == tmp_path / "ppojax" / "xla_cpu_options.json" and not list(path.parent.glob("*.tmp"))

    on_intel = dict(env, XLA_FLAGS="--xla_force_host_platform_device_count=2")
    added = xo.apply(on_intel, cpu=intel, jaxlib="9.9")
    assert added == next(s.flags for s in xo.CANDIDATES if s.name == "onednn_dot")
    assert on_intel["XLA_FLAGS"] == f"--xla_force_host_platform_device_count=2 {added}"
    assert "onednn_dot" in capsys.readouterr().out  # one line says what was added and how to turn it off

    on_amd = dict(env)  # measured: nothing beat the defaults there, so nothing is added
    assert xo.apply(on_amd, cpu=amd, jaxlib="9.9") is None and "XLA_FLAGS" not in on_amd
    other_version = dict(env)  # a record is for the jaxlib it was timed on (flags change between XLA versions)
    assert xo.apply(other_version, cpu=intel, jaxlib="10.0") is None and "XLA_FLAGS" not in other_version
    arm = dict(env)
    assert xo.apply(arm, cpu=xo.parse_cpuinfo(NEOVERSE), jaxlib="9.9") is None


def test_the_users_own_options_and_the_off_switch_win(tmp_path):
    env = {"XDG_CACHE_HOME": str(tmp_path)}
    intel = xo.parse_cpuinfo(SAPPHIRE_RAPIDS)
    xo.record("vector_512", {"default": 1.0, "vector_512": 0.8}, cpu=intel, jaxlib="9.9", environ=env)
    users = dict(env, XLA_FLAGS="--xla_cpu_use_xnnpack=true")
    assert xo.apply(users, cpu=intel, jaxlib="9.9") is None and users["XLA_FLAGS"] == "--xla_cpu_use_xnnpack=true"
    for word in ("0", "false", "OFF"):
        off = dict(env, PPOJAX_XLA_CPU_OPTIONS=word)
        assert xo.apply(off, cpu=intel, jaxlib="9.9") is None and "XLA_FLAGS" not in off, word
    assert xo.apply(dict(env, PPOJAX_XLA_CPU_OPTIONS="1"), cpu=intel, jaxlib="9.9") is not None
    damaged = tmp_path / "ppojax" / "xla_cpu_options.json"
    damaged.write_text("{not json")
    assert xo.apply(dict(env), cpu=intel, jaxlib="9.9") is None  # an unreadable record is no record
    with pytest.raises(ValueError, match="expected one of"):
        xo.record("turbo", {}, cpu=intel, jaxlib="9.9", environ=env)


def test_each_kind_of_matmul_has_its_own_record(tmp_path, capsys):
    """On the AMX host the bf16 step's winner (the concurrency scheduler) slowed the float32 step: a run gets the
    record of its precision's matmuls, and recording one kind keeps the other."""
    env = {"XDG_CACHE_HOME": str(tmp_path)}
    intel = xo.parse_cpuinfo(SAPPHIRE_RAPIDS)
    xo.record("concurrent", {"default": 0.72, "concurrent": 0.61}, matmuls="bf16", cpu=intel, jaxlib="9.9",
              environ=env)
    xo.record("default", {"default": 0.83, "concurrent": 0.91}, matmuls="float32", cpu=intel, jaxlib="9.9",
              environ=env)
    concurrent = next(s.flags for s in xo.CANDIDATES if s.name == "concurrent")
    for precision in ("mixed", "bfloat16"):  # both run bf16 matmuls
        on_intel = dict(env)
        assert xo.apply(on_intel, cpu=intel, jaxlib="9.9", precision=precision) == concurrent
        assert on_intel["XLA_FLAGS"] == concurrent and "bf16 matmuls" in capsys.readouterr().out
    float32_run = dict(env)
    assert xo.apply(float32_run, cpu=intel, jaxlib="9.9", precision="float32") is None
    assert "XLA_FLAGS" not in float32_run
    with pytest.raises(ValueError, match="expected one of float32, bf16"):
        xo.record("default", {}, matmuls="mixed", cpu=intel, jaxlib="9.9", environ=env)


def test_a_record_from_before_the_split_counts_as_float32s(tmp_path):
    """The record file of earlier versions held one choice per CPU, timed at float32."""
    env = {"XDG_CACHE_HOME": str(tmp_path)}
    intel = xo.parse_cpuinfo(SAPPHIRE_RAPIDS)
    path = xo.record_path(env)
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({f"{intel.signature} jaxlib 9.9": {
        "option_set": "vector_512", "flags": "--xla_cpu_prefer_vector_width=512", "measurements": {}}}))
    assert xo.apply(dict(env), cpu=intel, jaxlib="9.9", precision="float32") == "--xla_cpu_prefer_vector_width=512"
    assert xo.apply(dict(env), cpu=intel, jaxlib="9.9", precision="mixed") is None
    xo.record("concurrent", {}, matmuls="bf16", cpu=intel, jaxlib="9.9", environ=env)  # adds, keeps the old one
    assert xo.apply(dict(env), cpu=intel, jaxlib="9.9", precision="float32") == "--xla_cpu_prefer_vector_width=512"
    assert xo.recorded_choice(intel, "9.9", env, precision="mixed")["option_set"] == "concurrent"


def test_record_chooses_per_precision_from_the_amx_hosts_measurement():
    """The step measured on the Intel AMX host (16-core Xeon with AVX512-BF16 and AMX): at float32
    nothing beats XLA's defaults by the margin; at mixed the concurrency scheduler does."""
    measured = json.loads((REPO / "tests/data/xla_options_step_intel_amx.json").read_text())["sets"]
    assert choose(measured, "float32")[0] == "default"
    winner, seconds = choose(measured, "mixed")
    assert winner == "concurrent" and seconds["concurrent"] < seconds["default"] * (1 - RECORD_MARGIN)
    assert "onednn_dot" not in seconds  # the set that failed is no candidate


def test_record_keeps_a_set_only_beyond_the_margin():
    def step(seconds):
        return {"by_dtype": {"float32": {"seconds": seconds}}}
    slightly = 1.0 * (1 - RECORD_MARGIN / 2)
    assert choose({"default": step(1.0), "ynn_dot": step(slightly), "onednn_dot": {"error": "x"}})[0] == "default"
    clearly = 1.0 * (1 - 2 * RECORD_MARGIN)
    winner, seconds = choose({"default": step(1.0), "ynn_dot": step(slightly), "vector_512": step(clearly)})
    assert winner == "vector_512" and seconds == {"default": 1.0, "ynn_dot": slightly, "vector_512": clearly}


def test_the_ppojax_command_starts_jax_with_the_recorded_options(tmp_path):
    """End to end on this host: a record for THIS CPU reaches XLA_FLAGS of the `ppojax` program before JAX
    starts (an option XLA does not know would abort the process, so it must be a real one)."""
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path), "PYTHONPATH": str(REPO), "PPOJAX_HUGE_PAGES": "0"}
    env.pop("XLA_FLAGS", None)
    xo.record("no_xnnpack", {"default": 1.0, "no_xnnpack": 0.5}, environ=env)
    code = ("import os, sys; from ppojax.trainer import cli; import jax, jax.numpy as jnp; "
            "cli.run_plan = lambda args: print('XLA_FLAGS=' + os.environ.get('XLA_FLAGS', ''), "
            "float(jnp.ones((4, 4)) @ jnp.ones((4,)) @ jnp.ones((4,)))); "
            "sys.argv = ['ppojax', 'plan', 'configs/plan.yaml']; sys.exit(cli.main())")
    done = subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    # and XLA ran with it (after PPOJAX_CPU_ISA's cap, where the suite runs under one)
    assert f"XLA_FLAGS={_with_cap('--xla_cpu_use_xnnpack=false')} 16.0" in done.stdout, done.stdout


def test_the_ppojax_command_picks_the_record_of_its_configs_precision(tmp_path):
    """`ppojax train` reads the config before JAX starts: a `mixed` run gets the bf16 matmuls' record."""
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path), "PYTHONPATH": str(REPO), "PPOJAX_HUGE_PAGES": "0"}
    env.pop("XLA_FLAGS", None)
    xo.record("no_xnnpack", {"default": 1.0, "no_xnnpack": 0.5}, matmuls="bf16", environ=env)
    xo.record("default", {"default": 1.0}, matmuls="float32", environ=env)
    code = ("import os, sys; from ppojax.trainer import cli, job; import jax, jax.numpy as jnp; "
            "job.run_training = lambda config, *_: print(config.precision, 'XLA_FLAGS=' + "
            "os.environ.get('XLA_FLAGS', ''), float(jnp.ones((4, 4)) @ jnp.ones((4,)) @ jnp.ones((4,)))); "
            "sys.argv = ['ppojax', 'train', 'configs/tiny.yaml', 'precision=' + sys.argv[1]]; sys.exit(cli.main())")
    for precision, flags in (("mixed", "--xla_cpu_use_xnnpack=false"), ("float32", "")):
        done = subprocess.run([sys.executable, "-c", code, precision], env=env, cwd=REPO, capture_output=True,
                              text=True, timeout=120)
        assert done.returncode == 0, done.stderr[-2000:]
        assert f"{precision} XLA_FLAGS={_with_cap(flags)} 16.0" in done.stdout, done.stdout


@pytest.mark.skipif(os.uname().machine not in ("x86_64", "AMD64"), reason="XLA's oneDNN paths are x86-only")
def test_the_onednn_option_sets_failure_is_reproduced_and_explained():
    """Why `onednn_dot` fails on the step: XLA's oneDNN fusion takes the element-wise
    producer of a dot's input, and oneDNN's partition compile aborts. If a jaxlib fixes it, this test fails:
    time to measure the option set again (`python -m ppojax.backends.cpu.xla_options_tuning`)."""
    from ppojax.backends.cpu.xla_options_tuning import OPTION_SETS, explain

    code = ("import jax, jax.numpy as jnp\n"
            "x = jnp.ones((16, 8))\n"
            "print(jax.jit(lambda p, s, v: (p * s) @ v)(x, x, x.T).sum())\n")
    env = dict(os.environ, XLA_FLAGS=OPTION_SETS["onednn_dot"], JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "partition compile failed" in proc.stderr
    assert "oneDNN cannot compile" in explain(proc.stderr.strip().splitlines()[-1])
    assert explain("out of memory") == "out of memory"


def test_the_measurement_refuses_an_unknown_option_set_before_timing(capsys):
    from ppojax.backends.cpu import xla_options_tuning

    with pytest.raises(SystemExit) as stop:
        xla_options_tuning.main(["--sets", "default,turbo"])
    assert stop.value.code == 2
    assert "--sets: unknown turbo; expected names among default, ynn_dot" in capsys.readouterr().err
