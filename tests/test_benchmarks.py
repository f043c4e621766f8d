"""The benchmark harness runs end to end (`python -m benchmarks.run --quick`) and writes a valid report.
How fast anything is, is not tested. The TRL side needs `.venv-bench` (`bash benchmarks/install.sh`); without
it the TRL checks are skipped with that message, and the report must say TRL is not available."""

import ast
import importlib
import importlib.util
import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.common import METRIC_KEYS, make_config, make_prompts
from benchmarks.math_grpo import VARIANTS, run_record
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
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
    if head.returncode == 0:  # a git checkout (not an unpacked archive): the report names the commit it ran at
        assert report["commit"].startswith(head.stdout.strip())
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


# --- the harness's plumbing (no measurement): where TRL's interpreter comes from, reports kept when a run is
# cut off, one precision row alone, and reports of separate processes merged -------------------------------

def _fake_side(eps: float) -> dict:
    return {"available": True, "episodes_per_s": eps, "update_tokens_per_s": 10 * eps, "peak_rss_mb": 100.0}


def test_trl_python_takes_a_command_name_from_path(monkeypatch, tmp_path):
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
    bench_run.main(common + ["--only", "ppojax", "--ppojax-precisions", "mixed",
                             "--json", str(tmp_path / "mixed.json")])
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


def test_hlo_text_finds_the_instructions_inside_a_conditionals_branches():
    """Every branch's instructions and those of the computations they call, nothing of the entry's."""
    from benchmarks import hlo_text

    module = hlo_text.computations(_HLO_WITH_A_CONDITIONAL)
    branches = [name for lines in module.values() for line in lines if " conditional(" in line
                for name in hlo_text.called(line)]
    assert branches == ["region_skip.1", "region_adam.2"]
    ops = {hlo_text.INSTRUCTION.match(line).group(1)
           for name in hlo_text.reachable(module, branches) for line in module[name]}
    assert {"multiply_add_fusion.45", "multiply_add_fusion.22", "call.5", "multiply_subtract_fusion.7",
            "tuple.1", "tuple.2"} <= ops
    assert not {"multiply_add_fusion.7", "cond.160", "get-tuple-element.1", "x"} & ops


def test_the_harness_keeps_no_dated_or_diary_names():
    """Raw reports live under benchmarks/results/ (one per current row) and benchmarks/plans_tpu/ (the plan table's
    compiles), named by what they hold, never by when they ran; the scripts and the README say what things are,
    not when or in which sitting they were made."""
    import re

    files = [p.relative_to(REPO) for p in (REPO / "benchmarks").rglob("*") if p.is_file()
             and "__pycache__" not in p.parts]
    dated = [str(p) for p in files if re.search(r"20\d\d-?\d\d|_\d{8}", str(p))]
    assert not dated, dated
    loose = [str(p) for p in files if p.suffix == ".json" and p.parent.name not in ("results", "plans_tpu")]
    assert not loose, loose
    diary = re.compile(r"\b(session|today|yesterday|\w+(teenth|tieth))\b", re.I)
    words = [f"{p}: {m.group(0)}" for p in files if p.suffix in (".py", ".sh", ".md")
             for m in diary.finditer((REPO / p).read_text())]
    assert not words, words


def test_math_run_record_reads_the_dynamic_sampling_figures(tmp_path):
    held = {"gsm8k_strict": 0.1, "gsm8k_flexible": 0.2, "answer_format": 0.3}
    (tmp_path / "summary.json").write_text(json.dumps({"held_out_rewards_before": held, "held_out_rewards_after": held,
                                                       "final_kl": 0.5, "updates": 2, "wall_seconds": 9.0}))
    rows = [{"step": 1, "dynamic_sampling/rounds": 1, "dynamic_sampling/batch_full": 1.0,
             "dynamic_sampling/groups_dropped": 3, "dynamic_sampling/generated_over_trained": 1.0},
            {"step": 2, "dynamic_sampling/rounds": 3, "dynamic_sampling/batch_full": 0.0,
             "dynamic_sampling/groups_dropped": 9, "dynamic_sampling/generated_over_trained": 2.0}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    record = run_record(tmp_path, 0, "train ...", "dapo")
    assert record["variant"] == "dapo" and record["final_kl"] == 0.5 and record["held_out_rewards_after"] == held
    assert record["dynamic_sampling"] == {"updates": 2, "batches_full": 1, "rounds": [1, 3], "groups_dropped": 12,
                                          "generated_over_trained_mean": 1.5}
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1}) + "\n")
    assert "dynamic_sampling" not in run_record(tmp_path, 0, "train ...")  # a run without it
    assert "filter_groups=true" in VARIANTS["dapo"] and "importance_sampling_level=sequence" in VARIANTS["gspo"]


