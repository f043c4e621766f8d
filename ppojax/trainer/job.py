"""The jobs the ``ppojax`` command runs: ``train`` (one config's whole run and its report) and ``export`` (a
checkpoint's policy in Hugging Face format).

``train``: claim ``output_dir``, build the run, score the held-out prompts, train with logs, samples and
checkpoints, score them again, write the trained policy in Hugging Face format (and its PEFT adapter under LoRA),
check the export against transformers, then a plot of score and KL and ``summary.json``.
"""
from __future__ import annotations

import importlib.util
import json
import time
from pathlib import Path
from typing import Optional

import jax
import numpy as np
from jax.experimental import multihost_utils

from ppojax.io.checkpoint import read_checkpoint_config, resolve_checkpoint
from ppojax.io.export_dir import ExportDirError, check_export_target
from ppojax.io.library_logs import LOG_FILE as LIBRARY_LOG_FILE, import_libraries_quietly, library_output_to
from ppojax.io.run_dir import claim_output_dir
from ppojax.io.run_logging import PLOT_KEYS, read_jsonl, stage
from ppojax.io.strict_json import write_json
from ppojax import parallel
from ppojax.trainer.config import ConfigError, PPOConfig, resume_compatibility
from ppojax.trainer.export_check import export_check_skipped, greedy_continuations_agree
from ppojax.trainer.ppo_trainer import PPOTrainer
from ppojax.trainer.preflight import preflight


def run_training(config: PPOConfig, printed_at_import: str = "") -> dict:
    """The whole job for one config. Returns the summary written to ``output_dir/summary.json``.

    The run first claims ``output_dir`` (``ppojax.io.run_dir``): a directory holding another run is refused
    before anything is loaded, and a finished run with the same config prints where its results are and
    changes nothing. printed_at_import: what :func:`ppojax.io.library_logs.import_libraries_quietly` returned
    when the caller (the ``ppojax`` program) called it first; kept in the run's libraries.log."""
    # before the reward function's module, which may import transformers: what transformers prints at import goes
    # to the run's file (a run refused before it claims output_dir, or one that has no file, leaves it out)
    printed_at_import += import_libraries_quietly()
    config.check_reward_source()
    parallel.initialize_distributed()  # the claim is process 0's: it needs to know which process it is
    preflight(config)  # what the models' config.json files and the devices refute, before anything is loaded
    claim = None
    if parallel.is_main_process():
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
        with library_output_to(Path(config.output_dir) / LIBRARY_LOG_FILE, printed_at_import):
            return _train_and_report(config, claim)
    finally:
        if claim is not None:
            claim.release()


def _all_processes_agree(flag: bool) -> bool:
    """Process 0's ``flag`` on every process (a no-op on one process)."""
    if jax.process_count() == 1:
        return flag
    return bool(multihost_utils.broadcast_one_to_all(np.int32(flag)))


def _train_and_report(config: PPOConfig, claim) -> dict:
    """Build, score, train, score again, export and report (the module doc's steps); the summary."""
    start = time.time()
    out = Path(config.output_dir)
    with stage(f"building models, data and the reward for {config.model_name_or_path!r}"
               + (" (the training step compiles alongside: compile_ahead)" if config.compile_ahead else "")):
        trainer = PPOTrainer(config, claim=claim)
    _announce(trainer, config)
    resumed = trainer.resume(config.resume) if config.resume else None
    if resumed:
        print(f"ppojax: resumed from {resumed} at update {int(trainer.state.update_count)}")
    logger = trainer.open_logger(resumed)
    exit_code = 1
    try:
        before = _held_out_before(trainer, out, logger)
        compiled_ahead = trainer.run.train_step is not None and trainer.train_step is trainer.run.train_step
        with stage("training (the first update " + ("waits for the training step's compile, started while the "
                                                    "models loaded)" if compiled_ahead else
                                                    "compiles the training step)")):
            t0 = time.time()
            history = trainer.train(samples_at_end=trainer.eval_queries is None)  # the scoring after logs them
            train_seconds = time.time() - t0
        after = _held_out_after(trainer, out, logger if history else None)  # None: nothing trained, none logged
        export_check = _export_and_check(trainer, config, out)
        reward_names = list((before or after or {}).get("rewards") or {})
        keys = list(PLOT_KEYS) + ([f"rewards/{name}/mean" for name in reward_names] if len(reward_names) > 1 else [])
        curve = held_out_curve(read_jsonl(out / "metrics.jsonl"), before, after, trainer.num_updates)
        plot = logger.plot(out / "training_curves.png", keys, held_out=curve)
        summary = _summary(trainer, config, before, after, history, plot, export_check, curve,
                           train_seconds=train_seconds, wall_seconds=time.time() - start)
        logger.write_summary(summary)
        print(json.dumps(summary, indent=2))
        exit_code = 0
    finally:
        logger.close(exit_code=exit_code)
    if claim is not None:
        claim.mark_finished()
    return summary


