"""docs/scaling.md's plan table: each row's ``train_step`` compiled by the TPU compiler for a TPU slice
(``ppojax plan --target tpu:...``), with XLA:CPU's estimate of the same program on as many virtual CPU devices
beside it (``--target cpu``). A measurement of compiles (no TPU needed; libtpu installed: pip install
'ppojax[tpu]'); run it by hand, not in the tests, which check the table against its JSON and recompile the 1B rows
on request (tests/test_plan_table.py).

    python -m benchmarks.plan_table --search        # each model and method's candidate meshes (PPO, 1k responses)
    python -m benchmarks.plan_table                 # every row not compiled yet (JSON under benchmarks/plans_tpu/),
                                                    # then the tables into docs/scaling.md
    python -m benchmarks.plan_table --rows 1b --force   # compile the 1B rows again
    python -m benchmarks.plan_table --render        # the tables from the stored JSON only

``LONG_ROWS`` (4k responses that do not fit their group's v5e slice, on v5p chips) get a table of their own.

Every row runs ``configs/plan.yaml`` (bfloat16, remat full, prompt 512, 8 gradient-accumulation steps, 4 epochs)
with the row's own arguments, printed in its command column: a rollout batch of 8 rows per chip of the slice
(``batch_size``), so every mesh of a slice runs the same batch.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parents[1]
PLANS = REPO / "benchmarks/plans_tpu"
DOC = REPO / "docs/scaling.md"
START, END = "<!-- plan-table:start -->", "<!-- plan-table:end -->"
SEARCH_START, SEARCH_END = "<!-- plan-meshes:start -->", "<!-- plan-meshes:end -->"
COMMAND = "ppojax plan configs/plan.yaml --programs train_step"
GIB = 2 ** 30

MODELS = {"1b": ("llama-3.2-1b", "Llama-3.2-1B"), "8b": ("llama-3.1-8b", "Llama-3.1-8B"),
          "70b": ("llama-3.1-70b", "Llama-3.1-70B")}


@dataclasses.dataclass(frozen=True)
class Row:
    """One plan: model size, full or LoRA (rank 16, every projection), PPO with a critic (TRL's separate value
    model when full, the value head on the adapted policy under LoRA) or GRPO (4 samples per prompt, no critic),
    the response length, and the slice and mesh it is compiled for (``chips`` its TPU chips)."""

    size: str
    lora: bool
    algorithm: str
    response: int
    target: str
    mesh: str

    @property
    def key(self) -> str:
        return (f"{self.size}-{'lora' if self.lora else 'full'}-{self.algorithm}-{self.response // 1024}k-"
                f"{self.target.split(':', 1)[1].replace(':', '-')}-{self.mesh.replace(',', '.')}")

    @property
    def chips(self) -> int:
        from ppojax.trainer.plan_targets import parse_target
        return parse_target(self.target).chips

    def arguments(self, target: Optional[str] = None) -> list:
        """The row's ``ppojax plan`` arguments: 8 rollout rows per chip on every mesh of the slice (so meshes with
        tensor parallelism run the same batch as those without), 1 micro-batch row per chip."""
        args = ["--model", MODELS[self.size][0], "--target", target or self.target, "--mesh", self.mesh,
                f"batch_size={8 * self.chips}"]
        if self.response > 1024:  # one row per chip per rollout forward: XLA's attention holds [rows, H, S, S] scores
            args.append(f"local_rollout_forward_batch_size={self.chips}")
        if self.lora:
            args += ["--lora-rank", "16"] + (["value_head=policy"] if self.algorithm == "ppo" else [])
        if self.algorithm == "grpo":
            args += ["advantage_estimator=grpo", "num_generations=4"]
        return args + [f"response_length={self.response}"]


#: per model and method, the (slice, mesh) pairs tried on the PPO 1k row (``--search``), smallest slice first
CANDIDATES = {
    ("1b", False): [("tpu:v5e:2x2", "1,4,1"), ("tpu:v5e:2x2", "1,2,2"), ("tpu:v5e:2x2", "1,1,4"),
                    ("tpu:v5e:4x4", "1,16,1")],
    ("1b", True): [("tpu:v5e:2x2", "1,4,1"), ("tpu:v5e:2x2", "1,1,4")],
    ("8b", False): [("tpu:v5e:4x4", "1,8,2"), ("tpu:v5e:4x4", "1,4,4"), ("tpu:v5e:4x4", "1,2,8"),
                    ("tpu:v6e:4x4", "1,4,4")],
    ("8b", True): [("tpu:v5e:2x2", "1,1,4"), ("tpu:v5e:2x2", "1,2,2")],
    ("70b", False): [("tpu:v5p:4x4x4", "1,8,8"), ("tpu:v5p:4x4x4", "1,16,4")],
    ("70b", True): [("tpu:v5p:2x2x2", "1,1,8"), ("tpu:v5p:2x2x2", "1,2,4")],
}

#: the pair chosen from each group's candidates: the smallest slice where the PPO 1k row fits, and on it the mesh
#: with the lowest peak (tests/test_plan_table.py checks the choice against the stored compiles)
CHOSEN = {
    ("1b", False): ("tpu:v5e:2x2", "1,1,4"),
    ("1b", True): ("tpu:v5e:2x2", "1,1,4"),
    ("8b", False): ("tpu:v6e:4x4", "1,4,4"),
    ("8b", True): ("tpu:v5e:2x2", "1,1,4"),
    ("70b", False): ("tpu:v5p:4x4x4", "1,8,8"),
    ("70b", True): ("tpu:v5p:2x2x2", "1,1,8"),
}


def _rows() -> list:
    """The table's rows: each model and method on its chosen slice and mesh, PPO and GRPO, 1k and 4k responses."""
    return [Row(size, lora, algorithm, response, *CHOSEN[(size, lora)])
            for size, lora in CHOSEN for algorithm in ("ppo", "grpo") for response in (1024, 4096)]


