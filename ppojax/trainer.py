"""PPOTrainer: TRL's two ways of running PPO on top of ppojax's pure functions.

- ``train()`` (TRL 1.x): prompts dataset -> rollouts -> updates, with the KL controller, sample completions,
  metrics (TensorBoard + JSONL), a progress bar and checkpoints.
- the legacy loop (TRL <= 0.11), for users who score responses themselves:
  ``responses = trainer.generate(queries)``; ``stats = trainer.step(queries, responses, scores)``.
- ``save_model(dir)``: the policy in Hugging Face format.

Per update there are two compiled programs: the rollout (``ppojax.rollout``: generation, then the
reference/value/reward forwards) and the update (``ppojax.update``); a Python reward function is the only
host round trip. The trainable state is donated to the update, so the rollout always reads the policy
from ``self.state``.
"""
from __future__ import annotations

import importlib
import math
import time
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from . import forward, ppo
from .actor_critic import ActorCritic
from .compile_cache import enable_compilation_cache
from .config import ConfigError, PPOConfig
from .data import PromptBatches, check_tokenizer, load_prompt_dataset, prepare_prompts
from .rollout import (Experience, RolloutSettings, experience_forwards, finalize_scores, make_experience,
                      sample_responses, value_head_values)
from . import sharding
from .update import TrainState, UpdateSettings, optimizer_from_config

SAMPLE_TEMPERATURE = 0.01  # TRL's near-greedy sample completions


def resolve_reward_function(spec) -> Callable:
    """'vader', 'module:function', or a callable -> a reward function f(prompts, completions)."""
    if callable(spec):
        return spec
    if spec == "vader":
        from .rewards import vader_sentiment_reward
        return vader_sentiment_reward()
    module_name, sep, attr = str(spec).partition(":")
    if not sep:
        raise ConfigError(f"reward_function={spec!r}: expected 'vader' or 'module:function' "
                          "(e.g. 'my_rewards:length_reward').")
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as err:
        raise ConfigError(f"reward_function={spec!r} could not be imported ({err}); check that the module is "
                          "on PYTHONPATH and defines that function.") from err


def resolve_model_path(path: str) -> str:
    """'smollm2' -> the bundled SmolLM2-135M-Instruct checkpoint (converted once); otherwise the path itself."""
    if path == "smollm2":
        from .assets import smollm2_checkpoint
        return str(smollm2_checkpoint())
    return path


def _copy(tree):
    return jax.tree.map(jnp.copy, tree)


def _load_model(role: str, path, **kwargs):
    """``load_pretrained`` with every way a checkpoint directory can be unusable (no config.json, missing,
    truncated or corrupt weights, mismatched shapes) turned into a ConfigError naming the role and the path."""
    from .models import load_pretrained
    try:
        return load_pretrained(path, **kwargs)
    except (OSError, ValueError, KeyError) as err:
        cause = err.args[0] if isinstance(err, KeyError) and err.args else err
        raise ConfigError(f"could not load the {role} from {str(path)!r}: {cause}") from err


def _as_config_error(fn, *args, **kwargs):
    """Run a data/tokenizer check, re-raising its ValueError as a ConfigError (a ValueError too), so that
    `ppojax train` prints the message instead of a traceback."""
    try:
        return fn(*args, **kwargs)
    except ConfigError:
        raise
    except (ValueError, TypeError, OSError) as err:
        raise ConfigError(str(err)) from err


