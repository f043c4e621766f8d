"""TRL <= 0.11's user-driven loop, for users who score responses themselves::

    responses = trainer.generate(query_token_ids)             # list of token-id arrays, cut at the stop token
    stats = trainer.step(query_token_ids, responses, scores)  # one PPO update (forwards + update, one program)

Queries and responses are token ids of any length up to ``max_prompt_length`` / ``response_length``; they are
padded here to the static shapes the compiled programs use.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ppojax import core as ppo
from ppojax.rl import rollout
from ppojax import parallel
from ppojax.trainer.config import ConfigError
from ppojax.trainer.data import left_pad
from ppojax.trainer.loop import step_key
from ppojax.rl.rewards import check_scores
from ppojax.rl.program import make_legacy_step


class LegacyAPI:
    """``generate()`` / ``step()`` on a :class:`~ppojax.trainer.build.Run` (the trainer mixes this in)."""

    run: object  # a ppojax.trainer.build.Run

    def _pad_queries(self, queries: Sequence[Sequence[int]]) -> np.ndarray:
        P = self.run.config.max_prompt_length
        too_long = [i for i, q in enumerate(queries) if len(q) > P]
        if too_long:
            raise ConfigError(f"query {too_long[0]} has {len(queries[too_long[0]])} tokens, more than "
                              f"max_prompt_length={P}; raise max_prompt_length or shorten it.")
        return left_pad([list(map(int, q)) for q in queries], P, self.run.settings.sampling.pad_token_id)

    def generate(self, queries: Sequence[Sequence[int]], *, temperature=None, greedy=False,
                 key=None) -> list[np.ndarray]:
        """Sample a response for each query (token ids). Returns the responses cut after the stop token
        (no padding). temperature: default the config's; greedy: argmax decoding; key: PRNG key (default:
        derived from the seed and the number of calls so far)."""
        # the caller's queries need not start with the run's prompts' shared prefix (shared_prompt_prefix)
        sampling = dataclasses.replace(self.run.settings.sampling, prompt_prefix=0)
        padded = self._pad_queries(queries)
        if key is None:
            self._generate_calls = getattr(self, "_generate_calls", 0) + 1
            key = jax.random.fold_in(jax.random.key(self.run.config.seed + 2), self._generate_calls)
        query_responses = rollout.sample_jit(
            self.policy_graphdef, self.policy_params, jnp.asarray(padded),
            key, jnp.float32(sampling.temperature if temperature is None else temperature), sampling=sampling,
            greedy=greedy, mesh=self.run.mesh)
        responses = parallel.to_host(ppo.truncate_response(  # a collective on a multi-process mesh
            query_responses[:, padded.shape[1]:], sampling.stop_token_id, sampling.pad_token_id))
        completions = []
        for row in responses:
            pads = np.flatnonzero(row == sampling.pad_token_id)
            completions.append(row[:pads[0]] if pads.size else row)
        return completions

    def step(self, queries: Sequence[Sequence[int]], responses: Sequence[Sequence[int]],
             scores: Sequence[float]) -> dict[str, float]:
        """One PPO update on caller-given queries, responses (token ids) and scores. Returns host metrics."""
        run = self.run
        n = len(queries)
        if run.settings.dynamic_sampling is not None:
            raise ConfigError("step() trains on the responses and scores it is given, but filter_groups=True (DAPO's "
                              "dynamic sampling) samples further prompts to replace the groups whose scores are all "
                              "equal; remove filter_groups, or use train().")
        if not (len(responses) == len(scores) == n):
            raise ConfigError(f"step() got {n} queries, {len(responses)} responses and {len(scores)} scores; "
                              "they must have the same length.")
        if n != run.settings.batch.batch_size:
            raise ConfigError(f"step() got {n} queries; expected batch_size={run.settings.batch.batch_size} (the "
                              "update's static shape). Set batch_size in the config to your batch.")
        scores_np = check_scores(np.asarray(scores, np.float32).reshape(-1), n, name="step() scores",
                                 allow_nonfinite=run.config.on_nonfinite_reward == "skip")
        R = run.config.response_length
        padded_responses = np.full((n, R), run.settings.sampling.pad_token_id, np.int32)
        for i, response in enumerate(responses):
            if len(response) > R:
                raise ConfigError(f"response {i} has {len(response)} tokens, more than response_length={R}; "
                                  "raise response_length.")
            padded_responses[i, :len(response)] = np.asarray(response, np.int32)
        queries_np = self._pad_queries(queries)
        if getattr(self, "_legacy_step", None) is None:
            self._legacy_step = make_legacy_step(run.program, queries_np.shape[1], run.state_shardings)
        query_responses = np.concatenate([queries_np, padded_responses], axis=1)
        update_index = int(run.state.update_count)
        run.state, metrics = self._legacy_step(run.state, query_responses, scores_np,
                                               step_key(run.config.seed, update_index))
        return {name: float(value) for name, value in parallel.to_host(metrics).items()}