def _announce(trainer: PPOTrainer, config: PPOConfig) -> None:
    """What the run will do: its prompts, updates and batch, and where compiled programs are cached."""
    samples, generations = trainer.run.settings.batch.batch_size, config.num_generations
    per_update = (f"{samples // generations} prompts x {generations} samples" if generations > 1
                  else f"{samples} prompts")
    print(f"ppojax: {len(trainer.train_queries)} training prompts, "
          f"{0 if trainer.eval_queries is None else len(trainer.eval_queries)} held out; "
          f"{trainer.num_updates} updates of {per_update} x {config.response_length} tokens")
    if trainer.run.compilation_cache_dir is not None:
        print(f"ppojax: compiled programs are cached in {trainer.run.compilation_cache_dir} (a re-run with the same "
              "shapes skips compiling; compilation_cache_dir=none turns this off)")


def _held_out_before(trainer: PPOTrainer, out: Path, logger) -> Optional[dict]:
    """The untrained policy's held-out scores: read back where the run started before (its samples are logged
    then), else scored now and written to ``eval_before.json``; None without held-out prompts."""
    path = out / "eval_before.json"
    if path.is_file():
        before = json.loads(path.read_text())
        print(f"ppojax: held-out mean score before training (from {path}): {before['mean_score']:.4f}")
        return before
    if trainer.eval_queries is None:
        return None
    with stage("scoring held-out prompts before training (compiles the sampler the first time)"):
        before = trainer.evaluate(step=0)
    if before is not None:
        if parallel.is_main_process():
            write_json(path, before)
        print(f"ppojax: held-out mean score before training: {before['mean_score']:.4f}" + _per_reward(before))
        logger.log_samples(0, before["prompts"][:4], before["completions"][:4], before["scores"][:4])
    return before


def _held_out_after(trainer: PPOTrainer, out: Path, logger) -> Optional[dict]:
    """The trained policy's held-out scores, written to ``eval_after.json``; its first completions are the last
    update's sample table where ``logger`` is given (training left it to this: the same prompts, the same sampling
    key); None without held-out prompts."""
    if trainer.eval_queries is None:
        return None
    with stage("scoring held-out prompts after training"):
        after = trainer.evaluate(step=trainer.num_updates)
    if after is not None:
        if parallel.is_main_process():
            write_json(out / "eval_after.json", after)
        print(f"ppojax: held-out mean score after training: {after['mean_score']:.4f}{_per_reward(after)} "
              f"(completions: {out / 'eval_after.json'})")
        if logger is not None and trainer.args.num_sample_generations:
            logger.log_samples(trainer.num_updates, after["prompts"][:4], after["completions"][:4],
                               after["scores"][:4])
    return after


