"""Command line: ``ppojax train CONFIG.yaml [key=value ...]`` and ``ppojax export CHECKPOINT OUT_DIR``.

``train`` runs a whole job: load (and if needed fetch/convert) the models, evaluate the held-out prompts,
train with logs, samples and checkpoints, evaluate again, then write the trained policy in Hugging Face
format, a plot of score and KL, and ``summary.json`` into ``output_dir``.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from .config import ConfigError, PPOConfig, field_help
from .host_memory import keep_freed_memory


def _help_epilog() -> str:
    lines = ["config fields (YAML keys, or key=value overrides):"]
    for name, default, doc in field_help():
        lines.append(f"  {name} (default {default})")
        if doc:
            lines.append(f"      {doc}")
    return "\n".join(lines)


def run_training(config: PPOConfig) -> dict:
    """The whole job for one config. Returns the summary written to ``output_dir/summary.json``."""
    from . import sharding
    from .run_logging import RunLogger, stage
    from .trainer import PPOTrainer

    start = time.time()
    if config.reward_function is None and config.reward_model_path is None:
        from .train.build import NO_REWARD
        raise ConfigError(NO_REWARD)
    out = Path(config.output_dir)
    with stage(f"building models, data and the reward for {config.model_name_or_path!r}"):
        trainer = PPOTrainer(config)
    print(f"ppojax: {len(trainer.train_queries)} training prompts, "
          f"{0 if trainer.eval_queries is None else len(trainer.eval_queries)} held out; "
          f"{trainer.num_updates} updates of {trainer.run.settings.batch_size} prompts x {config.response_length} "
          "tokens")
    if trainer.run.compilation_cache_dir is not None:
        print(f"ppojax: compiled programs are cached in {trainer.run.compilation_cache_dir} (a re-run with the same "
              "shapes skips compiling; compilation_cache_dir=none turns this off)")
    resumed = trainer.resume(config.resume) if config.resume else None
    start_step = int(trainer.state.update_count)
    if resumed:
        print(f"ppojax: resumed from {resumed} at update {start_step}")
    trainer.logger = RunLogger(out, config, report_to=config.report_to,
                               resume_step=start_step if resumed else None)
    before = None
    before_path = out / "eval_before.json"
    if resumed and before_path.is_file():  # the untrained policy was scored when the run started
        before = json.loads(before_path.read_text())
        print(f"ppojax: held-out mean score before training (from {before_path}): {before['mean_score']:.4f}")
    elif trainer.eval_queries is not None:
        with stage("scoring held-out prompts before training (compiles the sampler the first time)"):
            before = trainer.evaluate(step=0)
        if before is not None:
            if sharding.is_main_process():
                before_path.write_text(json.dumps(before))
            print(f"ppojax: held-out mean score before training: {before['mean_score']:.4f}")
            trainer.logger.log_samples(0, before["prompts"][:4], before["completions"][:4], before["scores"][:4])
    with stage("training (the first update compiles the rollout and the update)"):
        t0 = time.time()
        history = trainer.train()
        train_seconds = time.time() - t0
    after = None
    if trainer.eval_queries is not None:
        with stage("scoring held-out prompts after training"):
            after = trainer.evaluate(step=trainer.num_updates)
        if after is not None:
            print(f"ppojax: held-out mean score after training: {after['mean_score']:.4f}")
            trainer.logger.log_samples(trainer.num_updates, after["prompts"][:4], after["completions"][:4],
                                       after["scores"][:4])
    with stage(f"saving the trained policy to {out / 'policy'} (Hugging Face format)"):
        trainer.save_model(out / "policy")
    export_check = None
    if trainer.eval_queries is not None and _torch_available():
        from .export_check import greedy_continuations_agree
        with stage("checking the export: transformers must write ppojax's greedy continuations"):
            export_check = greedy_continuations_agree(out / "policy", trainer, trainer.eval_queries[:4],
                                                      config.response_length)
        print(f"ppojax: transformers reproduces ppojax's greedy continuations: {export_check['agree']}")
    plot = trainer.logger.plot(out / "training_curves.png")
    trainer.logger.close()
    steady = [m["eps"] for m in history[1:]] or [m["eps"] for m in history]
    summary = {
        "model": config.model_name_or_path,
        "updates": int(trainer.state.update_count),
        "episodes": trainer.episode,
        "held_out_prompts": 0 if trainer.eval_queries is None else len(trainer.eval_queries),
        "held_out_mean_score_before": None if before is None else before["mean_score"],
        "held_out_mean_score_after": None if after is None else after["mean_score"],
        "final_kl": history[-1]["objective/kl"] if history else None,
        "final_mean_score": history[-1]["objective/scores"] if history else None,
        "kl_coef": trainer.kl_coef,
        "episodes_per_second_steady": sum(steady) / len(steady) if steady else None,
        "train_seconds": train_seconds,
        "wall_seconds": time.time() - start,
        "policy_dir": str(out / "policy"),
        "checkpoint_dir": str(trainer.checkpoint_dir),
        "plot": None if plot is None else str(plot),
        "export_greedy_match": None if export_check is None else export_check["agree"],
        "metrics": str(out / "metrics.jsonl"),
        "tensorboard": str(out / "tensorboard"),
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary, indent=2))
    return summary


def _torch_available() -> bool:
    import importlib.util
    return importlib.util.find_spec("torch") is not None


def export_checkpoint(checkpoint: str, out_dir: str) -> Path:
    """Write the policy of a training checkpoint as a Hugging Face directory."""
    from .checkpoint import CONFIG_FILE, latest_checkpoint
    from .trainer import PPOTrainer

    path = Path(checkpoint)
    if not (path / CONFIG_FILE).is_file():
        found = latest_checkpoint(path)
        if found is None:
            raise ConfigError(f"{checkpoint!r} is neither a checkpoint (step_N) nor a directory holding one.")
        path = found
    values = json.loads((path / CONFIG_FILE).read_text())
    config = PPOConfig.from_dict({**values, "resume": None})
    trainer = PPOTrainer(config)
    trainer.resume(str(path))
    return trainer.save_model(out_dir)


def main(argv=None) -> int:
    keep_freed_memory()  # before JAX starts its threads (ppojax/host_memory.py)
    parser = argparse.ArgumentParser(prog="ppojax", description="PPO for language models in JAX.")
    commands = parser.add_subparsers(dest="command", required=True)
    train = commands.add_parser("train", help="run PPO from a YAML config", epilog=_help_epilog(),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    train.add_argument("config", help="YAML config (see configs/)")
    train.add_argument("overrides", nargs="*", help="key=value overrides of config fields")
    export = commands.add_parser("export", help="write a checkpoint's policy in Hugging Face format")
    export.add_argument("checkpoint", help="a step_N checkpoint, or output_dir/checkpoints")
    export.add_argument("out_dir")
    args = parser.parse_args(argv)
    try:
        if args.command == "train":
            run_training(PPOConfig.from_yaml(args.config, args.overrides))
        else:
            print(export_checkpoint(args.checkpoint, args.out_dir))
    except ConfigError as err:
        print(f"ppojax: error: {err}", file=sys.stderr)
        return 2
    except Exception as err:  # the run's own clear errors: a message, not a traceback
        from .checkpoint import CheckpointError
        from .rewards import RewardFunctionError
        if not isinstance(err, (CheckpointError, RewardFunctionError, FloatingPointError)):
            raise
        print(f"ppojax: error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
