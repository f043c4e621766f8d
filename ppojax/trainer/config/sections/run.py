"""The run section (where a run writes, its seed and its length) and the outputs section (logging, samples,
checkpoints and resuming, non-finite steps, metric sinks, the compilation cache, the export check)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

from ppojax.trainer.config.fields import IGNORED, MUST_MATCH, NON_EMPTY, Rule, above, at_least, one_of, setting

REPORT_SINKS = ("tensorboard", "wandb")
"""Where metrics go besides the always-written JSONL files; report_to also takes 'none' and 'all'."""


def _valid_report_to(v) -> bool:
    names = [v] if isinstance(v, str) else list(v)
    allowed = set(REPORT_SINKS) | {"none", "all"}
    return bool(names) and all(n in allowed for n in names) and ("none" not in names or len(names) == 1)


@dataclass
class RunSettings:
    """Where a run writes, its seed and how long it trains."""

    output_dir: str = setting("outputs/ppojax", static=False, on_resume=IGNORED, rule=NON_EMPTY)
    """Directory of the run: logs, samples, checkpoints/, the trained policy/ and summary.json."""
    run_name: Optional[str] = setting(None, static=False, on_resume=IGNORED)
    """Name of the run in TensorBoard / wandb (None: the output_dir's name)."""
    seed: int = setting(0, static=False, on_resume=MUST_MATCH, rule=Rule(
        lambda v: 0 <= v < 2**31, "an integer in [0, 2147483647]",
        "Fix: use a seed in that range (JAX keys take 32 bits: a larger seed would silently give another "
        "seed's stream)."))
    """Seed of every random stream: initial value head, prompt order, sampling."""
    total_episodes: Optional[int] = setting(None, static=False, on_resume=IGNORED, rule=at_least(1))
    """Episodes (sampled responses: num_generations per prompt) to train on in all, rounded up to whole
    updates; None: num_train_epochs passes over the data."""
    num_train_epochs: float = setting(1.0, static=False, on_resume=IGNORED, rule=above(0))
    """Passes over the training prompts when total_episodes is None (may be fractional)."""


@dataclass
class OutputSettings:
    """What a run logs and saves, how it resumes, and when it stops on non-finite values."""

    logging_steps: int = setting(1, static=False, on_resume=IGNORED, rule=Rule(
        lambda v: v >= 1, "an integer >= 1",
        "Fix: give a number of updates (TRL's fractional logging_steps, a share of the run, is not supported)."))
    """Log metrics (metrics.jsonl, TensorBoard, wandb) every N updates."""
    num_sample_generations: int = setting(10, static=False, on_resume=IGNORED, rule=at_least(0))
    """How many times during training to print sample completions (near-greedy, T = 0.01); 0: never."""
    eval_steps: int = setting(0, static=False, on_resume=IGNORED, rule=at_least(0))
    """Score the held-out prompts (num_eval_prompts, near-greedy) every N updates during training, besides before
    and after it (0: only before and after; Hugging Face's eval_steps). Each score is logged as eval/mean_score
    (and eval/rewards/<name>/mean), drawn in training_curves.png and listed in summary.json (held_out_curve)."""
    save_steps: int = setting(0, static=False, on_resume=IGNORED, rule=at_least(0))
    """Checkpoint every N updates (0: only at the end)."""
    save_total_limit: int = setting(3, static=False, on_resume=IGNORED, rule=Rule(
        lambda v: v >= 1, "an integer >= 1",
        "Fix: set save_total_limit to an integer >= 1 (the default is 3); to keep every checkpoint, to more than "
        "the run's saves."))
    """Checkpoints kept in output_dir/checkpoints (the oldest are deleted)."""
    resume: Optional[str] = setting(None, static=False, on_resume=IGNORED, rule=NON_EMPTY)
    """None (or false): start fresh; 'auto' (or true): resume from the latest checkpoint in output_dir, or
    start fresh when there is none; or the path of a checkpoint."""
    overwrite_output_dir: bool = setting(False, static=False, on_resume=IGNORED)
    """Start a fresh run even though output_dir holds another run: the old run is moved aside to
    '<output_dir>.replaced-<UTC time>' (never deleted). Hugging Face TrainingArguments' name."""
    resume_with_changes: bool = setting(False, static=False, on_resume=IGNORED)
    """Let a resume continue a run whose tunable settings (learning rate, clip ranges, ...) differ from the
    saved run's; without it such a resume is refused with the list of changes (fields that must match are
    always refused)."""
    max_nonfinite_steps: int = setting(3, static=False, on_resume=IGNORED, rule=at_least(1))
    """Stop after this many optimizer steps in a row skipped for a non-finite loss or gradient."""
    on_nonfinite_reward: str = setting("error", static=True, on_resume=IGNORED, rule=one_of("error", "skip"))
    """A reward function returning NaN/inf: 'error' stops with a message naming the prompt; 'skip' lets it
    through, so every optimizer step of that update is skipped (counted in ppo/nonfinite_total) and the run
    goes on. 'skip' needs max_nonfinite_steps > num_ppo_epochs * num_mini_batches (the steps of one update)."""
    report_to: Union[str, list[str]] = setting("tensorboard", static=False, on_resume=IGNORED, rule=Rule(
        _valid_report_to, "'tensorboard', 'wandb', 'none', 'all', or a list of 'tensorboard' and 'wandb'",
        "Fix: e.g. report_to: [tensorboard, wandb]; metrics.jsonl is always written."))
    """Metric sinks besides metrics.jsonl: 'tensorboard', 'wandb', a list of them, 'all' (every installed
    one) or 'none'."""
    compilation_cache_dir: Optional[str] = setting("auto", static=False, on_resume=IGNORED)
    """JAX's persistent compilation cache: a later run (a resume, a re-run with the same shapes) loads the
    compiled programs instead of compiling them again (on CPU also those that call Python, a Python reward function
    or an agent's environment; on GPU and TPU such a run compiles its iteration again, docs/performance.md).
    'auto' (or None): $JAX_COMPILATION_CACHE_DIR if set, else ~/.cache/ppojax/xla; a path; or 'none' (off)."""
    compile_ahead: bool = setting(False, static=False, on_resume=IGNORED)
    """Compile the training step on a background thread while the weights load: the models' shapes come
    from the checkpoints' configs first, and the first update waits for that compile instead of starting
    it. Pays where loading waits on storage (large checkpoints) or cores are idle; on a host whose cores the
    load and XLA's compile both keep busy it gains little and raises the peak memory of the build by the
    compile's."""

    export_check: Optional[bool] = setting(None, static=False, on_resume=IGNORED)
    """After `ppojax train` saves the policy, transformers (torch) loads the export and greedy-decodes a few
    held-out prompts, which must give ppojax's own greedy continuations (summary.json: export_greedy_match).
    None (auto): when torch is installed, the run holds out prompts and the policy has at most 3e9 parameters
    (the check holds the whole export in float32 in the main process's memory and decodes on its CPU); true:
    always (needs torch and num_eval_prompts > 0); false: never."""