ROWS = _rows()

#: 4k-response rows that do not fit their group's chosen slice, compiled again on a slice where they do: v5p chips
#: (95 GiB each) in place of v5e's 16 GiB, the same mesh and 8 rollout rows per chip
LONG_ROWS = [Row("8b", True, "ppo", 4096, "tpu:v5p:2x2x1", "1,1,4")]
LONG_START, LONG_END = "<!-- plan-long:start -->", "<!-- plan-long:end -->"


def candidate_rows() -> list:
    return [Row(size, lora, "ppo", 1024, target, mesh) for (size, lora), pairs in CANDIDATES.items()
            for target, mesh in pairs]


def best_candidate(size: str, lora: bool) -> Optional[tuple]:
    """From the stored compiles of the group's candidates: fits, fewest chips, lowest peak."""
    found = []
    for row in candidate_rows():
        plan, _ = stored(row)
        if (row.size, row.lora) == (size, lora) and plan is not None and plan["fits"]:
            found.append((plan["devices"], plan["peak_bytes"], (row.target, row.mesh)))
    return min(found)[2] if found else None


def compile_row(row: Row, target: Optional[str] = None, out: Optional[Path] = None, timeout: int = 3600) -> dict:
    """``ppojax plan`` for ``row`` (on ``target``, default the row's) in a fresh process -> its JSON."""
    out = out or PLANS / f"{row.key}{'' if target is None else '.cpu'}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-m", "ppojax.trainer.cli", "plan", str(REPO / "configs/plan.yaml"),
                           "--programs", "train_step", *row.arguments(target), "--json", str(out)],
                          capture_output=True, text=True, env=env, cwd=REPO, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"{row.key}: ppojax plan failed:\n{done.stderr[-3000:]}")
    return json.loads(out.read_text())


def _gib(n) -> str:
    return f"{n / GIB:.2f}"


def stale(plan: dict) -> bool:
    """A TPU compile stored without the compiler's own peak (``compiler_peak_bytes``, recorded since), refusals
    aside."""
    return any(not step.get("out_of_memory") and not step.get("compiler_peak_bytes") for step in plan["programs"])


def tpu_cells(plan: dict) -> list:
    """The columns a TPU compile decides (what tests/test_plan_table.py compares)."""
    (step,) = plan["programs"]
    if step.get("out_of_memory"):
        needed, available = step["out_of_memory"]
        memory = ["—", "—", f"needs **{_gib(needed)}**"]
        verdict = f"no ({_gib(available)})"
    else:
        memory = [_gib(plan["state_bytes"]), _gib(step["temp_bytes"]), f"**{_gib(step['peak_bytes'])}**"]
        verdict = f"{'yes' if plan['fits'] else 'no'} ({_gib(plan['hbm_bytes'])})"
    flops = "—" if step.get("flops") is None else f"{step['flops'] * plan['devices'] / 1e12:.4g}"
    return memory + [verdict, flops]


def cpu_cells(plan: Optional[dict]) -> list:
    if plan is None:
        return ["not compiled"]
    (step,) = plan["programs"]
    return [f"{_gib(step['peak_bytes'])} ({_gib(step['temp_bytes'])})"]