def _export_and_check(trainer: PPOTrainer, config: PPOConfig, out: Path) -> Optional[dict]:
    """Write ``policy/`` (and ``policy_adapter/`` under LoRA), then, where it applies, check that transformers
    writes ppojax's greedy continuations of a few held-out prompts from it; the check's result or None."""
    what = f" (merged) and its LoRA adapter to {out / 'policy_adapter'} (PEFT)" if config.lora_r else ""
    with stage(f"saving the trained policy to {out / 'policy'} (Hugging Face format){what}"):
        trainer.save_model(out / "policy")
    policy_size = sum(x.size for x in jax.tree.leaves(jax.eval_shape(lambda: trainer.policy_params)))
    skipped = export_check_skipped(config.export_check, held_out=trainer.eval_queries is not None,
                                   torch_available=importlib.util.find_spec("torch") is not None,
                                   num_params=policy_size)
    if skipped and config.export_check is None and trainer.eval_queries is not None:
        print(f"ppojax: the export is not checked against transformers: {skipped}")
    if skipped:
        return None
    with stage("checking the export: transformers must write ppojax's greedy continuations"):
        check = greedy_continuations_agree(
            out / "policy", trainer.policy_graphdef, trainer.policy_params, trainer.eval_queries[:4],
            config.response_length, pad_token_id=trainer.run.settings.sampling.pad_token_id,
            stop_token_id=trainer.run.settings.sampling.stop_token_id)
    if parallel.is_main_process():
        print(f"ppojax: transformers reproduces ppojax's greedy continuations: {check['agree']}")
    return check


def held_out_curve(rows, before: Optional[dict], after: Optional[dict], last_update: int) -> list:
    """[(update, held-out mean score)]: before training (update 0), each evaluation during training (the
    ``eval/mean_score`` of metrics.jsonl's rows, a resumed run's earlier ones included) and after it."""
    curve = [] if before is None else [(0, before["mean_score"])]
    curve += [(int(r["step"]), r["eval/mean_score"]) for r in rows if r.get("eval/mean_score") is not None]
    if after is not None:
        curve.append((last_update, after["mean_score"]))
    return curve


def _summary(trainer: PPOTrainer, config: PPOConfig, before, after, history: list, plot, export_check, curve, *,
             train_seconds: float, wall_seconds: float) -> dict:
    """``summary.json``: the run's results and where its outputs are."""
    out = Path(config.output_dir)
    rows = read_jsonl(out / "metrics.jsonl")  # the whole run's, a resumed run's earlier updates included
    steady = [r["eps"] for r in (history[1:] or history) if r.get("eps") is not None]
    return {
        "model": config.model_name_or_path,
        "updates": int(trainer.state.update_count),
        "episodes": trainer.episode,
        "held_out_prompts": 0 if trainer.eval_queries is None else len(trainer.eval_queries),
        "held_out_mean_score_before": None if before is None else before["mean_score"],
        "held_out_mean_score_after": None if after is None else after["mean_score"],
        # the held-out mean at every update it was scored (before, every eval_steps updates, after)
        "held_out_curve": [{"update": update, "mean_score": score} for update, score in curve],
        # each reward's mean over the held-out completions it applies to (accuracy and format apart)
        "held_out_rewards_before": None if before is None else before.get("rewards"),
        "held_out_rewards_after": None if after is None else after.get("rewards"),
        "final_kl": rows[-1].get("objective/kl") if rows else None,
        "final_mean_score": rows[-1].get("objective/scores") if rows else None,
        "kl_coef": trainer.kl_coef,
        "episodes_per_second_steady": sum(steady) / len(steady) if steady else None,
        "train_seconds": train_seconds,
        "wall_seconds": wall_seconds,
        "policy_dir": str(out / "policy"),
        "adapter_dir": str(out / "policy_adapter") if config.lora_r else None,
        "checkpoint_dir": str(trainer.checkpoint_dir),
        "plot": None if plot is None else str(plot),
        "export_greedy_match": None if export_check is None else export_check["agree"],
        "metrics": str(out / "metrics.jsonl"),
        "tensorboard": str(out / "tensorboard") if "tensorboard" in config.report_sinks else None,
    }


def _per_reward(result: dict) -> str:
    """' (gsm8k_strict 0.09, answer_format 0.44)' for a run with several rewards, else ''."""
    rewards = result.get("rewards") or {}
    if len(rewards) < 2:
        return ""
    return " (" + ", ".join(f"{name} {'n/a' if v is None else f'{v:.4f}'}" for name, v in rewards.items()) + ")"


def export_checkpoint(checkpoint: str, out_dir: str, adapter: bool = False) -> Path:
    """Write the policy of a training checkpoint (a step_N directory, a checkpoints directory or a run's
    output_dir: its newest intact checkpoint) as a Hugging Face directory (a LoRA run: the merged model, and
    its PEFT adapter in ``<out_dir>_adapter``); ``adapter``: only the PEFT adapter directory, in out_dir."""

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
