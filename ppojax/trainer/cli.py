"""Command line: ``ppojax train CONFIG.yaml [key=value ...]``, ``ppojax export CHECKPOINT OUT_DIR [--adapter]``
and ``ppojax plan CONFIG.yaml --model PRESET|DIR --devices N --mesh d,f,t`` (memory / FLOP plan, no weights).

``train`` runs a whole job: load (and if needed fetch/convert) the models, evaluate the held-out prompts,
train with logs, samples and checkpoints, evaluate again, then write the trained policy in Hugging Face
format, a plot of score and KL, and ``summary.json`` into ``output_dir``.
"""
from __future__ import annotations

import argparse
import errno
import json
import signal
import sys
import time
from pathlib import Path

from ppojax import backends
from ppojax.trainer.config import ConfigError, PPOConfig, field_help
from ppojax.io.library_logs import LOG_FILE as LIBRARY_LOG_FILE, library_output_to


def _help_epilog() -> str:
    lines = ["config fields (YAML keys, or key=value overrides):"]
    for name, default, doc in field_help():
        lines.append(f"  {name} (default {default})")
        if doc:
            lines.append(f"      {doc}")
    return "\n".join(lines)


def run_training(config: PPOConfig) -> dict:
    """The whole job for one config. Returns the summary written to ``output_dir/summary.json``.

    The run first claims ``output_dir`` (``ppojax.io.run_dir``): a directory holding another run is refused
    before anything is loaded, and a finished run with the same config prints where its results are and
    changes nothing."""
    from ppojax.parallel import sharding
    from ppojax.trainer.config import resume_compatibility
    from ppojax.io.run_dir import claim_output_dir

    from ppojax.trainer.build import preflight

    config.check_reward_source()
    sharding.initialize_distributed()  # the claim is process 0's: it needs to know which process it is
    preflight(config)  # what the models' config.json files and the devices refute, before anything is loaded
    claim = None
    if sharding.is_main_process():
        claim = claim_output_dir(config.output_dir, config.to_dict(), resume=config.resume,
                                 overwrite=config.overwrite_output_dir,
                                 resume_with_changes=config.resume_with_changes, compatible=resume_compatibility)
    try:
        if _all_processes_agree(claim is not None and claim.outcome == "finished"):
            if claim is not None:
                print(claim.results_message())
            summary_path = Path(config.output_dir) / "summary.json"
            return json.loads(summary_path.read_text()) if summary_path.is_file() else {}
        if claim is None:  # another process of a multi-process run: its libraries' output stays where it was
            return _train_and_report(config, claim)
        # what other libraries log or warn during the run goes to the run's own file, not the terminal
        with library_output_to(Path(config.output_dir) / LIBRARY_LOG_FILE):
            return _train_and_report(config, claim)
    finally:
        if claim is not None:
            claim.release()


def _all_processes_agree(flag: bool) -> bool:
    """Process 0's ``flag`` on every process (a no-op on one process)."""
    import jax
    if jax.process_count() == 1:
        return flag
    import numpy as np
    from jax.experimental import multihost_utils
    return bool(multihost_utils.broadcast_one_to_all(np.int32(flag)))