def test_the_bytes_estimate_takes_a_kernels_declared_cost():
    """A Pallas kernel's custom call is counted at the bytes its cost estimate declares (the blocks it reads), not
    its operands whole (a stacked KV cache of which it reads one layer); other operations at their operands and
    results."""
    from benchmarks import hlo_text

    cost = '{"flops":"1","transcendentals":"0","bytes_accessed":"2048","remote_bytes_transferred":"0"}'
    text = (
        "HloModule m\n\nENTRY %main (p0: bf16[4,1024], p1: s32[1]) -> bf16[4,64] {\n"
        "  %p0 = bf16[4,1024]{1,0} parameter(0)\n  %p1 = s32[1]{0} parameter(1)\n"
        '  %k = bf16[4,64]{1,0} custom-call(%p1, %p0), custom_call_target="tpu_custom_call", '
        f'backend_config={{"custom_call_config":{{"cost_estimate":{cost}}}}}\n'
        "  ROOT %n = bf16[4,64]{1,0} negate(%k)\n}\n")
    rows = {row["name"]: (row["read"], row["written"]) for row in hlo_text.bytes_by_instruction(text)}
    assert rows == {"k": (2048, 0), "n": (512, 512)}


def test_the_hbm_bytes_leave_out_what_the_compiler_placed_on_chip():
    """Of the bytes estimate, ``hbm_read`` / ``hbm_written`` count only values in HBM: a copy-start that prefetches a
    weight into VMEM (``S(1)``) reads it from HBM once, an operation between VMEM values moves no HBM byte, and a
    result written back to HBM counts there; the plain estimate counts every operand and result as before."""
    from benchmarks import hlo_text

    text = (
        "HloModule m\n\nENTRY %main (w: bf16[64,64], x: bf16[4,64]) -> bf16[4,64] {\n"
        "  %w = bf16[64,64]{1,0} parameter(0)\n  %x = bf16[4,64]{1,0} parameter(1)\n"
        "  %cs = (bf16[64,64]{1,0:S(1)}, bf16[64,64]{1,0}, u32[]{:S(2)}) copy-start(%w)\n"
        "  %cd = bf16[64,64]{1,0:S(1)} copy-done(%cs)\n"
        "  %xv = bf16[4,64]{1,0:S(1)} copy(%x)\n"
        "  %d = bf16[4,64]{1,0:S(1)} dot(%xv, %cd), lhs_contracting_dims={1}, rhs_contracting_dims={0}\n"
        "  ROOT %n = bf16[4,64]{1,0} negate(%d)\n}\n")
    rows = {row["name"]: row for row in hlo_text.bytes_by_instruction(text)}
    hbm = {name: (row["hbm_read"], row["hbm_written"]) for name, row in rows.items()}
    assert hbm == {"cs": (8192, 0), "xv": (512, 0), "d": (0, 0), "n": (0, 512)}
    plain = {name: (row["read"], row["written"]) for name, row in rows.items() if name != "cs"}
    assert plain == {"xv": (512, 512), "d": (512 + 8192, 512), "n": (512, 512)}
    assert (rows["cs"]["read"], rows["cs"]["written"]) == (0, 0)  # the plain estimate keeps copies free


def _ppojax_names_taken(path: Path):
    """(line, ppojax module, name) for every name ``path`` takes from a ppojax module, wherever its imports stand:
    ``from ppojax.m import name`` and ``alias.name`` where ``alias`` is a ppojax module it imported."""
    tree = ast.parse(path.read_text())
    modules = {}  # local name -> the ppojax module it holds
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules.update({alias.asname: alias.name for alias in node.names
                            if alias.asname and alias.name.startswith("ppojax")})
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("ppojax") and node.level == 0:
            for alias in node.names:
                yield node.lineno, node.module, alias.name
                if _is_submodule(node.module, alias.name):
                    modules[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in modules:
            yield node.lineno, modules[node.value.id], node.attr


def _is_submodule(package: str, name: str) -> bool:
    spec = importlib.util.find_spec(package)
    return (spec is not None and spec.submodule_search_locations is not None
            and importlib.util.find_spec(f"{package}.{name}") is not None)


def test_the_benchmarks_and_examples_name_only_what_ppojax_has():
    """The suite runs the benchmarks and examples only in part: every ppojax name they take (in an import inside a
    function too, or as a module's attribute) must still exist, so that a renamed or moved name fails here, not in
    the next benchmark run."""
    missing = []
    for path in sorted([*(REPO / "benchmarks").glob("*.py"), *(REPO / "examples").glob("*.py")]):
        for line, module, name in _ppojax_names_taken(path):
            if not (hasattr(importlib.import_module(module), name) or _is_submodule(module, name)):
                missing.append(f"{path.relative_to(REPO)}:{line}: {module}.{name}")
    assert missing == []

