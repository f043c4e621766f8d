"""PPOTrainer: TRL's two ways of running PPO, on top of one compiled ``train_step``.

- ``train()`` (TRL 1.x): prompts dataset -> ``train_step`` per batch (sampling, forwards, reward, update and
  the KL controller in ONE program) -> hooks: logging, sample completions, checkpoints.
- the legacy loop (TRL <= 0.11, ``ppojax.trainer.legacy``): ``generate(queries)``; ``step(queries, responses,
  scores)``.
- ``save_model(dir)``: the policy in Hugging Face format.

The parts: ``ppojax.trainer.build`` (config -> models, reward source, prompts, mesh, state, program),
``ppojax.trainer.loop`` (train_step + hooks), ``ppojax.trainer.legacy``. This class only wires them together and
keeps the run's state (``trainer.state``: a ``ppojax.rl.types.TrainState``).
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ppojax import core as ppo
from ppojax.io.checkpoint import CheckpointError, RunCheckpoints, read_checkpoint_config
from ppojax.io.run_dir import DirectoryLock, claim_output_dir
from ppojax.io.run_logging import RunLogger
from ppojax.models import save_pretrained
from ppojax.models.peft_io import save_peft_adapter
from ppojax.rl.actor_critic import sampling_weights
from ppojax.rl.rewards import NO_ROW, PADDING_ROW, FunctionScores, decode_rollout_text
from ppojax.rl import rollout
from ppojax import parallel
from ppojax.trainer.config import ConfigError, PPOConfig, resume_compatibility
from ppojax.trainer.build import NO_REWARD, build_run
from ppojax.trainer.legacy import LegacyAPI
from ppojax.errors import RunInterrupted
from ppojax.trainer.loop import (Hook, StopSignals, environment_check, fill_in_flight, nonfinite_check,
                                 on_policy_check, reward_failure_check, run_updates)
from ppojax.rl.disaggregated import DisaggregatedProgram, DisaggregatedStep
from ppojax.rl.program import make_fill, make_train_step

SAMPLE_TEMPERATURE = 0.01  # TRL's near-greedy sample completions
#: an agent run's evaluation plays this many batches' prompts per call on one batch's rows (the bank of prompts, one
#: KV row per prompt, is that many times a batch's)
AGENT_EVALUATION_BATCHES = 4


class PPOTrainer(LegacyAPI):
    """PPO on a policy, a frozen reference, a value function and a reward source.

    args: a :class:`PPOConfig`. processing_class: the tokenizer (loaded from the policy directory when
    None). model: a ppojax ``CausalLM`` (``CausalLMWithValueHead`` with value_head='policy'), or None to load
    ``args.model_name_or_path``. ref_model: a frozen reference (default: a copy of the initial policy).
    reward_model: a ppojax ``ScoreModel``, or a Python function ``f(prompts, completions) -> floats`` (TRL
    never took one), or None to use ``args``. value_model: a ``ScoreModel`` (default: the reward model's copy,
    as TRL, or the policy backbone + a new head when the reward is a function). train_dataset: prompts (list
    of str, datasets.Dataset, path; default ``args.dataset``); None is fine for the legacy ``step`` API.
    """

    def __init__(self, args: PPOConfig, processing_class=None, model=None, ref_model=None, reward_model=None,
                 train_dataset=None, value_model=None, *, reward_funcs=None, logger=None, claim=None):
        self.args = args
        # compile_ahead: the one-program step compiles on a background thread while the weights load
        self.run = build_run(args, processing_class, model, ref_model, reward_model, train_dataset, value_model,
                             reward_funcs=reward_funcs, compile_ahead=args.compile_ahead)
        self.train_step = self.run.train_step or make_train_step(self.run.program, self.run.state_shardings)
        if self.run.rollout_mesh is not None:  # rollout_devices: the rollout and the update on their own devices
            self.train_step = DisaggregatedStep(DisaggregatedProgram(self.run.program, self.run.rollout_mesh),
                                                self.run.state_shardings)
        self.logger = logger
        self.claim = claim  # the run's hold on output_dir (ppojax.io.run_dir); train() takes one if None
        # one CheckpointManager from the first save to the end of each train() (closed on errors and signals too)
        self.checkpoints = RunCheckpoints(self.checkpoint_dir, save_total_limit=args.save_total_limit,
                                          on_saved=self._checkpoint_on_disk)

    # ---- the run's parts, under the names TRL users know ----
    @property
    def state(self):
        return self.run.state

    @state.setter
    def state(self, value):
        self.run.state = value

    @property
    def tokenizer(self):
        return self.run.tokenizer

    @property
    def policy_graphdef(self):
        """The graphdef of :attr:`policy_params` (under LoRA: the base model's)."""
        actor_critic = self.run.program.actor_critic
        return actor_critic.base_graphdef if actor_critic.lora else actor_critic.policy_graphdef

    @property
    def policy_params(self):
        """The policy's weights as one model (under LoRA: the adapters merged into the base kernels)."""
        return sampling_weights(self.run.program.actor_critic, self.run.state.params, self.run.state.frozen)

    @property
    def kl_coef(self) -> float:
        return float(self.run.state.kl_coef)

    @property
    def episode(self) -> int:
        return int(self.run.state.episode)

    @property
    def num_updates(self) -> int:
        return self.run.num_updates

    @property
    def train_queries(self):
        return self.run.train_queries

    @property
    def eval_queries(self):
        return self.run.eval_queries

    @property
    def reward_fn(self):
        """The Python reward function f(prompts, completions) when the run has exactly one (None with a reward
        model or several functions); assignable."""
        return self.run.reward.fn if isinstance(self.run.reward, FunctionScores) else None

    @reward_fn.setter
    def reward_fn(self, fn):
        self.run.reward.fn = fn

    @property
    def checkpoint_dir(self) -> Path:
        return Path(self.args.output_dir) / "checkpoints"

    # ------------------------------------------------------------------------------------------------
    # train()
    # ------------------------------------------------------------------------------------------------
    def train(self, num_updates: Optional[int] = None, progress: bool = True,
              samples_at_end: bool = True) -> list[dict[str, float]]:
        """Run PPO up to ``num_updates`` updates (default: all the config asks for), resuming first when
        ``resume`` is set. Logs every ``logging_steps`` updates, prints sample completions
        ``num_sample_generations`` times, checkpoints every ``save_steps`` updates and at the end. Returns
        this call's metrics, one dict per update. samples_at_end=False: the last update's sample table is left to
        the caller (``ppojax train`` logs the first of its held-out scoring after training, the same prompts)."""
        run, args = self.run, self.args
        if run.batches is None:
            raise ConfigError("train() needs prompts: pass train_dataset or set `dataset` in the config.")
        if not self._has_reward:
            raise ConfigError(NO_REWARD)
        total = run.num_updates if num_updates is None else num_updates
        took_hold = self._hold_output_dir()
        try:
            if self.logger is None:
                resumed = (self.resume(args.resume) if args.resume is not None and int(run.state.update_count) == 0
                           else None)
                self.open_logger(resumed)
            return self._train(total, progress, samples_at_end)
        finally:
            if took_hold:
                self.claim.release()

    def _train(self, total: int, progress: bool, samples_at_end: bool = True) -> list[dict[str, float]]:
        run, args = self.run, self.args
        start = int(run.state.update_count)
        bar = self.logger.progress(total, initial=start) if progress else None
        # num_sample_generations tables at most, the last at the end: every ceil(total / n) updates
        sample_every = -(-total // args.num_sample_generations) if args.num_sample_generations else 0

        def log(end):  # every logging_steps updates, the last, and each that scored the held-out prompts
            if end.step % args.logging_steps == 0 or end.step == end.total or "eval/mean_score" in end.metrics:
                self.logger.log_metrics(end.step, end.metrics)

        def progress_bar(end):
            if bar is not None:
                bar.update(1)
                bar.set_postfix(score=f"{end.metrics['objective/scores']:.3f}",
                                kl=f"{end.metrics['objective/kl']:.2f}", eps=f"{end.metrics['eps']:.1f}")

        def save(end):  # written while the next updates run; the final one is saved below
            if end.step != end.total:
                self.save_checkpoint(wait=False)

        def held_out(end):  # into the update's metrics, before they are logged; the job scores after the last
            if end.step != end.total:
                end.metrics.update(eval_metrics(self.evaluate(step=end.step)))

        # Order matters: a failed reward stops before the update is logged (its numbers mean nothing); a
        # non-finite streak stops after it is logged (the skipped steps are in the metrics).
        evaluating = args.eval_steps if self.eval_queries is not None and self._has_reward else 0
        hooks = [Hook(reward_failure_check), Hook(environment_check),
                 Hook(held_out, every=evaluating, reads_state=True),
                 Hook(log),
                 Hook(progress_bar), Hook(nonfinite_check(self.checkpoints.latest)), Hook(on_policy_check),
                 Hook(lambda end: None if end.step == end.total and not samples_at_end else self.log_samples(end.step),
                      every=sample_every, at_end=sample_every > 0, reads_state=True),
                 Hook(save, every=args.save_steps, reads_state=True)]
        if run.settings.asynchronous is not None and start == 0:  # a checkpoint carries its own queue
            fill_in_flight(run, self.train_step.fill if isinstance(self.train_step, DisaggregatedStep)
                           else make_fill(run.program, run.state_shardings))
        stop = StopSignals()
        try:
            with stop:
                history = run_updates(run, self.train_step, total, hooks, should_stop=stop.requested,
                                      host_timings=self.train_step.host_timings
                                      if isinstance(self.train_step, DisaggregatedStep) else None)
            if isinstance(self.train_step, DisaggregatedStep):  # the state whole again, as the next call takes it
                run.state = self.train_step.settle(run.state)
            path = self.save_checkpoint() if int(run.state.update_count) > start else None
        except BaseException:  # the save in flight is finished (its failure one line): the run's error is reported
            try:
                self.checkpoints.close()
            except CheckpointError as err:
                print(f"ppojax: {err}", file=sys.stderr, flush=True)
            raise
        finally:
            if bar is not None:
                bar.close()
        self.checkpoints.close()
        if path is not None and stop.signal is not None:
            raise RunInterrupted(stop.signal, int(run.state.update_count), path)
        self.logger.flush()
        return history

    def _hold_output_dir(self) -> bool:
        """Hold ``output_dir`` for this call of train() (process 0 only). The first call claims it (refusing a
        directory that holds another run, or one in use: ``ppojax.io.run_dir``); later calls take the lock
        again. A claim the caller passed in (the CLI's) is the caller's to release. Returns whether this
        call took the lock (and must release it)."""
        if not parallel.is_main_process() or (self.claim is not None and self.claim.lock.held):
            return False
        if self.claim is None:
            args = self.args
            self.claim = claim_output_dir(args.output_dir, args.to_dict(), resume=args.resume,
                                          overwrite=args.overwrite_output_dir,
                                          resume_with_changes=args.resume_with_changes, compatible=resume_compatibility)
        else:
            self.claim.lock = DirectoryLock.acquire(self.claim.output_dir)
        return True

    def open_logger(self, resumed: Optional[Path]):
        """The run's logger: a resumed run's logs are cut back to its checkpoint (and every sink rebuilt to
        hold each step once); a run that found its directory holding this run but no checkpoint restarts
        its logs from 0."""
        if resumed is not None:
            resume_step = int(self.run.state.update_count)
        else:
            resume_step = 0 if self.claim is not None and self.claim.outcome == "resume" else None
        self.logger = RunLogger(self.args.output_dir, self.args, report_to=self.args.report_sinks,
                                resume_step=resume_step, run_id=getattr(self.claim, "run_id", None))
        return self.logger

    # ------------------------------------------------------------------------------------------------
    # Checkpoints
    # ------------------------------------------------------------------------------------------------
    def host_state(self) -> dict[str, Any]:
        """Everything outside the TrainState that a resumed run needs to continue exactly."""
        return {"data": self.run.batches.state_dict() if self.run.batches is not None else None}

    def save_checkpoint(self, wait: bool = True) -> Path:
        """Checkpoint the run's state at its update count. ``wait=False``: return while orbax writes it (the
        next save, or the end of the run, waits for it)."""
        state = self.run.state
        if isinstance(self.train_step, DisaggregatedStep):  # the batch in transit belongs to the queue it stores
            state = self.train_step.full_state(state)
        return self.checkpoints.save(int(state.update_count), state.without_frozen(), self.host_state(),
                                     self.args.to_dict(), wait=wait)

    def _checkpoint_on_disk(self, step: int) -> None:
        if self.logger is not None:
            self.logger.checkpoint_saved(step)  # sinks that cannot rewrite history (wandb) catch up to here

    def resume(self, where="auto") -> Optional[Path]:
        """Restore from ``where``: 'auto' (the newest checkpoint in output_dir/checkpoints that verifies; damaged
        ones are skipped with one line each; None when nothing was saved yet) or a checkpoint path. Refuses a
        checkpoint from an incompatible config. Returns the checkpoint used, or None."""
        path = self.checkpoints.resolve(where)
        if path is None:
            return None
        changed = resume_compatibility(read_checkpoint_config(path), self.args.to_dict())  # raises if must-match
        if changed:
            print(f"ppojax: resuming {path} with changed settings: {', '.join(changed)}")
        frozen = self.run.state.frozen
        # the fresh trainable state is only the restore's target: released first, never held twice
        # the config's hyperparameters (a resumed run may change them), kept apart from the restore's target
        hyperparams = jax.tree.map(jnp.copy, self.run.state.hyperparams)
        state, host, _ = self.checkpoints.restore(path, self.run.state.without_frozen(), release_target=True)
        self.run.state = state.replace(frozen=frozen, hyperparams=hyperparams)
        if self.run.batches is not None and host.get("data") is not None:
            self.run.batches.load_state_dict(host["data"])
        return path

    # ------------------------------------------------------------------------------------------------
    # Samples and evaluation
    # ------------------------------------------------------------------------------------------------
    @property
    def _has_reward(self) -> bool:
        """A reward source, or an environment that gives a reward."""
        agents = self.run.agents
        return self.run.reward is not None or (agents is not None and agents.reward_name is not None)

    def sample_completions(self, queries, temperature: float = SAMPLE_TEMPERATURE, step: int = 0, rows=None):
        """Near-greedy completions (T = 0.01, as TRL's samples) -> (prompts, completions) strings. An agent run plays
        whole episodes, which needs the queries' prompt-table ``rows`` (their environments reset with them).

        The sampling key comes from (seed, step), not the training stream, so samples never change training.
        """
        prompts, completions, _, _ = self._sample(queries, temperature, step, rows)
        return prompts, completions

    def _sample(self, queries, temperature: float = SAMPLE_TEMPERATURE, step: int = 0, rows=None, keep=None):
        """(prompts, completions, responses i32[B, R] truncated, the environment's rewards f32[B] or None), on the
        host, for queries i32[B, P] (an agent run: episodes, its environments reset with prompt-table ``rows``, only
        the first ``keep`` (default all) played: the others fill the batch)."""
        sampling = self.run.settings.sampling
        key = jax.random.fold_in(jax.random.key(self.args.seed + 1), step)
        P = queries.shape[1]
        environment_reward = None
        if self.run.agents is not None:
            if rows is None:
                raise ConfigError("an agent run samples whole episodes, whose environments are reset with the "
                                  "prompts' dataset rows: pass rows (their places in the run's prompt table).")
            jax.block_until_ready(self.run.state)  # no episode of an update in flight shares the host's state
            queries = self.run.agents.begin(rows, np.asarray(queries))
            played = rollout.episodes_jit(self.run.program, self.run.state.params, self.run.state.frozen,
                                          jnp.asarray(queries, jnp.int32), key, jnp.float32(temperature),
                                          jnp.int32(len(queries) if keep is None else keep),
                                          slots=sampling.rollout_slots or self.run.settings.batch.batch_size)
            self.run.agents.raise_pending()
            responses = parallel.to_host(played.stream)
            if self.run.agents.reward_name is not None:
                environment_reward = parallel.to_host(played.environment_reward)
        else:
            query_responses = rollout.sample_jit(self.policy_graphdef, self.policy_params,
                                                 jnp.asarray(queries, jnp.int32), key, jnp.float32(temperature),
                                                 sampling=sampling, mesh=self.run.mesh)
            responses = parallel.to_host(
                ppo.truncate_response(query_responses[:, P:], sampling.stop_token_id, sampling.pad_token_id))
        prompts, completions = decode_rollout_text(self.tokenizer, np.asarray(queries), responses,
                                                   sampling.pad_token_id)
        return prompts, completions, responses, environment_reward

    def log_samples(self, step: int, num: int = 4):
        if self.run.train_queries is None or self.logger is None:
            return
        # a whole batch, of which the first `num` are shown: the sampler compiled for evaluation is reused
        held_out = self.eval_queries is not None
        queries = _whole_batch((self.eval_queries if held_out else self.train_queries)[:num],
                               self._evaluation_rows)
        first_row = len(self.train_queries) if held_out else 0
        shown = min(num, len(queries))
        prompts, completions, responses, environment = self._sample(
            queries, step=step, rows=_batch_rows(first_row, shown, len(queries)), keep=shown)
        scored = self._with_environment(self.score_samples(queries, responses, rows=num, first_row=first_row),
                                        environment, num)
        prompts = self._shown(prompts, first_row, num)
        self.logger.log_samples(step, prompts, completions[:num], None if scored is None else scored[0])

    def _shown(self, decoded: list, first_row: int, num: int) -> list:
        """The prompts of rows ``first_row ..`` as the user wrote them (the run's ``prompt_texts``: a chat
        template's preamble is no part of it), else ``decoded`` (the prompt ids decoded)."""
        texts = self.run.prompt_texts
        return decoded[:num] if texts is None else list(texts[first_row:first_row + num])

    def evaluate(self, step: int = 0) -> Optional[dict[str, Any]]:
        """Mean reward of near-greedy completions of the held-out prompts, scored by the run's reward (functions
        and/or model, with their dataset columns); None without held-out prompts or a reward. Returns
        {"mean_score", "rewards": {name: mean over the rows it applies to}, "prompts", "completions", "scores",
        "reward_values": {name: per-prompt values, None where it does not apply}}."""
        if self.eval_queries is None or not self._has_reward:
            return None
        batch = self._evaluation_rows
        prompts, completions, scores, components = [], [], [], {}
        for start in range(0, len(self.eval_queries), batch):
            queries = _whole_batch(self.eval_queries[start:start + batch], batch)
            keep = min(batch, len(self.eval_queries) - start)
            first = len(self.train_queries) + start
            p, c, responses, environment = self._sample(queries, step=step, rows=_batch_rows(first, keep, batch),
                                                        keep=keep)
            prompts += self._shown(p, first, keep)
            completions += c[:keep]
            batch_scores, batch_components = self._with_environment(
                self.score_samples(queries, responses, rows=keep, first_row=first), environment, keep)
            scores += batch_scores
            for name, values in batch_components.items():
                components.setdefault(name, []).extend(values)
        means = {name: (float(np.mean([v for v in values if v is not None]))
                        if any(v is not None for v in values) else None) for name, values in components.items()}
        return {"mean_score": float(np.mean(scores)), "rewards": means, "prompts": prompts,
                "completions": completions, "scores": scores, "reward_values": components}

    @property
    def _evaluation_rows(self) -> int:
        """The prompts one evaluation (or sample table) call takes: a batch's, or for an agent run
        ``AGENT_EVALUATION_BATCHES`` batches' played on a batch's rows (``rollout_slots`` where set), each row
        taking the next prompt as its episode ends, so a call's last episodes overlap the next batch's first."""
        batch = self.run.settings.batch.batch_size
        return batch * AGENT_EVALUATION_BATCHES if self.run.agents is not None else batch

    def score_samples(self, queries, responses, rows: Optional[int] = None,
                      first_row: Optional[int] = None) -> Optional[tuple[list, dict]]:
        """The run's reward of the first ``rows`` (default: all) sampled completions, as the rollout scores
        them: one compiled program for every evaluation and sample table, the whole batch (padding rows are not
        shown to Python reward functions). queries i32[B, P], responses i32[B, R] (truncated); first_row: the
        prompt-table row of ``queries[0]`` (its dataset columns reach the reward functions; None: unknown).
        -> (scores, {reward name: values, None where it does not apply}), or None when the run has no reward
        source (the legacy step() API)."""
        reward = self.run.reward
        if reward is None:
            return None
        B = len(queries)
        rows = B if rows is None else rows
        table_rows = np.full(B, PADDING_ROW, np.int32)
        table_rows[:rows] = NO_ROW if first_row is None else np.arange(first_row, first_row + rows)
        if not hasattr(self, "_score_tokens"):
            self._score_tokens = jax.jit(lambda frozen, q, r, k: reward.scores(frozen, q, r, k))
        frozen = self.run.state.frozen
        if isinstance(self.train_step, DisaggregatedStep):  # the reward source runs on the rollout devices
            frozen = self.train_step.rollout_frozen(self.run.state)
        out = self._score_tokens(frozen, jnp.asarray(queries, jnp.int32),
                                 jnp.asarray(responses, jnp.int32), jnp.asarray(table_rows))
        if int(parallel.to_host(out.failures)):
            reward.raise_pending()
        scores = [float(s) for s in parallel.to_host(out.scores)[:rows]]
        components = {name: [None if np.isnan(v) else float(v) for v in parallel.to_host(values)[:rows]]
                      for name, values in out.components.items()}
        return scores, components

    def _with_environment(self, scored, environment, rows: int):
        """``score_samples``' (scores, components) with an agent run's environment reward added (weight 1, as in
        training; None entries where it gave none) -> the same pair, or None without any reward."""
        if environment is None:
            return scored
        values = [None if np.isnan(v) else float(v) for v in environment[:rows]]
        scores, components = scored if scored is not None else ([0.0] * rows, {})
        name = self.run.agents.reward_name
        return ([s + (v or 0.0) for s, v in zip(scores, values)], {**components, name: values})

    # ------------------------------------------------------------------------------------------------
    def save_model(self, output_dir) -> Path:
        """Write the trained policy as a Hugging Face checkpoint directory (config, safetensors, tokenizer).

        Under LoRA: the merged model (adapters folded into the base weights) there, and the PEFT adapter
        directory beside it (``<output_dir>_adapter``, :meth:`save_adapter`)."""
        # collectives (every process takes part); the weights come to the main host one at a time and stay on
        # the host: the whole model never lands on one device (a 70B model would not fit one)
        host_params = parallel.to_main_host(self.policy_params)
        if self.run.lora is not None:
            self.save_adapter(Path(output_dir).with_name(Path(output_dir).name + "_adapter"))
        if not parallel.is_main_process():
            return Path(output_dir)
        policy = nnx.merge(self.policy_graphdef, host_params)
        return save_pretrained(policy, self.run.model_config, output_dir, tokenizer=self.tokenizer)

    def save_adapter(self, output_dir) -> Path:
        """Write the policy's LoRA adapters as a PEFT adapter directory (``adapter_config.json``,
        ``adapter_model.safetensors``, the tokenizer): ``peft.PeftModel.from_pretrained(base, output_dir)``."""
        if self.run.lora is None:
            raise ConfigError("save_adapter: this run has no LoRA adapters (lora_r=0); save_model writes the "
                              "whole policy.")
        host_adapters = parallel.to_host(self.run.state.params["policy"])  # a collective
        if not parallel.is_main_process():
            return Path(output_dir)
        base = self.run.model_path or self.args.model_name_or_path
        return save_peft_adapter(host_adapters, self.run.model_config, self.run.lora, output_dir,
                                 base_model_name_or_path=str(base), tokenizer=self.tokenizer)


def eval_metrics(result: Optional[dict]) -> dict:
    """An evaluation (``PPOTrainer.evaluate``) as metrics: ``eval/mean_score`` and, with several rewards,
    ``eval/rewards/<name>/mean`` ({} for None)."""
    if result is None:
        return {}
    rewards = result.get("rewards") or {}
    out = {"eval/mean_score": result["mean_score"]}
    if len(rewards) > 1:
        out.update({f"eval/rewards/{name}/mean": value for name, value in rewards.items() if value is not None})
    return out


def _batch_rows(first_row: int, rows: int, batch_size: int) -> np.ndarray:
    """The prompt-table rows of a batch padded as :func:`_whole_batch` pads it: i32[batch_size]."""
    return first_row + np.minimum(np.arange(batch_size), rows - 1).astype(np.int32)


def _whole_batch(queries, batch_size):
    """np i32[n, P] padded to [batch_size, P] with copies of the last row (one compiled sampler shape)."""
    if len(queries) >= batch_size:
        return queries
    return np.concatenate([queries, np.repeat(queries[-1:], batch_size - len(queries), 0)])
