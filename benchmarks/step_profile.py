"""Where one ``train_step`` of the PPO benchmark's work spends its time on the CPU: a ``jax.profiler`` trace of one
step, its XLA:CPU ops summed by kind.

    python -m benchmarks.step_profile [--size smollm2] [--precision float32|mixed] [--warm 2] [--optimizer optax]
        [--json F]

The work is ``benchmarks.ppojax_ppo``'s (``benchmarks/common.py``: policy, reference, reward and value models,
sampler log-probs, 4 epochs of one mini-batch). ``--warm`` steps run first (the first compiles), then one step is
traced. Each XLA op the trace records (its event carries ``hlo_op``) is put in one kind (``KINDS``, first match of
its name) and its time summed; the wrappers (thunk executor, thread-pool bookkeeping) are left out. Two rules
make the sums readable:

- **the optimizer step is what runs inside the conditional**: the update skips a non-finite step with ``lax.cond``,
  and every op whose instruction lies in a branch of a conditional (``conditional_branch_ops`` of the compiled
  HLO: the branch computations and what they call) is the optimizer (Adam of every trained model), whatever its
  name. Kinds by name alone mix them up: Adam's ``multiply_add`` fusions share their name with the forward's
  residual adds. (Until the sixteenth session the branch was found by time, as the ops inside executor events
  that start inside the ``cond`` event; that missed the ops a worker thread ran after the ``cond`` event ended,
  0.75 of Adam's 1.64 thread-seconds on SmolLM2, which went to "other element-wise".)
- Op times are summed over XLA's worker threads, which run independent ops at the same time: the shares are
  shares of the summed op time, not of the wall time (on SmolLM2 the sum is close to the step's wall time).
  Weight-gradient dots on Eigen return before their work ends (an asynchronous thunk): they look short and the
  ops beside them long.

Current figures per host: ``benchmarks/README.md``.
"""
from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import re
import tempfile
import time

from benchmarks import hlo_text as hlo_text_reader

#: (kind, name pattern) in the order they are tried; the first match names an op's kind.
KINDS = (
    ("matmuls", r"ynn_fusion|xnn_fusion|onednn|^dot|^custom-call|^ffi_call"),  # ffi_call: stacked_matmul's
    ("layer-scan weight slices", r"dynamic-slice"),  # copies of one layer's weights out of the stacked arrays
    ("stacked writes", r"dynamic-update-slice"),  # per-layer residuals / gradients / KV cache written into stacks
    ("transposes and copies", r"transpose|copy"),
    ("dtype conversions", r"convert"),
    ("zero-filled buffers", r"^wrapped_broadcast|^broadcast$"),
    ("reductions", r"reduce"),
    ("other element-wise", r""),
)
OPTIMIZER = "optimizer step (every op inside the conditional)"
#: events that are not ops: the executor's and the thread pool's own bookkeeping, ends of async ops, control flow
NOT_OPS = re.compile(r"^(ThunkExecutor|ThreadpoolListener|SlinkyThreadPool|end: |while$|cond$|conditional$|call$)")


def _base(name: str) -> str:
    return re.sub(r"[.\d]+$", "", name)


def kind_of(name: str) -> str:
    base = _base(name)
    return next(kind for kind, pattern in KINDS if re.search(pattern, base))


def conditional_branch_ops(hlo_text: str) -> set[str]:
    """The names of the instructions that run inside a conditional's branches: those of every branch computation of
    every ``conditional`` in the (compiled) HLO module ``hlo_text``, and of the computations those call."""
    module = hlo_text_reader.computations(hlo_text)
    branches = [name for lines in module.values() for line in lines if " conditional(" in line
                for name in hlo_text_reader.called(line)]
    return {hlo_text_reader.INSTRUCTION.match(line).group(1)
            for name in hlo_text_reader.reachable(module, branches) for line in module[name]}


def summarize_trace(events: list[dict], branch_ops: set[str]) -> dict:
    """Chrome-trace events (``traceEvents``) of one traced step -> the op time by kind. branch_ops: the names of the
    instructions inside conditional branches (:func:`conditional_branch_ops` of the traced program's HLO), whose
    ops are the optimizer's.

    Returns {"op_seconds": total, "kinds": {kind: {"seconds", "share", "ops"}}, "top_ops": [[name, seconds,
    count], ...], "cond_event_s": [...]} (shares of the summed op time)."""
    complete = [e for e in events if e.get("ph") == "X"]
    conds = [e for e in complete if _base(e["name"]) in ("cond", "conditional")]
    ops = [e for e in complete if "hlo_op" in e.get("args", {}) and not NOT_OPS.match(_base(e["name"]))]
    seconds = collections.defaultdict(float)
    count = collections.Counter()
    by_name = collections.defaultdict(float)
    by_name_count = collections.Counter()
    for e in ops:
        kind = OPTIMIZER if e["args"]["hlo_op"] in branch_ops else kind_of(e["name"])
        seconds[kind] += e["dur"] / 1e6
        count[kind] += 1
        by_name[_base(e["name"])] += e["dur"] / 1e6
        by_name_count[_base(e["name"])] += 1
    total = sum(seconds.values())
    kinds = {k: {"seconds": round(s, 4), "share": round(s / total, 4) if total else 0.0, "ops": count[k]}
             for k, s in sorted(seconds.items(), key=lambda kv: -kv[1])}
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[:15]
    return {"op_seconds": round(total, 4), "kinds": kinds,
            "top_ops": [[name, round(s, 4), by_name_count[name]] for name, s in top],
            "cond_event_s": [round(e["dur"] / 1e6, 4) for e in sorted(conds, key=lambda e: e["ts"])]}


