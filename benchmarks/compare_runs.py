"""Several finished runs side by side: a table of their held-out scores, KL and training time, and one
PNG with their score and KL curves overlaid (e.g. the demo under float32 and under ``precision: mixed``).

    python -m benchmarks.compare_runs outputs/demo_now=float32 outputs/demo_mixed=mixed \
        --png docs/demo_precision.png

Reads each run's ``summary.json`` and ``metrics.jsonl`` (peak RSS is measured outside, e.g. ``/usr/bin/time -v``).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

KEYS = ("objective/scores", "objective/kl")


def load(run_dir: Path) -> dict:
    from ppojax.io.run_logging import read_jsonl

    return {"summary": json.loads((run_dir / "summary.json").read_text()),
            "rows": read_jsonl(run_dir / "metrics.jsonl")}


def table(runs: dict) -> str:
    lines = ["| run | held-out before → after | batch score, last 5 updates | final KL | train s | steady episodes/s |",
             "|---|---|---|---|---|---|"]
    for name, run in runs.items():
        s, rows = run["summary"], run["rows"]
        last = [r["objective/scores"] for r in rows[-5:]]
        lines.append(f"| {name} | {s['held_out_mean_score_before']:.2f} → {s['held_out_mean_score_after']:.2f} | "
                     f"{sum(last) / len(last):.2f} | {s['final_kl']:.2f} | {s['train_seconds']:.0f} | "
                     f"{s['episodes_per_second_steady']:.2f} |")
    return "\n".join(lines)


def figure(runs: dict, png: Path) -> None:
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(10, 4), layout="constrained")
    axes = fig.subplots(1, len(KEYS))
    for ax, key in zip(axes, KEYS):
        for name, run in runs.items():
            steps = [r["step"] for r in run["rows"]]
            ax.plot(steps, [r[key] for r in run["rows"]], label=name, marker=".")
        ax.set_xlabel("update")
        ax.set_ylabel(key)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        ax.legend()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, format="png", dpi=80)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", help="RUN_DIR=NAME (NAME labels the run in the table and the plot)")
    parser.add_argument("--png", default=None, help="write the overlaid curves here")
    args = parser.parse_args()
    runs = {}
    for spec in args.runs:
        path, _, name = spec.partition("=")
        runs[name or Path(path).name] = load(Path(path))
    print(table(runs))
    if args.png:
        figure(runs, Path(args.png))
        print(f"wrote {args.png}")


if __name__ == "__main__":
    main()
