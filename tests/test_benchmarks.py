"""The benchmark harness runs end to end (`python -m benchmarks.run --quick`) and writes a valid report.
How fast anything is, is not tested. The TRL side needs `.venv-bench` (`bash benchmarks/install.sh`); without
it the TRL checks are skipped with that message, and the report must say TRL is not available."""

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.common import METRIC_KEYS, make_config, make_prompts
from benchmarks.run import trl_python

REPO = Path(__file__).resolve().parent.parent
SIDE_KEYS = ("episodes_per_s", "time_to_first_update_s", "generation_tokens_per_s", "update_tokens_per_s",
             "peak_rss_mb", "rollout_s", "update_s")


@pytest.fixture(scope="module")
def quick_report(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "quick.json"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.run", "--quick", "--json", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text()), proc.stdout


@pytest.mark.slow
def test_quick_report_structure(quick_report):
    report, stdout = quick_report
    assert report["schema"] == 1 and report["quick"] is True
    assert report["machine"]["cores"] >= 1 and report["machine"]["cpu_model"]
    assert set(report["sizes"]) == {"tiny"}
    assert report["peak"]["jax"]["flops_per_s"] > 0
    assert report["peak"]["peak_flops_per_s"] >= report["peak"]["jax"]["flops_per_s"]
    tiny = report["sizes"]["tiny"]
    assert "prompts" not in tiny["config"] and tiny["config"]["response_length"] == 32
    assert tiny["flops"]["total"] == tiny["flops"]["rollout"] + tiny["flops"]["update"] > 0
    # ppojax's side always runs here (TRL's needs its own venv): a failure of ppojax's side fails the test
    assert tiny["ppojax"]["available"], tiny["ppojax"].get("error") or tiny["ppojax"].get("reason")
    for side in ("trl", "ppojax"):
        r = tiny[side]
        assert isinstance(r["available"], bool)
        if r["available"]:
            for k in SIDE_KEYS:
                assert isinstance(r[k], (int, float)) and math.isfinite(r[k]) and r[k] > 0, (side, k, r.get(k))
            assert 0 < tiny["mfu"][side]["overall_mfu"]
        else:
            assert r.get("reason") or r.get("error")
    if tiny["trl"]["available"] and tiny["ppojax"]["available"]:
        assert tiny["ratio_ppojax_over_trl"]["episodes_per_s"] > 0
    else:
        assert tiny["ratio_ppojax_over_trl"] is None
    assert "episodes/s (steady)" in stdout
    if tiny["ppojax"]["available"]:  # the re-run on the filled compilation cache
        warm = tiny["ppojax"]["warm_cache"]["time_to_first_update_s"]
        assert isinstance(warm, float) and 0 < warm


@pytest.mark.slow
def test_quick_report_trl(quick_report):
    if not trl_python().exists():
        pytest.skip(f"TRL benchmark skipped: {trl_python()} not found (install: bash benchmarks/install.sh)")
    report, _ = quick_report
    trl = report["sizes"]["tiny"]["trl"]
    assert trl["available"], trl
    assert trl["versions"]["trl"] == "1.12.0"
    assert trl["threads"] in trl["threads_tried"]
    assert trl["num_updates"] == len(trl["updates"]) >= 2
    assert trl["episodes_per_cpu_s"] > 0 and trl["other_load_cores"] is not None
    assert report["peak"]["torch"]["flops_per_s"] > 0


def test_prompts_are_left_padded_and_fixed_length():
    cfg = make_config("tiny", quick=True)
    assert len(cfg["prompts"]) == cfg["batch_size"] * cfg["num_updates"]
    for p in cfg["prompts"]:
        assert len(p) == cfg["prompt_length"]
        real = [t for t in p if t != cfg["pad_token_id"]]
        assert p[len(p) - len(real):] == real and real[0] == cfg["bos_token_id"]
        assert all(3 <= t < cfg["model"]["vocab_size"] for t in real[1:])
    assert make_prompts(4, 16, 512, seed=0) == make_prompts(4, 16, 512, seed=0)
    assert set(METRIC_KEYS) >= {"episodes_per_s", "time_to_first_update_s"}


_FAKE_SIDE = """
import json, sys, time
from benchmarks.common import Turns
turns, spans = Turns({"turn_dir": sys.argv[1]}, sys.argv[2]), []
for u in range(int(sys.argv[4])):
    turns.wait(u)
    start = time.time()
    time.sleep(0.05)
    spans.append([sys.argv[2], u, start, time.time()])
    turns.done(u)
json.dump(spans, open(sys.argv[3], "w"))
"""


def test_interleaved_sides_take_turns_one_update_at_a_time(tmp_path):
    """run.py --interleave's turn-taking with two stand-in sides (processes that only sleep): every update runs
    alone (no two spans overlap) and the rounds alternate who goes first; a side that dies is reported by
    name instead of hanging the orchestrator."""
    import time

    from benchmarks.run import REPO, _env, grant_turns

    def start(side, turn_dir, updates):
        return subprocess.Popen([sys.executable, "-c", _FAKE_SIDE, str(turn_dir), side,
                                 str(turn_dir / f"{side}.json"), str(updates)], cwd=REPO, env=_env())

    procs = {"trl": start("trl", tmp_path, 3), "ppojax": start("ppojax", tmp_path, 3)}
    errors = grant_turns(tmp_path, procs, 3, time.perf_counter() + 60)
    for proc in procs.values():
        assert proc.wait(timeout=60) == 0
    assert errors == {"trl": None, "ppojax": None}
    spans = sorted(json.loads((tmp_path / "trl.json").read_text()) + json.loads((tmp_path / "ppojax.json").read_text()),
                   key=lambda span: span[2])
    assert [(side, u) for side, u, _, _ in spans] == [("trl", 0), ("ppojax", 0), ("ppojax", 1), ("trl", 1),
                                                      ("trl", 2), ("ppojax", 2)]
    assert all(later[2] >= earlier[3] for earlier, later in zip(spans, spans[1:]))

    failing = tmp_path / "failing"
    failing.mkdir()
    procs = {"trl": start("trl", failing, 3), "ppojax": start("ppojax", failing, 1)}  # ppojax stops after 1
    errors = grant_turns(failing, procs, 3, time.perf_counter() + 60)
    procs["trl"].kill()
    assert errors["trl"] is None and "exited with code 0 before ppojax.done.1" in errors["ppojax"]


def test_layer_storage_variants_compute_the_same_gradient():
    """benchmarks.layer_storage times four (five with oneDNN's handlers) ways of storing or reading the layers'
    weights; they must be ways of computing one thing: every variant's gradient equals the scan's (ppojax's way), which itself matches a
    central finite difference of the loss."""
    import numpy as np

    from benchmarks import layer_storage

    stacked = layer_storage.init_stacked(3, hidden=8, intermediate=16, q_width=8, kv_width=4, std=0.3, seed=3)
    x = np.random.default_rng(4).standard_normal((5, 8)).astype(np.float32)
    grads = layer_storage.gradients(stacked, x)
    from ppojax.backends.cpu import stacked_matmul

    assert set(grads) == {"scan_stacked", "unrolled_separate", "unrolled_static_slices", "unstacked_per_call"} | (
        set() if stacked_matmul.unavailable_reason() else {"scan_stacked_onednn"})
    reference = grads["scan_stacked"]
    for name, g in grads.items():
        for k in stacked:
            assert g[k].shape == stacked[k].shape, (name, k)
            # oneDNN's GEMM sums in another order than XLA's dots, and these large weights (gradients up to ~1e5,
            # products of three layers) magnify rounding: it differs by up to ~6e-7 of the leaf's largest element,
            # so its bound scales with that (a wrong layer or transpose would be off by O(1) of it)
            atol = 2e-6 * float(np.abs(reference[k]).max()) if name == "scan_stacked_onednn" else 1e-6
            np.testing.assert_allclose(g[k], reference[k], rtol=1e-5, atol=atol, err_msg=f"{name}.{k}")
    # the reference itself: one weight of the last layer's down projection against a central difference
    loss, _ = layer_storage.variants()["scan_stacked"]
    bumped = {k: v.astype(np.float64) for k, v in stacked.items()}
    eps = 1e-3
    values = []
    for sign in (1, -1):
        w = {k: v.copy() for k, v in bumped.items()}
        w["down"][2, 1, 3] += sign * eps
        values.append(float(loss({k: v.astype(np.float32) for k, v in w.items()}, x)))
    np.testing.assert_allclose((values[0] - values[1]) / (2 * eps), reference["down"][2, 1, 3], rtol=2e-2,
                               atol=1e-4)


def test_attention_forms_compute_the_same_gradient():
    """benchmarks.attention_forms times jax.nn's XLA attention against ppojax's grouped rows inside a backbone's
    forward + backward: the two must be one computation (same loss, same gradient, on a tiny GQA model with
    left-padded rows), and ppojax's model must be left with its own attention afterwards."""
    import jax
    import numpy as np

    import ppojax.models.transformer as transformer
    from benchmarks import attention_forms
    from benchmarks.common import SIZES
    from ppojax.models import ModelConfig
    from ppojax.models.attention import attention

    cfg = ModelConfig.from_hf(dict(SIZES["tiny"]["model"], model_type="llama"))
    assert cfg.num_heads > cfg.num_kv_heads  # grouped-query attention: the forms differ
    fns = attention_forms.backbone_gradients(cfg, rows=3, length=12, seed=2)
    assert set(fns) == set(attention_forms.VARIANTS)
    (loss_nn, grad_nn), (loss_rows, grad_rows) = fns["jax_nn"](), fns["grouped_rows"]()
    np.testing.assert_allclose(float(loss_rows), float(loss_nn), rtol=1e-5)
    for a, b in zip(jax.tree.leaves(grad_rows), jax.tree.leaves(grad_nn)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-4 * float(np.abs(b).max()))
    assert transformer.attention is attention


def test_slot_storage_variants_give_the_same_values():
    """benchmarks.slot_storage times a 16-bit gradient and generation with ppojax's slot storage on and off: the
    two must give the same tokens and gradients within bf16 rounding (tiny model, `mixed`); the variants are the
    CPU's kernels with and without bits, and the models' default (XLA's) stores none."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from benchmarks import slot_storage as bench
    from benchmarks.common import SIZES
    from ppojax.models import XLA, ModelConfig

    cfg = ModelConfig.from_hf(dict(SIZES["tiny"]["model"], model_type="llama"))
    fns = bench.programs(cfg, "mixed", rows=3, prompt=6, response=5, seed=2)
    assert set(fns) == {(w, v) for w in bench.WORKLOADS for v in bench.VARIANTS}
    for workload in bench.WORKLOADS:
        plain, stored = fns[workload, "plain"](), fns[workload, "slot_storage"]()
        assert bench.difference(plain, stored) <= (0.0 if workload == "generation" else 2e-2), workload
    assert max(float(np.abs(g).max()) for g in jax.tree.leaves(fns["gradient", "plain"]())) > 0
    for workload in bench.WORKLOADS:  # each variant is its own program (16-bit slots as bits only in one)
        bits = {v: "u16[" in fns[workload, v].__defaults__[0].as_text() for v in bench.VARIANTS}
        assert bits == {"plain": False, "slot_storage": True}, (workload, bits)
    assert bench.kernels("slot_storage").stores_bits(jnp.bfloat16) and not XLA.stores_bits(jnp.bfloat16)


BF16_FORM_TOLERANCE = {"f32": 1e-5, "bf16_out": 1e-2, "bf16_f32acc": 1e-5, "bf16_row_major": 1e-5, "onednn_ffi": 1e-5}


def _assert_form_computes_the_product(form, layout):
    """One form of one contraction against a float64 product of the operands it multiplies (bfloat16-rounded where
    the form rounds), exact up to float32 accumulation, except ``bf16_out``, which also rounds its output."""
    import numpy as np

    from benchmarks import bf16_dots

    a, b = bf16_dots.operands(form, layout, tokens=12, d_in=24, d_out=40, seed=5)
    got = np.asarray(bf16_dots.contraction(form, layout)(a, b), np.float64)
    want = bf16_dots.reference(form, layout, a, b)
    assert got.shape == want.shape == ((24, 40) if layout == "dw" else (12, 24 if layout == "dx" else 40))
    error = np.abs(got - want).max() / np.abs(want).max()
    assert error < BF16_FORM_TOLERANCE[form], (form, layout, error)
    return a, b, got


@pytest.mark.parametrize("layout", ["fwd", "dx", "dw"])
def test_bf16_dot_forms_compute_the_product(layout):
    """benchmarks.bf16_dots times each form of a linear layer's three contractions; XLA's forms (what ppojax's
    16-bit models run, on any CPU) must compute that contraction."""
    for form in ("f32", "bf16_out", "bf16_f32acc", "bf16_row_major"):
        _assert_form_computes_the_product(form, layout)


@pytest.mark.parametrize("layout", ["fwd", "dx", "dw"])
def test_bf16_dot_onednn_form_computes_the_product(layout, tmp_path_factory):
    """The oneDNN bfloat16 custom call (every transpose flag), built where this CPU can run it (AVX-512, asked of
    ppojax's probe), its wheel and a C++ compiler are here: the product of bfloat16-rounded operands, not of the
    float32 ones."""
    import numpy as np

    library, why = _bf16_ffi_library(tmp_path_factory)
    if library is None:
        pytest.skip(why)
    a, b, got = _assert_form_computes_the_product("onednn_ffi", layout)
    exact = np.asarray(a.T if layout == "dw" else a, np.float64) @ np.asarray(b.T if layout == "dx" else b, np.float64)
    assert np.abs(got - exact).max() / np.abs(exact).max() > 1e-4


_BF16_FFI = {}


def _bf16_ffi_library(tmp_path_factory):
    """Build and register the oneDNN custom call once per test process: (library, "") or (None, why not)."""
    from benchmarks import bf16_dots

    if "built" not in _BF16_FFI:
        library, why = bf16_dots.build_ffi(tmp_path_factory.mktemp("ffi"))
        if library is not None:
            bf16_dots.register_ffi(library)
        _BF16_FFI["built"] = (library, why)
    return _BF16_FFI["built"]


def test_bf16_dots_onednn_backward_has_the_gradient_of_the_projection(tmp_path_factory):
    """benchmarks.bf16_dots --step onednn_backward swaps ppojax's 16-bit projection for a custom VJP whose backward
    runs through the oneDNN custom call: it must have the same value and the same gradients (dx in bf16, dw
    rounded to the weights' bf16) as autodiff of ppojax's own matmul."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from benchmarks import bf16_dots
    from ppojax.backends.cpu.kernels import CpuKernels

    library, why = _bf16_ffi_library(tmp_path_factory)
    if library is None:
        pytest.skip(why)
    keys = jax.random.split(jax.random.key(7), 3)
    x = jax.random.normal(keys[0], (12, 24)).astype(jnp.bfloat16)
    w = jax.random.normal(keys[1], (24, 40)).astype(jnp.bfloat16)
    c = jax.random.normal(keys[2], (12, 40))

    def loss(matmul):
        return lambda x, w: jnp.sum(matmul(x, w).astype(jnp.float32) * c)

    ours = jax.jit(jax.value_and_grad(loss(bf16_dots.onednn_backward_matmul()), argnums=(0, 1)))(x, w)
    ppojax = jax.jit(jax.value_and_grad(loss(CpuKernels().matmul),
                                        argnums=(0, 1)))(x, w)
    np.testing.assert_array_equal(np.asarray(ours[0]), np.asarray(ppojax[0]))
    for got, want in zip(ours[1], ppojax[1]):
        assert got.dtype == want.dtype == jnp.bfloat16
        got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
        np.testing.assert_allclose(got, want, rtol=2 ** -7, atol=2 ** -7 * np.abs(want).max())


# --- the harness's plumbing (no measurement): where TRL's interpreter comes from, reports kept when a run is
# cut off, one precision row alone, and reports of separate processes merged -------------------------------

def _fake_side(eps: float) -> dict:
    return {"available": True, "episodes_per_s": eps, "update_tokens_per_s": 10 * eps, "peak_rss_mb": 100.0}


def test_trl_python_takes_a_command_name_from_path(monkeypatch, tmp_path):
    import shutil

    from benchmarks import run as bench_run

    fake = tmp_path / "python-with-trl"
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:/usr/bin:/bin")
    monkeypatch.setenv("PPOJAX_BENCH_PYTHON", "python-with-trl")
    assert trl_python() == fake == Path(shutil.which("python-with-trl"))
    monkeypatch.setenv("PPOJAX_BENCH_PYTHON", str(fake))  # a path is taken as it is
    assert trl_python() == fake
    monkeypatch.setenv("PPOJAX_BENCH_PYTHON", "no-such-python")
    result = bench_run.run_trl(tmp_path / "tiny.json", tmp_path, [2], 10)
    assert not result["available"] and "PPOJAX_BENCH_PYTHON" in result["reason"]
    assert "no-such-python not found" in result["reason"]


def _fake_harness(monkeypatch, calls: list, fail_on: str | None = None, fail_after_measured: bool = False):
    from benchmarks import run as bench_run

    monkeypatch.setattr(bench_run, "run_peak", lambda tmp, quick: {"peak_flops_per_s": 1e11})

    def fake_trl(config_path, tmp, threads, timeout):
        calls.append(("trl", config_path.stem))
        return dict(_fake_side(1.0), threads=threads[0])

    def fake_ppojax(config_path, tmp, timeout, measured=lambda result: None):
        precision = json.loads(config_path.read_text()).get("precision", "float32")
        calls.append(("ppojax", config_path.stem, precision))
        result = _fake_side(3.0 if precision == "float32" else 4.0)
        if fail_on == config_path.stem:
            if fail_after_measured:
                measured(result)  # as run_ppojax does before its warm-cache run, which the kill then cuts
            raise KeyboardInterrupt  # the run is killed in the middle of this side
        measured(result)
        return result

    def fake_setup(tmp):
        calls.append(("ppojax machine setup",))
        return {"seconds": 1.0, "said": ["'auto' takes: onednn"], "error": None}

    monkeypatch.setattr(bench_run, "run_trl", fake_trl)
    monkeypatch.setattr(bench_run, "run_ppojax", fake_ppojax)
    monkeypatch.setattr(bench_run, "prepare_machine", fake_setup)
    return bench_run


def test_a_run_cut_off_keeps_every_side_it_finished(monkeypatch, tmp_path):
    calls = []
    bench_run = _fake_harness(monkeypatch, calls, fail_on="smollm2")
    out = tmp_path / "new_folder" / "report.json"  # its folder is made before any measurement
    with pytest.raises(KeyboardInterrupt):
        bench_run.main(["--sizes", "tiny,smollm2", "--threads", "2", "--smollm2-dir", "random", "--json", str(out)])
    # ppojax's once-per-machine setup (the in-place handlers, auto's library) before SmolLM2's sides, not tiny's:
    # tiny's layers are below auto's size for them
    assert calls == [("trl", "tiny"), ("ppojax", "tiny", "float32"), ("ppojax machine setup",), ("trl", "smollm2"),
                     ("ppojax", "smollm2", "float32")]
    report = json.loads(out.read_text())
    assert report["complete"] is False
    assert report["sizes"]["smollm2"]["ppojax_machine_setup"]["said"] == ["'auto' takes: onednn"]
    assert report["sizes"]["tiny"]["ratio_ppojax_over_trl"]["episodes_per_s"] == 3.0
    assert report["sizes"]["smollm2"]["trl"]["episodes_per_s"] == 1.0  # the side finished before the kill
    assert "ppojax" not in report["sizes"]["smollm2"]
    assert not list(out.parent.glob(".*.tmp"))  # written atomically: no half-written file left


def test_a_run_cut_off_in_the_warm_cache_run_keeps_the_measured_ppojax_run(monkeypatch, tmp_path):
    calls = []
    bench_run = _fake_harness(monkeypatch, calls, fail_on="smollm2", fail_after_measured=True)
    out = tmp_path / "report.json"
    with pytest.raises(KeyboardInterrupt):
        bench_run.main(["--sizes", "smollm2", "--threads", "2", "--smollm2-dir", "random", "--json", str(out)])
    smollm2 = json.loads(out.read_text())["sizes"]["smollm2"]
    assert smollm2["ppojax"]["episodes_per_s"] == 3.0
    assert smollm2["ratio_ppojax_over_trl"]["episodes_per_s"] == 3.0


def test_run_ppojax_hands_over_the_measured_run_before_the_warm_cache_run(monkeypatch, tmp_path):
    """The real run_ppojax, its two worker processes replaced: the measured run reaches ``measured`` before the
    warm-cache run starts (a kill there loses only the warm figure)."""
    from benchmarks import run as bench_run

    events = []

    def fake_worker(cmd, out, timeout, log, env=None):
        warm = out.name.endswith("_warm.json")
        events.append("warm run" if warm else "measured run")
        return {"available": True, "time_to_first_update_s": 2.0 if warm else 9.0}

    monkeypatch.setattr(bench_run, "_subprocess_json", fake_worker)
    config = tmp_path / "tiny.json"
    config.write_text(json.dumps({"num_updates": 3}))
    result = bench_run.run_ppojax(config, tmp_path, 10, lambda r: events.append(("measured", dict(r))))
    assert events == ["measured run", ("measured", {"available": True, "time_to_first_update_s": 9.0}), "warm run"]
    assert result["warm_cache"]["time_to_first_update_s"] == 2.0


def test_mixed_alone_and_merged_with_a_trl_only_report(monkeypatch, tmp_path):
    calls = []
    bench_run = _fake_harness(monkeypatch, calls)
    common = ["--sizes", "tiny", "--threads", "2"]
    bench_run.main(common + ["--only", "trl", "--json", str(tmp_path / "trl.json")])
    bench_run.main(common + ["--only", "ppojax", "--ppojax-precisions", "mixed", "--json", str(tmp_path / "mixed.json")])
    bench_run.main(common + ["--only", "ppojax", "--json", str(tmp_path / "f32.json")])
    assert calls == [("trl", "tiny"), ("ppojax", "tiny_mixed", "mixed"), ("ppojax", "tiny", "float32")]
    mixed_only = json.loads((tmp_path / "mixed.json").read_text())["sizes"]["tiny"]
    assert mixed_only["ppojax"]["reason"] == "skipped (--ppojax-precisions)" and mixed_only["ppojax_mixed"]["available"]

    bench_run.main(["--merge"] + [str(tmp_path / f) for f in ("trl.json", "mixed.json", "f32.json")]
                   + ["--json", str(tmp_path / "merged.json")])
    merged = json.loads((tmp_path / "merged.json").read_text())["sizes"]["tiny"]
    assert merged["ratio_ppojax_over_trl"]["episodes_per_s"] == 3.0
    assert merged["ratio_ppojax_mixed_over_trl"]["episodes_per_s"] == 4.0

    other_cpu = json.loads((tmp_path / "f32.json").read_text())
    other_cpu["machine"]["cpu_signature"] = "Another CPU [avx2]"
    (tmp_path / "other.json").write_text(json.dumps(other_cpu))
    with pytest.raises(SystemExit, match="different CPUs"):
        bench_run.main(["--merge", str(tmp_path / "trl.json"), str(tmp_path / "other.json")])
    with pytest.raises(SystemExit, match="cannot read the report .*missing.json"):
        bench_run.main(["--merge", str(tmp_path / "trl.json"), str(tmp_path / "missing.json")])
    (tmp_path / "not_a_report.json").write_text('{"episodes_per_s": 1}')
    with pytest.raises(SystemExit, match="not_a_report.json is not a benchmarks.run report"):
        bench_run.main(["--merge", str(tmp_path / "trl.json"), str(tmp_path / "not_a_report.json")])
    other_work = json.loads((tmp_path / "f32.json").read_text())
    other_work["sizes"]["tiny"]["config"]["num_updates"] = 99
    (tmp_path / "other_work.json").write_text(json.dumps(other_work))
    with pytest.raises(SystemExit, match="different settings"):
        bench_run.main(["--merge", str(tmp_path / "trl.json"), str(tmp_path / "other_work.json")])


def test_merge_shows_why_a_side_failed_rather_than_another_reports_skip():
    from benchmarks.run import merge_reports

    def report(side_entries):
        return {"machine": {"cpu_signature": "CPU [avx2]"}, "peak": {"peak_flops_per_s": None},
                "sizes": {"tiny": dict({"config": {"batch_size": 16}, "flops": {}}, **side_entries)}}

    skipped = {"available": False, "reason": "skipped (--only)"}
    trl_only = report({"trl": dict(_fake_side(1.0), threads=2), "ppojax": skipped})
    failed = report({"trl": skipped, "ppojax": {"available": False, "error": "exit code 1: out of memory"}})
    merged = merge_reports([trl_only, failed])["sizes"]["tiny"]
    assert merged["trl"]["episodes_per_s"] == 1.0
    assert merged["ppojax"]["error"] == "exit code 1: out of memory"
    assert merged["ratio_ppojax_over_trl"] is None


#: A compiled module's text, shortened: the conditional's taken branch runs a fusion, a nested call and a ROOT
#: tuple; the entry has a same-named fusion (the forward's residual add) outside it.
_HLO_WITH_A_CONDITIONAL = """HloModule jit_step, entry_computation_layout={()->f32[4]{0}}

%fused_computation.9 (param_0: f32[4], param_1: f32[4]) -> f32[4] {
  %param_0 = f32[4]{0} parameter(0)
  ROOT %add.2 = f32[4]{0} add(%param_0, %param_0)
}

%inner.3 (p: f32[4]) -> f32[4] {
  %p = f32[4]{0} parameter(0)
  ROOT %multiply_subtract_fusion.7 = f32[4]{0} fusion(%p, %p), kind=kLoop, calls=%fused_computation.9
}

%region_skip.1 (arg_tuple.1: (f32[4])) -> (f32[4]) {
  %arg_tuple.1 = (f32[4]{0}) parameter(0)
  ROOT %tuple.1 = (f32[4]{0}) tuple(%arg_tuple.1)
}

%region_adam.2 (arg_tuple.2: (f32[4])) -> (f32[4]) {
  %arg_tuple.2 = (f32[4]{0}) parameter(0)
  %multiply_add_fusion.45 = f32[4]{0} fusion(%arg_tuple.2), kind=kLoop, calls=%fused_computation.9
  %multiply_add_fusion.22 = f32[4]{0} fusion(%arg_tuple.2), kind=kLoop, calls=%fused_computation.9
  %call.5 = f32[4]{0} call(%multiply_add_fusion.45), to_apply=%inner.3
  ROOT %tuple.2 = (f32[4]{0}) tuple(%call.5)
}

ENTRY %main.10 (x: f32[4]) -> f32[4] {
  %x = f32[4]{0} parameter(0)
  %multiply_add_fusion.7 = f32[4]{0} fusion(%x, %x), kind=kLoop, calls=%fused_computation.9
  %cond.160 = (f32[4]{0}) conditional(%p, %t, %t), branch_computations={%region_skip.1, %region_adam.2}
  ROOT %get-tuple-element.1 = f32[4]{0} get-tuple-element(%cond.160), index=0
}
"""


def test_step_profile_finds_the_instructions_inside_a_conditionals_branches():
    """Every branch's instructions and those of the computations they call, nothing of the entry's."""
    from benchmarks.step_profile import conditional_branch_ops

    ops = conditional_branch_ops(_HLO_WITH_A_CONDITIONAL)
    assert {"multiply_add_fusion.45", "multiply_add_fusion.22", "call.5", "multiply_subtract_fusion.7",
            "tuple.1", "tuple.2"} <= ops
    assert not {"multiply_add_fusion.7", "cond.160", "get-tuple-element.1", "x"} & ops


def test_step_profile_puts_the_conditionals_ops_on_the_optimizer_and_the_rest_by_name():
    """A synthetic trace: two worker threads; the conditional's branch runs on both, one thread's ops ending after
    the `cond` event ends (the old timing rule missed those); a same-named op outside the branch stays with its
    name's kind; wrappers are not ops."""
    from benchmarks.step_profile import OPTIMIZER, conditional_branch_ops, summarize_trace

    def op(name, ts, dur, tid=1, hlo=True):  # times in ms (the trace's are in µs)
        return {"ph": "X", "name": name, "ts": ts * 1e3, "dur": dur * 1e3, "pid": 1, "tid": tid,
                "args": {"hlo_op": name} if hlo else {}}

    events = [
        op("ynn_fusion.3", 0, 100), op("dynamic-slice_bitcast_fusion.1", 100, 10),
        op("multiply_add_fusion.7", 110, 5),  # the forward's residual add: element-wise, not Adam
        op("cond.160", 200, 50), op("ThunkExecutor::Execute", 201, 49, hlo=False),
        op("multiply_add_fusion.45", 205, 20), op("multiply_subtract_fusion.7", 230, 15),
        op("multiply_add_fusion.22", 260, 60, tid=2),  # starts after the cond event has ended
        op("end: multiply_add_fusion.22", 320, 1, tid=2), op("ThreadpoolListener::Record", 215, 3, tid=2),
        op("bitcast_dynamic-update-slice_fusion", 330, 7), op("transpose_copy_fusion", 340, 3),
        op("convert_bitcast_fusion.2", 350, 2), op("dot.4", 360, 4, tid=2),
    ]
    out = summarize_trace(events, conditional_branch_ops(_HLO_WITH_A_CONDITIONAL))
    kinds = {k: v["seconds"] * 1e3 for k, v in out["kinds"].items()}
    assert kinds == pytest.approx({"matmuls": 104, "layer-scan weight slices": 10, "other element-wise": 5,
                                   OPTIMIZER: 95, "stacked writes": 7, "transposes and copies": 3,
                                   "dtype conversions": 2})
    assert out["op_seconds"] * 1e3 == pytest.approx(226)
    assert out["cond_event_s"] == [pytest.approx(0.05)]


def test_step_profile_reads_a_real_trace_of_the_tiny_step():
    """jax.profiler's own trace format: the tiny benchmark's traced step has its 4 optimizer steps (4 epochs of one
    mini-batch), matmuls, and shares that add up."""
    from benchmarks.step_profile import OPTIMIZER, profile

    out = profile("tiny", "float32", warm=1)
    assert len(out["cond_event_s"]) == 4
    assert out["kinds"]["matmuls"]["seconds"] > 0 and out["kinds"][OPTIMIZER]["ops"] > 0
    # the trace's op names are the compiled program's: every optimizer op ran once per epoch
    assert out["kinds"][OPTIMIZER]["ops"] % 4 == 0
    assert sum(k["share"] for k in out["kinds"].values()) == pytest.approx(1.0, abs=1e-3)
    assert len(out["step_s"]) == 2 and out["traced_step_s"] == out["step_s"][-1]


def test_gemm_shapes_times_each_product_of_the_right_layer_and_sums_the_update():
    """benchmarks.gemm_shapes times, per implementation (XLA, ppojax's oneDNN handlers, oneDNN's matmul primitive,
    MKL's sgemm in place, torch), a pass of one product over stacked layers: each must compute that product for the layer it is given
    (checked on the last of three, whose operands differ from the others'; equal to a float64 product up to
    float32 rounding), an implementation that cannot run here must be reported with its reason, and ``update_s``
    must weigh each product by how often an update runs it (a decode step's: the forward of the policy's layers)."""
    import torch

    from benchmarks import gemm_shapes
    from ppojax.backends.cpu import stacked_matmul
    from ppojax.backends.cpu.matmul_record import choose

    shapes = (("layer", 12, 24, 40, 2), ("head", 8, 24, 56, None))
    decode = (("layer@decode", 2, 24, 40, 2),)
    report = gemm_shapes.measure(rounds=1, shapes=shapes, layers=3, decode_shapes=decode)
    why = stacked_matmul.unavailable_reason()
    assert set(report["unavailable"]) <= {"onednn", "onednn_primitive", "mkl"}  # each needs a library, a compiler
    assert report["unavailable"].get("onednn", "") == why
    if not why:  # where the oneDNN handlers build, those on its matmul primitive build too
        assert "onednn_primitive" not in report["unavailable"], report["unavailable"]
    if shutil.which("g++") and torch.backends.mkl.is_available() and not why:  # torch's x86 wheels carry MKL
        assert "mkl" not in report["unavailable"], report["unavailable"]
    expected = set(gemm_shapes.IMPLEMENTATIONS) - set(report["unavailable"])
    for name, _rows, _d_in, _d_out, _uses in shapes:
        for product in gemm_shapes.PRODUCTS:
            cell = report["results"][name][product]
            assert set(cell) == expected, (name, product, cell)
            for impl, figures in cell.items():
                assert figures["error"] < 1e-5 and figures["s"] > 0, (name, product, impl, figures)
    decode_cell = report["results"]["layer@decode"]
    assert list(decode_cell) == ["fwd"] and set(decode_cell["fwd"]) == expected  # a decode step: the forward only
    assert all(figures["error"] < 1e-5 for figures in decode_cell["fwd"].values())
    assert report["decode_step_s"] == pytest.approx(
        {impl: 2 * gemm_shapes.LAYERS * decode_cell["fwd"][impl]["s"] for impl in expected})
    ops = gemm_shapes.operands(12, 24, 40, 3)  # the layers' products do differ: a wrong layer would fail above
    assert abs(gemm_shapes.reference("fwd", ops, 2) - gemm_shapes.reference("fwd", ops, 1)).max() > 0.1
    for impl in expected:
        by_hand = sum(gemm_shapes.EPOCHS * (1 if uses is None else uses * gemm_shapes.LAYERS * gemm_shapes.MODELS)
                      * report["results"][name][product][impl]["s"]
                      for name, _r, _i, _o, uses in shapes for product in gemm_shapes.PRODUCTS)
        assert report["update_s"][impl] == pytest.approx(by_hand)
    per_layer = gemm_shapes.EPOCHS * 2 * gemm_shapes.LAYERS * gemm_shapes.MODELS  # the layer shape's 2 uses
    assert set(report["update_s_by_product"]) == expected
    for impl, by_product in report["update_s_by_product"].items():
        assert by_product == pytest.approx({product: per_layer * report["results"]["layer"][product][impl]["s"]
                                            for product in gemm_shapes.PRODUCTS})
    # ppojax: each product of each shape (the head's too) by the library `--record` would take from these figures
    chosen = {name: dict(zip(gemm_shapes.PRODUCTS, choose({
        lib: {product: report["results"][name][product][lib]["s"] for product in gemm_shapes.PRODUCTS}
        for lib in stacked_matmul.LIBRARIES if lib in expected}))) for name in ("layer", "head")} if not why else {}
    assert report["update_s"]["ppojax"] == pytest.approx(sum(
        gemm_shapes.EPOCHS * (1 if uses is None else uses * gemm_shapes.LAYERS * gemm_shapes.MODELS)
        * report["results"][name][product]["xla" if why else chosen[name][product]]["s"]
        for name, _r, _i, _o, uses in shapes for product in gemm_shapes.PRODUCTS))


def test_gemm_shapes_record_refuses_a_subset_of_the_libraries(capsys):
    """`--record` must measure every in-place library that can be had here (else `auto` would measure the rest
    itself and replace the record): refused before anything is timed, naming what to add."""
    from benchmarks import gemm_shapes
    from ppojax.backends.cpu import stacked_matmul

    available = stacked_matmul.buildable_libraries()
    if len(available) < 2:
        pytest.skip(f"one in-place library or none can be had here: {available}")
    with pytest.raises(SystemExit) as stop:
        gemm_shapes.main(["--record", "--only", f"xla,{available[0]}"])
    assert stop.value.code == 2
    assert f"add {','.join(available[1:])} to --only" in capsys.readouterr().err