def read_trace(directory: str) -> list[dict]:
    """The events of the one ``*.trace.json.gz`` that ``jax.profiler`` wrote under ``directory``."""
    files = glob.glob(f"{directory}/**/*.trace.json.gz", recursive=True)
    if len(files) != 1:
        raise RuntimeError(f"expected one trace under {directory}, found {len(files)}")
    with gzip.open(files[0]) as f:
        return json.load(f)["traceEvents"]


def profile(size: str, precision: str, warm: int, matmul: str = "auto", optimizer: str = "auto") -> dict:
    import jax
    import numpy as np

    from benchmarks import ppojax_ppo
    from benchmarks.common import make_config
    from ppojax.rl.program import _place, make_train_step

    config = dict(make_config(size, num_updates=max(2, warm + 1)), precision=precision, matmul_implementation=matmul,
                  optimizer_implementation=optimizer,
                  behaviour_logprobs="sampler")  # the benchmark's work: the sampler's log-probs, as TRL
    program, state, shardings = ppojax_ppo.build(config)
    batch = config["batch_size"]
    prompts = np.asarray(config["prompts"], np.int32)
    step = make_train_step(program, shardings)
    key = jax.random.key(config["seed"])

    def timed_step(u: int) -> float:
        nonlocal state
        start = time.perf_counter()
        state, metrics = step(state, prompts[u * batch:(u + 1) * batch], jax.random.fold_in(key, u))
        jax.block_until_ready((state, metrics))
        return time.perf_counter() - start

    step_s = [timed_step(u) for u in range(warm)]
    with tempfile.TemporaryDirectory(prefix="ppojax_step_profile_") as trace_dir:
        jax.profiler.start_trace(trace_dir)
        try:
            step_s.append(timed_step(warm))
        finally:
            jax.profiler.stop_trace()
        events = read_trace(trace_dir)
    # the traced program's instruction names (the trace's ``hlo_op``): jit's compiled executable, found again for
    # the arguments' shapes (not compiled a second time)
    hlo = step.jitted.lower(state, *_place(program, prompts[:batch], key)).compile().as_text()
    out = summarize_trace(events, conditional_branch_ops(hlo))
    return dict(out, size=size, precision=precision, matmul_implementation=matmul, optimizer_implementation=optimizer,
                jax=jax.__version__,
                step_s=[round(s, 3) for s in step_s],
                traced_step_s=round(step_s[-1], 3))


def main(argv=None) -> int:
    from benchmarks.common import SIZES, positive_int
    from ppojax.trainer.config import MATMUL_IMPLEMENTATIONS
    from ppojax.rl.optimizer import IMPLEMENTATIONS
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="smollm2")
    parser.add_argument("--precision", choices=("float32", "mixed"), default="float32")
    parser.add_argument("--warm", type=positive_int, default=2, help="steps before the traced one (the first compiles)")
    parser.add_argument("--matmul", choices=MATMUL_IMPLEMENTATIONS, default="auto",
                        help="the models' matmul_implementation (default: ppojax's)")
    parser.add_argument("--optimizer", choices=IMPLEMENTATIONS, default="auto",
                        help="optimizer_implementation (default: ppojax's)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    from ppojax.backends.cpu.program_start import start_program
    start_program(args.precision)  # as the ppojax command and the benchmark do (allocator, XLA:CPU options)
    from benchmarks.common import machine_info, write_report
    result = dict(profile(args.size, args.precision, args.warm, args.matmul, args.optimizer), machine=machine_info())
    print(f"{args.size} {args.precision}: steps {result['step_s']} s (the last traced); op time "
          f"{result['op_seconds']:.2f} s")
    for kind, figures in result["kinds"].items():
        print(f"  {figures['share']:6.1%} {figures['seconds']:8.3f} s {figures['ops']:7d} ops  {kind}")
    if args.json:
        write_report(args.json, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