HEADER = ("| model | training | algorithm | response | target (chips) | mesh (data, fsdp, tensor) | state GiB / chip "
          "| temporaries GiB | peak GiB / chip | fits (HBM GiB) | XLA TFLOP (loop bodies once) | TPU compile s "
          "| XLA:CPU estimate: peak (temporaries) GiB | arguments after `$P` |")


def render_row(row: Row, plan: dict, cpu: Optional[dict]) -> str:
    (step,) = plan["programs"]
    training = "LoRA r=16" if row.lora else "full"
    algorithm = ("PPO, value head" if row.lora else "PPO, value model") if row.algorithm == "ppo" else "GRPO"
    cells = [MODELS[row.size][1], training, algorithm, f"{row.response // 1024}k",
             f"`{row.target}` ({plan['devices']})", f"({row.mesh.replace(',', ', ')})", *tpu_cells(plan),
             f"{step['compile_seconds']:.0f}", *cpu_cells(cpu), f"`{' '.join(row.arguments())}`"]
    return "| " + " | ".join(cells) + " |"


def stored(row: Row) -> tuple:
    tpu, cpu = PLANS / f"{row.key}.json", PLANS / f"{row.key}.cpu.json"
    return (json.loads(tpu.read_text()) if tpu.is_file() else None,
            json.loads(cpu.read_text()) if cpu.is_file() else None)


def render_table(rows=ROWS) -> str:
    lines = [HEADER, "|" + "---|" * HEADER.count(" | ") + "---|"]
    compilers = set()
    for row in rows:
        plan, cpu = stored(row)
        if plan is not None:
            lines.append(render_row(row, plan, cpu))
            compilers.add(plan["compiler"])
    lines.append("")
    lines.append(f"`P=\"{COMMAND}\"`; the estimate beside each row: the same arguments with `--target cpu`. "
                 f"Compiled by {', '.join(sorted(compilers)) or '?'}.")
    return "\n".join(lines)


def write_doc(table: str, start: str = START, end: str = END, doc: Path = DOC) -> None:
    text = doc.read_text()
    pattern = re.compile(re.escape(start) + ".*?" + re.escape(end), re.DOTALL)
    if not pattern.search(text):
        raise SystemExit(f"{doc} has no {start} ... {end} markers")
    doc.write_text(pattern.sub(lambda _: f"{start}\n{table}\n{end}", text))


def doc_rows(doc: Path = DOC) -> dict:
    """The table's rows in ``doc``, by their argument cell."""
    text = doc.read_text()
    table = text[text.index(START):text.index(END)]
    return {line.rsplit("| `", 1)[1].rstrip("` |"): line for line in table.splitlines()
            if line.startswith("| Llama")}


SEARCH_HEADER = "| model | training | target (chips) | mesh | peak GiB / chip (PPO, 1k) | fits | chosen |"


def render_search() -> str:
    lines = [SEARCH_HEADER, "|---|---|---|---|---|---|---|"]
    for row in candidate_rows():
        plan, _ = stored(row)
        if plan is None:
            continue
        peak = tpu_cells(plan)[2]
        chosen = "yes" if CHOSEN[(row.size, row.lora)] == (row.target, row.mesh) else ""
        lines.append(f"| {MODELS[row.size][1]} | {'LoRA r=16' if row.lora else 'full'} | `{row.target}` "
                     f"({plan['devices']}) | ({row.mesh.replace(',', ', ')}) | {peak} | "
                     f"{'yes' if plan['fits'] else 'no'} | {chosen} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="", help="only the rows whose key starts with this (e.g. 1b, 8b-lora)")
    parser.add_argument("--render", action="store_true", help="no compiles: the table from the stored JSON")
    parser.add_argument("--search", action="store_true", help="compile each group's candidate meshes (PPO 1k)")
    parser.add_argument("--force", action="store_true", help="compile again rows whose JSON is stored")
    parser.add_argument("--stale", action="store_true", help="compile again TPU rows stored without the compiler's "
                        "peak")
    parser.add_argument("--no-cpu", action="store_true", help="no XLA:CPU estimates")
    args = parser.parse_args(argv)
    if not args.render:
        rows = candidate_rows() if args.search else ROWS + LONG_ROWS
        for row in (r for r in rows if r.key.startswith(args.rows)):
            plan, cpu = stored(row)
            if plan is None or args.force or (args.stale and stale(plan)):
                plan = compile_row(row)
                print(render_row(row, plan, cpu), flush=True)
            if not args.no_cpu and not args.search and (cpu is None or args.force):
                compile_row(row, target="cpu")
    write_doc(render_table())
    write_doc(render_table(LONG_ROWS), LONG_START, LONG_END)
    write_doc(render_search(), SEARCH_START, SEARCH_END)
    return 0


if __name__ == "__main__":
    sys.exit(main())