def _train_and_report(config: PPOConfig, claim) -> dict:
    from ppojax.parallel import sharding
    from ppojax.io.run_logging import stage
    from ppojax.io.strict_json import write_json
    from ppojax.trainer.ppo_trainer import PPOTrainer

    start = time.time()
    out = Path(config.output_dir)
    with stage(f"building models, data and the reward for {config.model_name_or_path!r}"
               + (" (the training step compiles alongside: compile_ahead)" if config.compile_ahead else "")):
        trainer = PPOTrainer(config, claim=claim)
    samples, generations = trainer.run.settings.batch.batch_size, config.num_generations
    per_update = (f"{samples // generations} prompts x {generations} samples" if generations > 1
                  else f"{samples} prompts")
    print(f"ppojax: {len(trainer.train_queries)} training prompts, "
          f"{0 if trainer.eval_queries is None else len(trainer.eval_queries)} held out; "
          f"{trainer.num_updates} updates of {per_update} x {config.response_length} tokens")
    if trainer.run.compilation_cache_dir is not None:
        print(f"ppojax: compiled programs are cached in {trainer.run.compilation_cache_dir} (a re-run with the same "
              "shapes skips compiling; compilation_cache_dir=none turns this off)")
    resumed = trainer.resume(config.resume) if config.resume else None
    if resumed:
        print(f"ppojax: resumed from {resumed} at update {int(trainer.state.update_count)}")
    logger = trainer.open_logger(resumed)
    exit_code = 1
    try:
        before = None
        before_path = out / "eval_before.json"
        if before_path.is_file():  # the untrained policy was scored when the run started (its samples are logged)
            before = json.loads(before_path.read_text())
            print(f"ppojax: held-out mean score before training (from {before_path}): {before['mean_score']:.4f}")
        elif trainer.eval_queries is not None:
            with stage("scoring held-out prompts before training (compiles the sampler the first time)"):
                before = trainer.evaluate(step=0)
            if before is not None:
                if sharding.is_main_process():
                    write_json(before_path, before)
                print(f"ppojax: held-out mean score before training: {before['mean_score']:.4f}"
                      + _per_reward(before))
                logger.log_samples(0, before["prompts"][:4], before["completions"][:4], before["scores"][:4])
        compiled_ahead = trainer.run.train_step is not None and trainer.train_step is trainer.run.train_step
        with stage("training (the first update " + ("waits for the training step's compile, started while the "
                                                    "models loaded)" if compiled_ahead else
                                                    "compiles the training step)")):
            t0 = time.time()
            history = trainer.train()
            train_seconds = time.time() - t0
        after = None
        if trainer.eval_queries is not None:
            with stage("scoring held-out prompts after training"):
                after = trainer.evaluate(step=trainer.num_updates)
            if after is not None:
                if sharding.is_main_process():
                    write_json(out / "eval_after.json", after)
                # not logged as samples: the sample hook logged the last update's completions of the same
                # held-out prompts at this step; eval_after.json holds them all
                print(f"ppojax: held-out mean score after training: {after['mean_score']:.4f}{_per_reward(after)} "
                      f"(completions: "
                      f"{out / 'eval_after.json'})")
        what = f" (merged) and its LoRA adapter to {out / 'policy_adapter'} (PEFT)" if config.lora_r else ""
        with stage(f"saving the trained policy to {out / 'policy'} (Hugging Face format){what}"):
            trainer.save_model(out / "policy")
        export_check = None
        import jax
        from ppojax.trainer.export_check import export_check_skipped, greedy_continuations_agree
        policy_size = sum(x.size for x in jax.tree.leaves(jax.eval_shape(lambda: trainer.policy_params)))
        skipped = export_check_skipped(config.export_check, held_out=trainer.eval_queries is not None,
                                       torch_available=_torch_available(), num_params=policy_size)
        if skipped and config.export_check is None and trainer.eval_queries is not None:
            print(f"ppojax: the export is not checked against transformers: {skipped}")
        if not skipped:
            with stage("checking the export: transformers must write ppojax's greedy continuations"):
                export_check = greedy_continuations_agree(
                    out / "policy", trainer.policy_graphdef, trainer.policy_params, trainer.eval_queries[:4],
                    config.response_length, pad_token_id=trainer.run.settings.sampling.pad_token_id,
                    stop_token_id=trainer.run.settings.sampling.stop_token_id)
            if sharding.is_main_process():
                print(f"ppojax: transformers reproduces ppojax's greedy continuations: {export_check['agree']}")
        from ppojax.io.run_logging import PLOT_KEYS
        reward_names = list((before or after or {}).get("rewards") or {})
        keys = list(PLOT_KEYS) + ([f"rewards/{name}/mean" for name in reward_names] if len(reward_names) > 1 else [])
        plot = logger.plot(out / "training_curves.png", keys, held_out_before=before and before["mean_score"],
                           held_out_after=after and after["mean_score"])
        from ppojax.io.run_logging import read_jsonl
        rows = read_jsonl(out / "metrics.jsonl")  # the whole run's, a resumed run's earlier updates included
        steady = [r["eps"] for r in (history[1:] or history) if r.get("eps") is not None]
        summary = {
            "model": config.model_name_or_path,
            "updates": int(trainer.state.update_count),
            "episodes": trainer.episode,
            "held_out_prompts": 0 if trainer.eval_queries is None else len(trainer.eval_queries),
            "held_out_mean_score_before": None if before is None else before["mean_score"],
            "held_out_mean_score_after": None if after is None else after["mean_score"],
            # each reward's mean over the held-out completions it applies to (accuracy and format apart)
            "held_out_rewards_before": None if before is None else before.get("rewards"),
            "held_out_rewards_after": None if after is None else after.get("rewards"),
            "final_kl": rows[-1].get("objective/kl") if rows else None,
            "final_mean_score": rows[-1].get("objective/scores") if rows else None,
            "kl_coef": trainer.kl_coef,
            "episodes_per_second_steady": sum(steady) / len(steady) if steady else None,
            "train_seconds": train_seconds,
            "wall_seconds": time.time() - start,
            "policy_dir": str(out / "policy"),
            "adapter_dir": str(out / "policy_adapter") if config.lora_r else None,
            "checkpoint_dir": str(trainer.checkpoint_dir),
            "plot": None if plot is None else str(plot),
            "export_greedy_match": None if export_check is None else export_check["agree"],
            "metrics": str(out / "metrics.jsonl"),
            "tensorboard": str(out / "tensorboard") if "tensorboard" in config.report_sinks else None,
        }
        logger.write_summary(summary)
        print(json.dumps(summary, indent=2))
        exit_code = 0
    finally:
        logger.close(exit_code=exit_code)
    if claim is not None:
        claim.mark_finished()
    return summary


