"""The math task on several seeds: `ppojax train configs/math_grpo.yaml` once per seed, one after another, then a
table of held-out accuracy and format rate before -> after and a plot of them.

    python -m benchmarks.math_grpo --seeds 0 1 2 --json out.json --plot docs/math_grpo.png

Each run writes into outputs/math_grpo_seed<S> (resumed if it is there). The JSON holds, per seed, the run's
summary.json fields that matter here (held-out rewards before and after, final KL, wall seconds) and the host.
"""
import argparse
import json
import subprocess
import sys
from pathlib import Path

from benchmarks.common import machine_info

REWARDS = ("gsm8k_strict", "gsm8k_flexible", "answer_format")
LABELS = {"gsm8k_strict": "accuracy (strict: '#### n')", "gsm8k_flexible": "accuracy (flexible: last number)",
          "answer_format": "format rate ('#### n' present)"}


def run_seed(config: str, seed: int, output_root: Path, extra: list) -> dict:
    out = output_root / f"math_grpo_seed{seed}"
    cmd = [sys.executable, "-m", "ppojax.trainer.cli", "train", config, f"seed={seed}", f"output_dir={out}", *extra]
    print("running:", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)
    summary = json.loads((out / "summary.json").read_text())
    return {"seed": seed, "output_dir": str(out), "command": " ".join(cmd[2:]),
            **{k: summary.get(k) for k in ("held_out_rewards_before", "held_out_rewards_after", "final_kl",
                                            "held_out_prompts", "updates", "train_seconds", "wall_seconds")}}


def plot(runs: list, path: Path) -> None:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9, 3.2), layout="constrained")
    for ax, name in zip(fig.subplots(1, len(REWARDS)), REWARDS):
        for run in runs:
            before, after = run["held_out_rewards_before"][name], run["held_out_rewards_after"][name]
            ax.plot([0, 1], [100 * before, 100 * after], marker="o", label=f"seed {run['seed']}")
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
    parser.add_argument("overrides", nargs="*", help="config overrides (key=value) for every run")
    args = parser.parse_args()
    runs = [run_seed(args.config, seed, Path(args.output_root), args.overrides) for seed in args.seeds]
    result = {"machine": machine_info(), "config": args.config, "runs": runs}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=2))
    if args.plot:
        plot(runs, Path(args.plot))
    for run in runs:
        b, a = run["held_out_rewards_before"], run["held_out_rewards_after"]
        print(f"seed {run['seed']}: " + ", ".join(f"{n} {100 * b[n]:.1f} -> {100 * a[n]:.1f}" for n in REWARDS)
              + f"; KL {run['final_kl']:.3f}; {run['wall_seconds']:.0f} s")


if __name__ == "__main__":
    main()