class PPOTrainer:
    """PPO on a policy, a frozen reference, a value function and a reward source.

    args: a validated :class:`PPOConfig`. processing_class: the tokenizer (loaded from the policy
    directory when None). model: a ppojax ``CausalLM`` (``CausalLMWithValueHead`` with value_head='policy'),
    or None to load ``args.model_name_or_path``. ref_model: a frozen reference (default: a copy of the
    initial policy). reward_model: a ppojax ``ScoreModel``, or a Python function
    ``f(prompts, completions) -> floats`` (TRL never took one), or None to use ``args``. value_model: a
    ``ScoreModel`` (default: the reward model's copy, as TRL, or the policy backbone + a new head when
    the reward is a function). train_dataset: prompts (list of str, datasets.Dataset, path; default
    ``args.dataset``); None is fine for the legacy ``step`` API.
    """

    def __init__(self, args: PPOConfig, processing_class=None, model=None, ref_model=None, reward_model=None,
                 train_dataset=None, value_model=None, *, logger=None):
        self.args = args.validate()
        sharding.initialize_distributed()  # a no-op on one process; must precede other device work
        self.compilation_cache_dir = enable_compilation_cache(args.compilation_cache_dir)
        self.mesh = sharding.mesh_from_config(args)
        dtype = jnp.bfloat16 if args.dtype == "bfloat16" else jnp.float32
        self.dtype = dtype
        model_path = None
        if model is None:
            model_path = resolve_model_path(args.model_name_or_path)
            kind = "value_head" if args.value_head == "policy" else "causal_lm"
            model, _ = _load_model("policy", model_path, kind=kind, dtype=dtype, seed=args.seed)
        if processing_class is None:
            if model_path is None:
                raise ConfigError("processing_class (the tokenizer) is required when `model` is given.")
            from .models import load_tokenizer
            processing_class = _as_config_error(load_tokenizer, model_path)
        self.tokenizer = processing_class
        self.model_config = model.cfg
        self.pad_token_id = _as_config_error(check_tokenizer, processing_class, model.cfg.vocab_size)
        self.stop_token_id = args.stop_token_id
        if self.stop_token_id is None and args.stop_token_is_eos:
            self.stop_token_id = processing_class.eos_token_id
        if self.stop_token_id is not None and self.stop_token_id == self.pad_token_id:
            raise ConfigError(f"stop token id {self.stop_token_id} equals the pad token id; SPEC keys masks on "
                              "`token != pad`. Give the tokenizer a distinct pad token.")
        if args.value_head == "policy" and not hasattr(model, "value"):
            raise ConfigError("value_head='policy' needs a CausalLMWithValueHead policy (load it with "
                              "kind='value_head'), or set value_head='separate'.")

        # ---- reward source ----
        self.reward_fn, reward_module = None, None
        if reward_model is None and args.reward_function is not None:
            reward_model = resolve_reward_function(args.reward_function)
        if reward_model is None and args.reward_model_path is not None:
            reward_module, _ = _load_model("reward model", args.reward_model_path, kind="score", dtype=dtype)
        elif callable(reward_model) and not isinstance(reward_model, nnx.Module):
            self.reward_fn = reward_model
        elif reward_model is not None:
            reward_module = reward_model
        self.reward_graphdef, self.reward_params = (nnx.split(reward_module) if reward_module is not None
                                                    else (None, None))
        if self.reward_params is not None:
            self.reward_params = sharding.shard_params(self.reward_params, self.mesh)

        # ---- value function ----
        policy_graphdef, policy_params = nnx.split(model)
        params = {"policy": policy_params}
        value_graphdef = None
        if args.value_head == "separate":
            value_module = value_model or self._default_value_model(model, reward_module, dtype)
            value_graphdef, params["value"] = nnx.split(value_module)
            if reward_module is not None and value_model is None:
                params["value"] = _copy(params["value"])  # the value model trains; the reward model must not
        self.sizes = args.derived(sharding.data_parallel_size(self.mesh))
        update_chunk, rollout_chunk = self._logits_chunk_sizes(model.cfg.vocab_size)
        self.actor_critic = ActorCritic(policy_graphdef, value_graphdef, self.pad_token_id, args.temperature,
                                        update_chunk)
        # The reference: a frozen copy of the initial policy (never donated, never updated).
        if ref_model is not None:
            self.ref_graphdef, self.ref_params = nnx.split(ref_model)
        else:
            self.ref_graphdef, self.ref_params = policy_graphdef, _copy(policy_params)
        self.ref_params = sharding.shard_params(self.ref_params, self.mesh)
        self.rollout_settings = RolloutSettings(
            response_length=args.response_length, pad_token_id=self.pad_token_id, temperature=args.temperature,
            top_k=args.top_k, top_p=args.top_p, stop_token_id=self.stop_token_id,
            missing_eos_penalty=args.missing_eos_penalty, logprob_chunk_size=rollout_chunk,
            forward_batch_size=args.local_rollout_forward_batch_size,
            compute_full_kl=args.kl_estimator == "full")

        # ---- data ----
        self.prompts = None
        if train_dataset is not None or args.dataset:
            texts = _as_config_error(load_prompt_dataset,
                                     train_dataset if train_dataset is not None else self._dataset_source(),
                                     column=args.dataset_text_field)
            self.prompts = _as_config_error(prepare_prompts, texts, processing_class, args.max_prompt_length,
                                            chat_template=args.chat_template, stop_token_id=self.stop_token_id,
                                            pad_token_id=self.pad_token_id)
        self.train_queries, self.eval_queries = self._split_eval(args.num_eval_prompts)
        dataset_size = len(self.train_queries) if self.prompts is not None else self.sizes.batch_size
        self.num_updates = args.num_updates(dataset_size)
        if self.prompts is not None and len(self.train_queries) < self.sizes.batch_size:
            raise ConfigError(f"The dataset has {len(self.train_queries)} training prompts after filtering and "
                              f"holding out num_eval_prompts={args.num_eval_prompts}, fewer than "
                              f"batch_size={self.sizes.batch_size}; lower batch_size or add prompts.")
        self.batches = (PromptBatches(self.train_queries, self.sizes.batch_size, seed=args.seed,
                                      process_index=jax.process_index(), process_count=jax.process_count())
                        if self.prompts is not None else None)

        # ---- optimisation state ----
        self.settings = UpdateSettings.from_config(args, self.num_updates)
        self.optimizer = optimizer_from_config(args)
        # Parameters and optimizer state are created sharded over the mesh (fsdp/tensor rules).
        self.state: TrainState
        self.state, state_shardings = sharding.init_sharded_train_state(params, self.optimizer, self.mesh)
        self._update = sharding.make_sharded_ppo_update(self.actor_critic, self.settings, self.optimizer,
                                                        self.mesh, state_shardings)
        self.kl_coef = float(args.kl_coef)
        self.score_moments = ppo.RunningMoments.create()
        self.key = jax.random.key(args.seed)
        self.episode = 0
        self.logger = logger

    # ------------------------------------------------------------------------------------------------
    def _dataset_source(self):
        if self.args.dataset == "movie_reviews":
            return "builtin:movie_reviews"
        return self.args.dataset

    def _logits_chunk_sizes(self, vocab_size):
        """(update, rollout) logits chunk sizes: the config's ``logits_chunk_size``, or (None) sized from
        ``forward.LOGITS_MEMORY_BUDGET`` for the rows one device holds: a micro-batch in the update, a forward
        batch in the rollout."""
        if self.args.logits_chunk_size is not None:
            return self.args.logits_chunk_size, self.args.logits_chunk_size
        dp = sharding.data_parallel_size(self.mesh)
        micro_rows = -(-self.sizes.micro_batch_size // dp)
        forward_rows = -(-(self.args.local_rollout_forward_batch_size or self.sizes.batch_size) // dp)
        length = self.args.response_length
        return (forward.auto_chunk_size(micro_rows, length, vocab_size),
                forward.auto_chunk_size(forward_rows, length, vocab_size))

    def _split_eval(self, num_eval):
        """Held-out prompts come off the END of the prompt set; the rest are for training."""
        if self.prompts is None:
            return None, None
        ids = self.prompts.input_ids
        if num_eval >= len(ids):
            raise ConfigError(f"num_eval_prompts={num_eval} leaves no training prompts out of {len(ids)}.")
        return (ids[:len(ids) - num_eval], ids[len(ids) - num_eval:]) if num_eval else (ids, None)

    def _default_value_model(self, policy, reward_module, dtype):
        """TRL initialises the value model from the reward model; with a reward function there is none, so
        the value model is the policy's backbone with a fresh score head."""
        if self.args.value_model_path is not None:
            return _load_model("value model", self.args.value_model_path, kind="score", dtype=dtype)[0]
        if reward_module is not None:
            return reward_module
        from .models import ScoreModel
        value = ScoreModel(policy.cfg, rngs=nnx.Rngs(self.args.seed + 1), dtype=dtype,
                           param_dtype=dtype)
        nnx.update(value.backbone, _copy(nnx.state(policy.backbone)))
        return value

    @property
    def policy_params(self):
        return self.state.params["policy"]

    def _next_key(self):
        self.key, sub = jax.random.split(self.key)
        return sub

    # ------------------------------------------------------------------------------------------------
    # One update from a batch of prompts
    # ------------------------------------------------------------------------------------------------
    def rollout(self, queries, scores=None) -> Experience:
        """Sample responses for left-padded ``queries`` i32[B, P] and build the experience."""
        value_kwargs = (dict(policy_value_head=value_head_values) if self.actor_critic.has_value_head else
                        dict(value_graphdef=self.actor_critic.value_graphdef,
                             value_params=self.state.params["value"]))
        reward_kwargs = (dict(scores=scores) if scores is not None else
                         dict(reward_fn=self.reward_fn, tokenizer=self.tokenizer,
                              allow_nonfinite_scores=self._skip_nonfinite_reward) if self.reward_fn is not None else
                         dict(reward_graphdef=self.reward_graphdef, reward_params=self.reward_params))
        # Generation reads the weights under GENERATE_RULES (gathered over fsdp); prompts are sharded by rows.
        policy_params = sharding.shard_params(self.policy_params, self.mesh, sharding.GENERATE_RULES)
        return make_experience(self._global_batch(queries), self._next_key(), self.rollout_settings,
                               policy_graphdef=self.actor_critic.policy_graphdef, policy_params=policy_params,
                               ref_params=self.ref_params, ref_graphdef=self.ref_graphdef, **value_kwargs,
                               **reward_kwargs)

    def _global_batch(self, local_rows):
        """This process's prompt rows (np i32[b, P]) -> the global batch, rows over ('data', 'fsdp')."""
        if jax.process_count() > 1:
            return sharding.host_local_batch_to_global(np.asarray(local_rows, np.int32), self.mesh)
        return sharding.shard_batch(jnp.asarray(local_rows, jnp.int32), self.mesh)

    @property
    def _skip_nonfinite_reward(self) -> bool:
        return self.args.on_nonfinite_reward == "skip"

    def _process_scores(self, experience: Experience) -> Experience:
        """Legacy score scaling / normalisation / clipping (off by default)."""
        args = self.args
        if not (args.use_score_scaling or args.score_clip is not None):
            return experience
        scores, moments = ppo.process_scores(
            experience.scores, self.score_moments, use_score_scaling=args.use_score_scaling,
            use_score_norm=args.use_score_norm, score_clip=args.score_clip)
        # A NaN/inf score (on_nonfinite_reward='skip', or a reward model's) leaves the running moments as they
        # were: the update is skipped anyway, and the moments must stay usable for the next one (no host sync).
        finite = jnp.all(jnp.isfinite(experience.scores))
        self.score_moments = jax.tree.map(lambda new, old: jnp.where(finite, new, old), moments,
                                          self.score_moments)
        return experience.replace(scores=scores)

    def update(self, experience: Experience) -> dict[str, float]:
        """One PPO update on a rollout batch; moves the KL controller. Returns host metrics.

        An update whose optimizer steps were all skipped for non-finite values (a NaN/inf reward with
        ``on_nonfinite_reward='skip'``, or a diverged loss) leaves the parameters, optimizer state, KL
        coefficient and score moments as they were; the skipped steps are counted (``ppo/nonfinite_total``,
        ``ppo/skipped_steps``) and reported on the console.
        """
        start = time.perf_counter()
        experience = self._process_scores(experience)
        nonfinite_before = int(self.state.nonfinite_total)  # read before the state is donated
        self.state, metrics = self._update(self.state, experience, self._next_key(), jnp.float32(self.kl_coef))
        metrics = {name: float(value) for name, value in sharding.to_host(metrics).items()}
        metrics["val/num_eos_tokens"] = float(experience.num_stop_tokens)
        batch = experience.scores.shape[0]
        nonfinite_steps = int(metrics["ppo/nonfinite_total"]) - nonfinite_before
        steps_per_update = self.settings.num_ppo_epochs * self.settings.num_mini_batches
        all_skipped = nonfinite_steps > 0 and metrics["ppo/skipped_steps"] >= steps_per_update
        if self.args.adaptive_kl and math.isfinite(metrics["objective/kl"]) and not all_skipped:
            self.kl_coef = float(ppo.adaptive_kl_update(self.kl_coef, metrics["objective/kl"], batch,
                                                        self.args.target_kl_for_adaptive, self.args.horizon))
        if nonfinite_steps:
            from .run_logging import stage
            stage(f"update {int(self.state.update_count)}: {nonfinite_steps} of {steps_per_update} optimizer "
                  f"steps skipped for a non-finite loss or gradient (mean score {metrics['objective/scores']}); "
                  f"{int(self.state.nonfinite_streak)} in a row, the run stops at "
                  f"max_nonfinite_steps={self.args.max_nonfinite_steps}.")
        self.episode += batch
        metrics["episode"] = float(self.episode)
        metrics["time/update_s"] = time.perf_counter() - start
        return metrics

    # ------------------------------------------------------------------------------------------------
    # train()
    # ------------------------------------------------------------------------------------------------
    def train(self, num_updates: Optional[int] = None, progress: bool = True) -> list[dict[str, float]]:
        """Run PPO up to ``num_updates`` updates (default: all the config asks for), resuming first when
        ``resume`` is set. Logs every update, prints sample completions ``num_sample_generations`` times,
        checkpoints every ``save_steps`` updates and at the end. Returns this call's metrics, one per update."""
        if self.batches is None:
            raise ConfigError("train() needs prompts: pass train_dataset or set `dataset` in the config.")
        args = self.args
        if args.resume is not None and int(self.state.update_count) == 0:
            self.resume(args.resume)
        total = self.num_updates if num_updates is None else num_updates
        start_update = int(self.state.update_count)
        if self.logger is None:
            from .run_logging import RunLogger
            self.logger = RunLogger(args.output_dir, args, report_to=args.report_to,
                                    resume_step=start_update if start_update else None)
        history = []
        sample_every = max(1, total // max(1, args.num_sample_generations))
        bar = self.logger.progress(total, initial=start_update) if progress else None
        for update_index in range(start_update, total):
            t0 = time.perf_counter()
            experience = self.rollout(next(self.batches).input_ids)
            t1 = time.perf_counter()
            metrics = self.update(experience)
            wall = time.perf_counter() - t0
            metrics["time/rollout_s"] = t1 - t0
            metrics["eps"] = self.sizes.batch_size / wall
            history.append(metrics)
            step = update_index + 1
            self.logger.log_metrics(step, metrics)
            if bar is not None:
                bar.update(1)
                bar.set_postfix(score=f"{metrics['objective/scores']:.3f}", kl=f"{metrics['objective/kl']:.2f}",
                                eps=f"{metrics['eps']:.1f}")
            self._check_nonfinite()
            if args.num_sample_generations and (update_index % sample_every == 0 or step == total):
                self.log_samples(step)
            if args.save_steps and step % args.save_steps == 0 and step != total:
                self.save_checkpoint()
        if bar is not None:
            bar.close()
        if total > start_update:
            self.save_checkpoint()
        self.logger.flush()
        return history

    def _check_nonfinite(self):
        streak = int(self.state.nonfinite_streak)
        if streak >= self.args.max_nonfinite_steps:
            from .checkpoint import latest_checkpoint
            last = latest_checkpoint(self.checkpoint_dir)
            raise FloatingPointError(
                f"{streak} optimizer steps in a row were skipped for a non-finite loss or gradient "
                f"(max_nonfinite_steps={self.args.max_nonfinite_steps}); stopping. Last good checkpoint: "
                f"{last or 'none yet'} (continue from it with resume=auto). Lower learning_rate, check the reward "
                f"for NaN/inf, or set max_grad_norm.")

    # ------------------------------------------------------------------------------------------------
    # Checkpoints
    # ------------------------------------------------------------------------------------------------
    @property
    def checkpoint_dir(self) -> Path:
        return Path(self.args.output_dir) / "checkpoints"

    def host_state(self) -> dict[str, Any]:
        """Everything outside TrainState that a resumed run needs to continue exactly."""
        m = self.score_moments
        return {"kl_coef": self.kl_coef, "episode": self.episode, "key": self.key,
                "score_moments": {"mean": m.mean, "std": m.std, "var": m.var, "count": m.count},
                "data": self.batches.state_dict() if self.batches is not None else None}

    def save_checkpoint(self) -> Path:
        from .checkpoint import save_checkpoint
        step = int(self.state.update_count)
        return save_checkpoint(self.checkpoint_dir, step, self.state, self.host_state(), self.args.to_dict(),
                               save_total_limit=self.args.save_total_limit)

    def resume(self, where: str = "auto") -> Optional[Path]:
        """Restore from ``where``: 'auto' (latest in output_dir/checkpoints, or start fresh if none) or a path.
        Refuses a checkpoint from an incompatible config. Returns the checkpoint used, or None."""
        from .checkpoint import check_compatible, latest_checkpoint, restore_checkpoint
        path = latest_checkpoint(self.checkpoint_dir) if where == "auto" else Path(where)
        if path is None:
            return None
        import json
        from .checkpoint import CONFIG_FILE
        saved_config = json.loads((Path(path) / CONFIG_FILE).read_text()) if (Path(path) / CONFIG_FILE).is_file() else {}
        changed = check_compatible(saved_config, self.args.to_dict())  # raises on a field that must match
        if changed:
            print(f"ppojax: resuming {path} with changed settings: {', '.join(changed)}")
        state, host, _ = restore_checkpoint(path, self.state)
        self.state = state
        self.kl_coef = float(host["kl_coef"])
        self.episode = int(host["episode"])
        self.key = host["key"]
        self.score_moments = ppo.RunningMoments(**{k: jnp.asarray(v, jnp.float32)
                                                   for k, v in host["score_moments"].items()})
        if self.batches is not None and host.get("data") is not None:
            self.batches.load_state_dict(host["data"])
        return path

    def sample_completions(self, queries, temperature: float = SAMPLE_TEMPERATURE, step: int = 0):
        """Near-greedy completions (T = 0.01, as TRL's samples) -> (prompts, completions) strings.

        The sampling key comes from (seed, step), not the training stream, so samples never change training.
        """
        settings = RolloutSettings(**{**self.rollout_settings.__dict__, "temperature": temperature})
        key = jax.random.fold_in(jax.random.key(self.args.seed + 1), step)
        query_responses = sample_responses(self.actor_critic.policy_graphdef, self.policy_params,
                                           jnp.asarray(queries, jnp.int32), key, settings)
        from .rollout import decode_rollout_text
        P = queries.shape[1]
        responses = ppo.truncate_response(query_responses[:, P:], self.stop_token_id, self.pad_token_id)
        return decode_rollout_text(self.tokenizer, np.asarray(queries), np.asarray(responses), self.pad_token_id)

    def log_samples(self, step: int, num: int = 4):
        if self.prompts is None or self.logger is None:
            return
        queries = (self.eval_queries if self.eval_queries is not None else self.train_queries)[:num]
        prompts, completions = self.sample_completions(queries, step=step)
        scores = self.score_texts(prompts, completions)
        self.logger.log_samples(step, prompts, completions, scores)

    def evaluate(self, step: int = 0) -> Optional[dict[str, Any]]:
        """Mean reward of near-greedy completions of the held-out prompts (None without held-out prompts or a
        reward function). Returns {"mean_score", "prompts", "completions", "scores"}."""
        if self.eval_queries is None or self.reward_fn is None:
            return None
        prompts, completions = [], []
        for start in range(0, len(self.eval_queries), self.sizes.batch_size):
            chunk = self.eval_queries[start:start + self.sizes.batch_size]
            if len(chunk) < self.sizes.batch_size:  # keep one compiled shape: pad with copies, drop them after
                chunk = np.concatenate([chunk, np.repeat(chunk[-1:], self.sizes.batch_size - len(chunk), 0)])
            p, c = self.sample_completions(chunk, step=step)
            keep = min(self.sizes.batch_size, len(self.eval_queries) - start)
            prompts += p[:keep]
            completions += c[:keep]
        scores = self.score_texts(prompts, completions)
        return {"mean_score": float(np.mean(scores)), "prompts": prompts, "completions": completions,
                "scores": scores}

    def score_texts(self, prompts: list[str], completions: list[str]) -> Optional[list[float]]:
        """Scores of given texts with the reward function (None for a reward model: tokenised scoring is the
        rollout's job)."""
        if self.reward_fn is None:
            return None
        from .rewards import call_reward_function
        return [float(s) for s in call_reward_function(self.reward_fn, prompts, completions,
                                                         allow_nonfinite=self._skip_nonfinite_reward)]

    # ------------------------------------------------------------------------------------------------
    # Legacy API (TRL <= 0.11)
    # ------------------------------------------------------------------------------------------------
    def _pad_queries(self, queries: Sequence[Sequence[int]]) -> np.ndarray:
        from .data import left_pad
        P = self.args.max_prompt_length
        too_long = [i for i, q in enumerate(queries) if len(q) > P]
        if too_long:
            raise ConfigError(f"query {too_long[0]} has {len(queries[too_long[0]])} tokens, more than "
                              f"max_prompt_length={P}; raise max_prompt_length or shorten it.")
        return left_pad([list(map(int, q)) for q in queries], P, self.pad_token_id)

    def generate(self, queries: Sequence[Sequence[int]], **overrides) -> list[np.ndarray]:
        """Legacy: sample a response for each query (token ids). Returns truncated responses (no padding).

        overrides: RolloutSettings fields such as temperature, top_k, top_p, response_length, greedy.
        """
        settings = RolloutSettings(**{**self.rollout_settings.__dict__, **overrides})
        padded = self._pad_queries(queries)
        query_responses = sample_responses(self.actor_critic.policy_graphdef, self.policy_params,
                                           jnp.asarray(padded), self._next_key(), settings)
        responses = np.asarray(ppo.truncate_response(query_responses[:, padded.shape[1]:],
                                                     settings.stop_token_id, settings.pad_token_id))
        completions = []
        for row in responses:
            pads = np.flatnonzero(row == self.pad_token_id)
            completions.append(row[:pads[0]] if pads.size else row)
        return completions

    def step(self, queries: Sequence[Sequence[int]], responses: Sequence[Sequence[int]],
             scores: Sequence[float]) -> dict[str, float]:
        """Legacy: one PPO update on caller-given queries, responses (token ids) and scores."""
        n = len(queries)
        if not (len(responses) == len(scores) == n):
            raise ConfigError(f"step() got {n} queries, {len(responses)} responses and {len(scores)} scores; "
                              "they must have the same length.")
        if n != self.sizes.batch_size:
            raise ConfigError(f"step() got {n} queries; expected batch_size={self.sizes.batch_size} (the "
                              "update's static shape). Set batch_size in the config to your batch.")
        scores_np = np.asarray(scores, np.float32).reshape(-1)
        from .rewards import check_scores
        scores_np = check_scores(scores_np, n, name="step() scores", allow_nonfinite=self._skip_nonfinite_reward)
        R = self.args.response_length
        padded_responses = np.full((n, R), self.pad_token_id, np.int32)
        for i, response in enumerate(responses):
            if len(response) > R:
                raise ConfigError(f"response {i} has {len(response)} tokens, more than response_length={R}; "
                                  "raise response_length.")
            padded_responses[i, :len(response)] = np.asarray(response, np.int32)
        queries_np = self._pad_queries(queries)
        query_responses = jnp.asarray(np.concatenate([queries_np, padded_responses], axis=1))
        value_kwargs = (dict(policy_value_head=value_head_values) if self.actor_critic.has_value_head else
                        dict(value_graphdef=self.actor_critic.value_graphdef))
        experience = experience_forwards(
            self.policy_params, self.ref_params, self.state.params.get("value"), None, query_responses,
            prompt_length=queries_np.shape[1], settings=self.rollout_settings,
            policy_graphdef=self.actor_critic.policy_graphdef, ref_graphdef=self.ref_graphdef, **value_kwargs)
        experience = finalize_scores(experience, jnp.asarray(scores_np), self.rollout_settings)
        return self.update(experience)

    # ------------------------------------------------------------------------------------------------
    def save_model(self, output_dir) -> Path:
        """Write the trained policy as a Hugging Face checkpoint directory (config, safetensors, tokenizer)."""
        from .models import save_pretrained
        host_params = sharding.to_host(self.policy_params)  # a collective: every process takes part
        if not sharding.is_main_process():
            return Path(output_dir)
        policy = nnx.merge(self.actor_critic.policy_graphdef, jax.tree.map(jnp.asarray, host_params))
        return save_pretrained(policy, self.model_config, output_dir, tokenizer=self.tokenizer)