def _per_reward(result: dict) -> str:
    """' (gsm8k_strict 0.09, answer_format 0.44)' for a run with several rewards, else ''."""
    rewards = result.get("rewards") or {}
    if len(rewards) < 2:
        return ""
    return " (" + ", ".join(f"{name} {'n/a' if v is None else f'{v:.4f}'}" for name, v in rewards.items()) + ")"


def _torch_available() -> bool:
    import importlib.util
    return importlib.util.find_spec("torch") is not None


def export_checkpoint(checkpoint: str, out_dir: str, adapter: bool = False) -> Path:
    """Write the policy of a training checkpoint (a step_N directory, a checkpoints directory or a run's
    output_dir: its newest intact checkpoint) as a Hugging Face directory (a LoRA run: the merged model, and
    its PEFT adapter in ``<out_dir>_adapter``); ``adapter``: only the PEFT adapter directory, in out_dir."""
    from ppojax.io.checkpoint import read_checkpoint_config, resolve_checkpoint
    from ppojax.io.export_dir import ExportDirError, check_export_target
    from ppojax.trainer.ppo_trainer import PPOTrainer

    def check_target(directory) -> None:  # before anything is loaded: exports never write among other files
        try:
            check_export_target(directory)
        except ExportDirError as err:
            raise ConfigError(str(err)) from None

    check_target(out_dir)
    path = resolve_checkpoint(checkpoint)
    if path is None:
        raise ConfigError(f"{checkpoint!r} holds no checkpoint (step_N) yet.")
    config = PPOConfig.from_dict({**read_checkpoint_config(path), "resume": None})
    if config.lora_r and not adapter:  # the merged model, and its adapter beside it
        check_target(Path(out_dir).with_name(Path(out_dir).name + "_adapter"))
    trainer = PPOTrainer(config)
    if adapter and config.lora_r == 0:
        raise ConfigError(f"--adapter: the run of {str(path)!r} trained every weight (lora_r=0), so it has no "
                          "adapter; export the whole policy without --adapter.")
    trainer.resume(str(path))
    return trainer.save_adapter(out_dir) if adapter else trainer.save_model(out_dir)


