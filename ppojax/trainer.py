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
import time
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from . import ppo
from .actor_critic import ActorCritic
from .config import ConfigError, PPOConfig
from .data import PromptBatches, check_tokenizer, load_prompt_dataset, prepare_prompts
from .rollout import (Experience, RolloutSettings, experience_forwards, finalize_scores, make_experience,
                      sample_responses, value_head_values)
from .update import (TrainState, UpdateSettings, init_train_state, make_ppo_update, optimizer_from_config)

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
        dtype = jnp.bfloat16 if args.dtype == "bfloat16" else jnp.float32
        self.dtype = dtype
        model_path = None
        if model is None:
            from .models import load_pretrained
            model_path = resolve_model_path(args.model_name_or_path)
            kind = "value_head" if args.value_head == "policy" else "causal_lm"
            model, _ = load_pretrained(model_path, kind=kind, dtype=dtype, seed=args.seed)
        if processing_class is None:
            if model_path is None:
                raise ConfigError("processing_class (the tokenizer) is required when `model` is given.")
            from .models import load_tokenizer
            processing_class = load_tokenizer(model_path)
        self.tokenizer = processing_class
        self.model_config = model.cfg
        self.pad_token_id = check_tokenizer(processing_class, model.cfg.vocab_size)
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
            from .models import load_pretrained
            reward_module, _ = load_pretrained(args.reward_model_path, kind="score", dtype=dtype)
        elif callable(reward_model) and not isinstance(reward_model, nnx.Module):
            self.reward_fn = reward_model
        elif reward_model is not None:
            reward_module = reward_model
        self.reward_graphdef, self.reward_params = (nnx.split(reward_module) if reward_module is not None
                                                    else (None, None))

        # ---- value function ----
        policy_graphdef, policy_params = nnx.split(model)
        params = {"policy": policy_params}
        value_graphdef = None
        if args.value_head == "separate":
            value_module = value_model or self._default_value_model(model, reward_module, dtype)
            value_graphdef, params["value"] = nnx.split(value_module)
            if reward_module is not None and value_model is None:
                params["value"] = _copy(params["value"])  # the value model trains; the reward model must not
        self.actor_critic = ActorCritic(policy_graphdef, value_graphdef, self.pad_token_id, args.temperature,
                                        args.logits_chunk_size)
        # The reference: a frozen copy of the initial policy (never donated, never updated).
        if ref_model is not None:
            self.ref_graphdef, self.ref_params = nnx.split(ref_model)
        else:
            self.ref_graphdef, self.ref_params = policy_graphdef, _copy(policy_params)
        self.rollout_settings = RolloutSettings(
            response_length=args.response_length, pad_token_id=self.pad_token_id, temperature=args.temperature,
            top_k=args.top_k, top_p=args.top_p, stop_token_id=self.stop_token_id,
            missing_eos_penalty=args.missing_eos_penalty, logprob_chunk_size=args.logits_chunk_size,
            forward_batch_size=args.local_rollout_forward_batch_size)

        # ---- data ----
        self.prompts = None
        if train_dataset is not None or args.dataset:
            texts = load_prompt_dataset(train_dataset if train_dataset is not None else self._dataset_source(),
                                        column=args.dataset_text_field)
            self.prompts = prepare_prompts(texts, processing_class, args.max_prompt_length,
                                           chat_template=args.chat_template, stop_token_id=self.stop_token_id,
                                           pad_token_id=self.pad_token_id)
        self.sizes = args.derived()
        dataset_size = len(self.prompts.input_ids) if self.prompts is not None else self.sizes.batch_size
        self.num_updates = args.num_updates(dataset_size)
        if self.prompts is not None and len(self.prompts.input_ids) < self.sizes.batch_size:
            raise ConfigError(f"The dataset has {len(self.prompts.input_ids)} prompts after filtering, fewer than "
                              f"batch_size={self.sizes.batch_size}; lower batch_size or add prompts.")
        self.batches = (PromptBatches(self.prompts.input_ids, self.sizes.batch_size, seed=args.seed)
                        if self.prompts is not None else None)

        # ---- optimisation state ----
        self.settings = UpdateSettings.from_config(args, self.num_updates)
        self.optimizer = optimizer_from_config(args)
        self.state: TrainState = init_train_state(params, self.optimizer)
        self._update = make_ppo_update(self.actor_critic, self.settings, self.optimizer)
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

    def _default_value_model(self, policy, reward_module, dtype):
        """TRL initialises the value model from the reward model; with a reward function there is none, so
        the value model is the policy's backbone with a fresh score head."""
        if self.args.value_model_path is not None:
            from .models import load_pretrained
            return load_pretrained(self.args.value_model_path, kind="score", dtype=dtype)[0]
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
                         dict(reward_fn=self.reward_fn, tokenizer=self.tokenizer) if self.reward_fn is not None else
                         dict(reward_graphdef=self.reward_graphdef, reward_params=self.reward_params))
        return make_experience(queries, self._next_key(), self.rollout_settings,
                               policy_graphdef=self.actor_critic.policy_graphdef, policy_params=self.policy_params,
                               ref_params=self.ref_params, ref_graphdef=self.ref_graphdef, **value_kwargs,
                               **reward_kwargs)

    def _process_scores(self, experience: Experience) -> Experience:
        """Legacy score scaling / normalisation / clipping (off by default)."""
        args = self.args
        if not (args.use_score_scaling or args.score_clip is not None):
            return experience
        scores, self.score_moments = ppo.process_scores(
            experience.scores, self.score_moments, use_score_scaling=args.use_score_scaling,
            use_score_norm=args.use_score_norm, score_clip=args.score_clip)
        return experience.replace(scores=scores)

    def update(self, experience: Experience) -> dict[str, float]:
        """One PPO update on a rollout batch; moves the KL controller. Returns host metrics."""
        start = time.perf_counter()
        experience = self._process_scores(experience)
        self.state, metrics = self._update(self.state, experience, self._next_key(), jnp.float32(self.kl_coef))
        metrics = {name: float(value) for name, value in jax.device_get(metrics).items()}
        metrics["val/num_eos_tokens"] = float(experience.num_stop_tokens)
        batch = experience.scores.shape[0]
        if self.args.adaptive_kl:
            self.kl_coef = float(ppo.adaptive_kl_update(self.kl_coef, metrics["objective/kl"], batch,
                                                        self.args.target_kl_for_adaptive, self.args.horizon))
        self.episode += batch
        metrics["episode"] = float(self.episode)
        metrics["time/update_s"] = time.perf_counter() - start
        return metrics

    # ------------------------------------------------------------------------------------------------
    # train()
    # ------------------------------------------------------------------------------------------------
    def train(self, num_updates: Optional[int] = None, progress: bool = True) -> list[dict[str, float]]:
        """Run PPO for ``num_updates`` (default: all the config asks for). Returns one metrics dict per update."""
        if self.batches is None:
            raise ConfigError("train() needs prompts: pass train_dataset or set `dataset` in the config.")
        total = self.num_updates if num_updates is None else num_updates
        start_update = int(self.state.update_count)
        history = []
        sample_every = max(1, total // max(1, self.args.num_sample_generations))
        bar = None
        if progress:
            from tqdm.auto import tqdm
            bar = tqdm(total=total, initial=start_update, desc="ppo", unit="update", dynamic_ncols=True)
        for update_index in range(start_update, total):
            t0 = time.perf_counter()
            queries = next(self.batches).input_ids
            experience = self.rollout(queries)
            t1 = time.perf_counter()
            metrics = self.update(experience)
            wall = time.perf_counter() - t0
            metrics["time/rollout_s"] = t1 - t0
            metrics["eps"] = self.sizes.batch_size / wall
            history.append(metrics)
            if self.logger is not None:
                self.logger.log_metrics(update_index + 1, metrics)
            if bar is not None:
                bar.update(1)
                bar.set_postfix(score=f"{metrics['objective/scores']:.3f}", kl=f"{metrics['objective/kl']:.2f}",
                                eps=f"{metrics['eps']:.1f}")
            if self.args.num_sample_generations and (update_index % sample_every == 0 or update_index == total - 1):
                self.log_samples(update_index + 1)
        if bar is not None:
            bar.close()
        return history

    def sample_completions(self, queries, temperature: float = SAMPLE_TEMPERATURE):
        """Near-greedy completions (T = 0.01, as TRL's samples) -> (prompts, completions) strings."""
        settings = RolloutSettings(**{**self.rollout_settings.__dict__, "temperature": temperature})
        query_responses = sample_responses(self.actor_critic.policy_graphdef, self.policy_params,
                                           jnp.asarray(queries, jnp.int32), self._next_key(), settings)
        from .rollout import decode_rollout_text
        P = queries.shape[1]
        responses = ppo.truncate_response(query_responses[:, P:], self.stop_token_id, self.pad_token_id)
        return decode_rollout_text(self.tokenizer, np.asarray(queries), np.asarray(responses), self.pad_token_id)

    def log_samples(self, step: int, num: int = 4):
        if self.prompts is None or self.logger is None:
            return
        queries = self.prompts.input_ids[:num]
        prompts, completions = self.sample_completions(queries)
        scores = self.score_texts(prompts, completions)
        self.logger.log_samples(step, prompts, completions, scores)

    def score_texts(self, prompts: list[str], completions: list[str]) -> Optional[list[float]]:
        """Scores of given texts with the reward function (None for a reward model: tokenised scoring is the
        rollout's job)."""
        if self.reward_fn is None:
            return None
        from .rewards import call_reward_function
        return [float(s) for s in call_reward_function(self.reward_fn, prompts, completions)]

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
        check_scores(scores_np, n, name="step() scores")
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
        policy = nnx.merge(self.actor_critic.policy_graphdef, self.policy_params)
        return save_pretrained(policy, self.model_config, output_dir, tokenizer=self.tokenizer)
