"""Command line: ``ppojax train CONFIG.yaml [key=value ...]``, ``ppojax export CHECKPOINT OUT_DIR [--adapter]``
and ``ppojax plan CONFIG.yaml --model PRESET|DIR --devices N --mesh d,f,t`` (memory / FLOP plan, no weights).

``train`` and ``export`` run the jobs of ``ppojax.trainer.job``. A program's start comes first
(``ppojax.backends.prepare_process``: the platform, the allocator re-exec), then the config is read, then XLA's
options for this CPU and the run's precision (``prepare_compiler``), and only then is JAX imported: it reads its
options once, when its backend starts. So this module imports the jobs and the plan where they run.
"""
from __future__ import annotations

import argparse
import errno
import signal
import sys
from pathlib import Path

from ppojax import backends
from ppojax.errors import CheckpointError, ExportDirError, RewardFunctionError, RunInterrupted
from ppojax.io.library_logs import import_libraries_quietly
from ppojax.io.strict_json import write_json
from ppojax.trainer.config import ConfigError, PPOConfig, alias_help, field_help, trl_grpo_reading


def _help_epilog() -> str:
    lines = ["config fields (YAML keys, or key=value overrides):"]
    for name, default, doc in field_help():
        lines.append(f"  {name} (default {default})")
        if doc:
            lines.append(f"      {doc}")
    lines.append("other libraries' names (legacy TRL, TRL's GRPO / RLOO, verl), read as:")
    lines += [f"  {key} -> {meaning}" for key, meaning in alias_help()]
    lines.append(f"  {trl_grpo_reading()}")
    return "\n".join(lines)


def run_plan(args) -> None:
    """``ppojax plan``: check the inputs, set up the target's devices (virtual CPU devices BEFORE JAX starts, or a
    TPU slice's compile-only devices), then compile and print the plan."""
    from ppojax.trainer import plan, plan_targets  # noqa: PLC0415 - JAX after XLA's options (module doc)

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
        if args.command == "plan":
            run_plan(args)
        else:
            # what the libraries print while being imported (transformers' advice, without torch, that its models
            # need it) is not ppojax's to show: a run keeps it in its libraries.log
            printed_at_import = import_libraries_quietly()
            from ppojax.trainer import job  # noqa: PLC0415 - JAX after XLA's options (module doc)

            if args.command == "train":
                output_dir = Path(config.output_dir)
                job.run_training(config, printed_at_import)
            else:
                print(job.export_checkpoint(args.checkpoint, args.out_dir, adapter=args.adapter))
    except ConfigError as err:
        print(f"ppojax: error: {err}", file=sys.stderr)
        return 2
    except Exception as err:  # the run's own clear errors: a message, not a traceback
        if isinstance(err, RunInterrupted):
            print(f"ppojax: {err}", file=sys.stderr)
            return err.exit_code
        if isinstance(err, OSError) and err.errno in DISK_FULL:
            print(f"ppojax: error: {_disk_full_message(err, output_dir)}", file=sys.stderr)
            return 1
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
    from ppojax.io.checkpoint import latest_checkpoint  # noqa: PLC0415 - JAX after XLA's options (module doc)

    checkpoint = latest_checkpoint(output_dir / "checkpoints", log=lambda line: None)
    if checkpoint is None:
        return (f"{what} No checkpoint was written yet; free space and start again (overwrite_output_dir=true "
                f"moves the unfinished run in {output_dir} aside).")
    return (f"{what} The last complete checkpoint, {checkpoint}, is intact; free space and continue with "
            "resume=auto.")


if __name__ == "__main__":
    sys.exit(main())