def run_plan(args) -> None:
    """``ppojax plan``: check the inputs, set up the target's devices (virtual CPU devices BEFORE JAX starts, or a
    TPU slice's compile-only devices), then compile and print the plan."""
    from ppojax.trainer import plan, plan_targets
    target = plan_targets.parse_target(args.target)
    mesh = plan.parse_mesh(args.mesh) if args.mesh else None
    noun = target.device_noun
    if not target.is_cpu and args.devices is not None and args.devices != target.chips:
        raise ConfigError(f"--devices {args.devices} with --target {target.text}: the target's devices are its "
                          f"{target.chips} {noun}s; leave --devices out.")
    if not target.is_cpu and args.hbm_gb is not None:
        raise ConfigError(f"--hbm-gb with --target {target.text}: the target's memory is its {noun}'s; leave "
                          "--hbm-gb out.")
    devices = target.chips if not target.is_cpu else args.devices or (mesh[0] * mesh[1] * mesh[2] if mesh else 1)
    if mesh and mesh[0] * mesh[1] * mesh[2] != devices:
        raise ConfigError(f"--mesh {args.mesh} has {mesh[0] * mesh[1] * mesh[2]} devices but the target has "
                          f"{devices}; make data * fsdp * tensor == {devices}.")
    if args.lora_rank is not None and args.lora_rank < 1:
        raise ConfigError(f"--lora-rank {args.lora_rank}: expected a rank >= 1.")
    programs = tuple(p.strip() for p in args.programs.split(",") if p.strip())
    unknown = [p for p in programs if p not in plan.PROGRAMS]
    if unknown or not programs:
        raise ConfigError(f"--programs {args.programs!r}: expected names among {', '.join(plan.PROGRAMS)}.")
    overrides = [*args.overrides, *([f"lora_r={args.lora_rank}"] if args.lora_rank is not None else [])]
    config = PPOConfig.from_yaml(args.config, overrides)
    model = args.model or config.model_name_or_path
    plan.model_config_for(model)  # a bad model name fails before the devices are set up
    plan_targets.check_available(target)
    if target.is_cpu:
        plan.use_virtual_devices(devices, config.precision)
    else:  # the host only traces: one CPU device; the target's compiler reads the program
        plan.use_host_for_tracing()
    result = plan.plan(config, model, mesh_shape=mesh, programs=programs,
                       target=plan_targets.load_target(target, hbm_gb=args.hbm_gb))
    print(plan.format_plan(result))
    if args.json:
        from ppojax.io.strict_json import write_json
        write_json(Path(args.json), result.to_dict())


