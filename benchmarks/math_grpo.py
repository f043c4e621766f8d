"""The math task on several seeds: `ppojax train configs/math_grpo.yaml` once per seed, one after another, then a
table of held-out accuracy and format rate before -> after and a plot of them.

    python -m benchmarks.math_grpo --seeds 0 1 2 --json out.json --plot docs/math_grpo.png
    python -m benchmarks.math_grpo --seeds 0 --variants grpo dapo gspo cispo --json objectives.json

Each run writes into outputs/math_grpo_seed<S> (resumed if it is there), or outputs/math_grpo_<variant>_seed<S>
with --variants: the policy objectives of VARIANTS on the same task, seeds and budget (each variant's overrides
after the config, before any given on the command line). The JSON holds, per run, the summary.json fields that
matter here (held-out rewards before and after, final KL, wall seconds), the dynamic-sampling figures where the
run used it (from metrics.jsonl) and the host.
"""
import argparse
import json
import subprocess
import sys
from pathlib import Path

from benchmarks.common import machine_info

REWARDS = ("gsm8k_strict", "gsm8k_flexible", "answer_format")
#: policy objectives to compare on the task, as config overrides (TRL GRPOConfig's names; docs/algorithm.md)
VARIANTS = {
    "grpo": ["loss_type=grpo"],
    # DAPO: clip-higher, token-mean, dynamic sampling (at most 3 rounds of prompts an update), overlong filtering and
    # the soft overlong punishment over the last 16 tokens, no KL
    "dapo": ["loss_type=dapo", "cliprange_high=0.28", "loss_agg_mode=token-mean", "filter_groups=true",
             "max_num_gen_batches=3", "mask_truncated_completions=true", "soft_punish_cache=16", "kl_loss_coef=0"],
    # GSPO: sequence-level importance ratios, with the paper's clip range (3e-4, 4e-4)
    "gspo": ["loss_type=grpo", "importance_sampling_level=sequence", "cliprange=3e-4", "cliprange_high=4e-4"],
    # CISPO: the clipped importance weight times the log-prob (MiniMax-M1), epsilon_high 5 as TRL's docs
    "cispo": ["loss_type=cispo", "cliprange_high=5.0", "loss_agg_mode=token-mean"],
}
LABELS = {"gsm8k_strict": "accuracy (strict: '#### n')", "gsm8k_flexible": "accuracy (flexible: last number)",
          "answer_format": "format rate ('#### n' present)"}


def run_seed(config: str, seed: int, output_root: Path, extra: list, variant: str | None = None) -> dict:
    out = output_root / (f"math_grpo_{variant}_seed{seed}" if variant else f"math_grpo_seed{seed}")
    overrides = [*(VARIANTS[variant] if variant else []), *extra]
    cmd = [sys.executable, "-m", "ppojax.trainer.cli", "train", config, f"seed={seed}", f"output_dir={out}", *overrides]
    print("running:", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)
    return run_record(out, seed, " ".join(cmd[2:]), variant)


def run_record(out: Path, seed: int, command: str, variant: str | None = None) -> dict:
    """What the table reads from a finished run's directory: summary.json's fields and, with dynamic sampling,
    its per-update figures from metrics.jsonl."""
    summary = json.loads((out / "summary.json").read_text())
    record = {"seed": seed, "variant": variant, "output_dir": str(out), "command": command,
              **{k: summary.get(k) for k in ("held_out_rewards_before", "held_out_rewards_after", "final_kl",
                                             "held_out_prompts", "updates", "train_seconds", "wall_seconds")}}
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    sampled = [r for r in rows if "dynamic_sampling/rounds" in r]
    if sampled:
        record["dynamic_sampling"] = {
            "updates": len(sampled),
            "batches_full": sum(r["dynamic_sampling/batch_full"] == 1 for r in sampled),
            "rounds": [r["dynamic_sampling/rounds"] for r in sampled],
            "groups_dropped": sum(r["dynamic_sampling/groups_dropped"] for r in sampled),
            "generated_over_trained_mean": sum(r["dynamic_sampling/generated_over_trained"] for r in sampled)
            / len(sampled)}
    return record


def plot(runs: list, path: Path) -> None:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9, 3.2), layout="constrained")
    for ax, name in zip(fig.subplots(1, len(REWARDS)), REWARDS):
        for run in runs:
            before, after = run["held_out_rewards_before"][name], run["held_out_rewards_after"][name]
            label = f"{run['variant']}, seed {run['seed']}" if run.get("variant") else f"seed {run['seed']}"
            ax.plot([0, 1], [100 * before, 100 * after], marker="o", label=label)
        ax.set_xticks([0, 1], ["before", "after"])
        ax.set_xlim(-0.3, 1.3)
        ax.set_ylim(0, 100)
        ax.set_ylabel("% of held-out problems")
        ax.set_title(LABELS[name], fontsize=9)
    fig.axes[0].legend(fontsize=8)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png", dpi=110)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/math_grpo.yaml")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--output-root", default="outputs")
    parser.add_argument("--json", required=True)
    parser.add_argument("--plot")
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS),
                        help="compare these policy objectives (each on every seed) instead of the config's own")
    parser.add_argument("overrides", nargs="*", help="config overrides (key=value) for every run")
    args = parser.parse_args()
    runs = [run_seed(args.config, seed, Path(args.output_root), args.overrides, variant)
            for variant in (args.variants or [None]) for seed in args.seeds]
    result = {"machine": machine_info(), "config": args.config, "runs": runs}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=2))
    if args.plot:
        plot(runs, Path(args.plot))
    for run in runs:
        b, a = run["held_out_rewards_before"], run["held_out_rewards_after"]
        name = f"{run['variant']}, seed {run['seed']}" if run["variant"] else f"seed {run['seed']}"
        print(f"{name}: " + ", ".join(f"{n} {100 * b[n]:.1f} -> {100 * a[n]:.1f}" for n in REWARDS)
              + f"; KL {run['final_kl']:.3f}; {run['wall_seconds']:.0f} s"
              + (f"; dynamic sampling: {run['dynamic_sampling']}" if "dynamic_sampling" in run else ""))


if __name__ == "__main__":
    main()