def main(argv=None) -> int:
    if argv is None:  # run as the `ppojax` program (not main([...]) from Python): huge pages for XLA's buffers
        backends.prepare_process()  # the XLA:CPU options follow once the config is read
    # Past `ulimit -f`, a write fails with EFBIG (reported below) instead of the kernel killing the process.
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    parser = argparse.ArgumentParser(prog="ppojax", description="PPO for language models in JAX.")
    commands = parser.add_subparsers(dest="command", required=True)
    train = commands.add_parser("train", help="run PPO from a YAML config", epilog=_help_epilog(),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    train.add_argument("config", help="YAML config (see configs/)")
    train.add_argument("overrides", nargs="*", help="key=value overrides of config fields")
    export = commands.add_parser("export", help="write a checkpoint's policy in Hugging Face format")
    export.add_argument("checkpoint", help="a step_N checkpoint, or output_dir/checkpoints")
    export.add_argument("out_dir")
    export.add_argument("--adapter", action="store_true",
                        help="a LoRA run: write the PEFT adapter directory (adapter_config.json, "
                             "adapter_model.safetensors) instead of the merged model")
    plan = commands.add_parser("plan", help="compile the PPO programs ahead of time against abstract shapes for a "
                               "target (N virtual CPU devices, or a TPU slice through the TPU compiler) and print the "
                               "per-device memory, FLOPs and whether it fits")
    plan.add_argument("config", help="YAML config (batch sizes, lengths, precision, remat; see configs/plan.yaml)")
    plan.add_argument("overrides", nargs="*", help="key=value overrides of config fields")
    plan.add_argument("--model", help="a preset (smollm2-135m, llama-3.2-1b, llama-3.1-8b, qwen2.5-7b, "
                      "llama-3.1-70b) or a checkpoint directory's config.json (default: model_name_or_path)")
    plan.add_argument("--target", default="cpu",
                      help="what to compile for: cpu (XLA:CPU on --devices virtual devices: an estimate; the default) "
                      "or a TPU slice, tpu:<chip>:<topology>[:slices=K] with chip v5e, v5p or v6e, e.g. tpu:v5e:4x4 "
                      "(v5e-16), tpu:v5p:2x2x2 (v5p-16), tpu:v6e:8x8:slices=2 (needs libtpu: pip install "
                      "'ppojax[tpu]'; no TPU), or NVIDIA GPUs, gpu:h100x8, gpu:h200x8:hosts=2 (needs the CUDA plugin: "
                      "pip install 'ppojax[cuda]'; no GPU)")
    plan.add_argument("--devices", type=int, help="virtual CPU devices (default: the --mesh product, else 1)")
    plan.add_argument("--mesh", help="data,fsdp,tensor (default: the config's mesh_* fields)")
    plan.add_argument("--hbm-gb", type=float, help="--target cpu: memory per device in GB (1e9 bytes; default 80)")
    plan.add_argument("--lora-rank", type=int, help="LoRA adapters of rank r on the policy (= the override "
                      "lora_r=r; lora_target_modules chooses the projections, all-linear by default)")
    plan.add_argument("--programs", default="train_step,rollout,update",
                      help="comma-separated: train_step, rollout, update")
    plan.add_argument("--json", help="also write the plan as JSON to this file")
    args, extra = parser.parse_known_args(argv)
    if extra:  # key=value overrides given after an option (argparse stops the positional list there)
        if not hasattr(args, "overrides") or any(e.startswith("-") or "=" not in e for e in extra):
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        args.overrides += extra
    output_dir = None
    try:
        config = PPOConfig.from_yaml(args.config, args.overrides) if args.command == "train" else None
        if argv is None:  # before JAX starts its backend: the options recorded for this CPU and these matmuls
            backends.prepare_compiler(config.precision if config is not None else "float32")
        if args.command == "train":
            output_dir = Path(config.output_dir)
            run_training(config)
        elif args.command == "plan":
            run_plan(args)
        else:
            print(export_checkpoint(args.checkpoint, args.out_dir, adapter=args.adapter))
    except ConfigError as err:
        print(f"ppojax: error: {err}", file=sys.stderr)
        return 2
    except Exception as err:  # the run's own clear errors: a message, not a traceback
        from ppojax.io.checkpoint import CheckpointError
        from ppojax.rl.rewards import RewardFunctionError
        from ppojax.trainer.loop import RunInterrupted
        if isinstance(err, RunInterrupted):
            print(f"ppojax: {err}", file=sys.stderr)
            return err.exit_code
        if isinstance(err, OSError) and err.errno in DISK_FULL:
            print(f"ppojax: error: {_disk_full_message(err, output_dir)}", file=sys.stderr)
            return 1
        from ppojax.io.export_dir import ExportDirError
        if not isinstance(err, (CheckpointError, RewardFunctionError, FloatingPointError, ExportDirError)):
            raise
        print(f"ppojax: error: {err}", file=sys.stderr)
        return 2 if isinstance(err, RewardFunctionError) else 1  # 2: a mistake in the user's own function
    return 0


DISK_FULL = {errno.ENOSPC, errno.EFBIG, errno.EDQUOT}


def _disk_full_message(err: OSError, output_dir: Path | None) -> str:
    """One line for a write that failed for want of space: the file (or the run's directory) and what to do,
    which depends on whether the run has a complete checkpoint to continue from."""
    where = err.filename or (f"into {output_dir}" if output_dir is not None else "the output directory")
    what = f"{err.strerror} while writing {where}: the disk (or the file-size limit) is full."
    if output_dir is None:
        return f"{what} Free space and run again."
    from ppojax.io.checkpoint import latest_checkpoint
    checkpoint = latest_checkpoint(output_dir / "checkpoints", log=lambda line: None)
    if checkpoint is None:
        return (f"{what} No checkpoint was written yet; free space and start again (overwrite_output_dir=true "
                f"moves the unfinished run in {output_dir} aside).")
    return (f"{what} The last complete checkpoint, {checkpoint}, is intact; free space and continue with "
            "resume=auto.")


if __name__ == "__main__":
    sys.exit(main())
