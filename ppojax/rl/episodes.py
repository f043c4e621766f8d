"""Multi-turn episodes: the model and an environment take turns on ONE KV cache, inside the compiled program
(docs/agents.md, "How an episode is sampled").

    episodes = generate_episodes(graphdef, params, prompt_ids, key, shape=EpisodeShape(...), host_turn=..., ...)

A model turn samples until the end-of-turn token (the stop token) or ``turn_length`` tokens; then ``host_turn``
(the environment, reached through one host callback, :class:`~ppojax.rl.episodes.HostTurn`) reads the turn's
tokens and answers each episode with the tokens of its observation, already rendered through the chat template
and tokenized once; those tokens go through the model and the next turn starts where they end. The turn loop is a
``lax.while_loop`` in the same program as the decode loop, so the program compiles once whatever the number of
turns, and the cache is never rebuilt: a turn's prefill is its new tokens only, ``1 + observation_length`` per row
(the turn's last sampled token, not yet fed, and the observation, left padded).

The trained stream. Each row's tokens in the order they entered the conversation, with no gaps:

    stream i32[B, T]:  [turn 0 | observation 0 | turn 1 | ... | last turn | pad ...]
    environment_mask:  False on the model's tokens, True on the observations' (the update leaves them out)

The model's tokens are kept as sampled, never decoded and re-tokenized. The cache's slots are shared by the rows in
time (one write index): a row that writes nothing at a step writes a masked slot, and positions count only real
tokens, so every row's keys, values and positions are those of its stream as one contiguous sequence: a plain
forward over ``[prompt | stream]`` gives the sampler's log-probs (tests/test_episodes.py).

An episode ends when its environment says so, when a turn ends without the stop token (``turn_length`` reached,
the stream's ``T`` tokens used, or the pad token drawn, which ends a response for the update too: the episode is
truncated), or after ``max_turns`` turns. Row ``b``'s stream
token ``t`` draws with ``fold_in(fold_in(key, t), b)`` (``ppojax.rl.sampler.row_keys``), as a single-turn
response's does.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
from flax import nnx
from jax.experimental import io_callback
from jax.sharding import PartitionSpec

from ppojax.core.masks import INVALID_LOGPROB
from ppojax.parallel import batch_partition_spec
from ppojax.rl.forward import sequence_inputs
from ppojax.rl.sampler import (_cache_dtype, _init_cache, decode_step, model_kernels, row_keys, sample_rows,
                               token_logprobs)


@dataclasses.dataclass(frozen=True)
class EpisodeShape:
    """The static sizes of a batch of episodes (every buffer's shape follows from them; none depends on the run).

    turn_length:        tokens the model may write in one turn (its end-of-turn token included).
    observation_length: tokens one observation may add (the template's framing included).
    max_turns:          model turns per episode (TRL's ``max_tool_calling_iterations`` + 1).
    episode_length:     T, the stream's tokens: the model's and the observations' together (TRL's
                        ``max_completion_length`` for tool-calling runs).
    """

    turn_length: int
    observation_length: int
    max_turns: int
    episode_length: int

    def __post_init__(self):
        for name in ("turn_length", "observation_length", "max_turns", "episode_length"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)}; expected >= 1")

    def cache_length(self, prompt_length: int) -> int:
        """Slots the cache needs: the prompt, every turn's tokens, and each observation with the token before it."""
        turns, observations = self.max_turns * self.turn_length, (self.max_turns - 1) * (1 + self.observation_length)
        return prompt_length + turns + observations


class HostAnswer(NamedTuple):
    """What the environment answers after a turn, per row.

    observation:        i32[B, O] the observation's tokens, LEFT padded with the pad id (the last one is real).
    observation_length: i32[B] how many of them are real (0: none).
    goes_on:            bool[B] the episode continues with another model turn.
    reward:             f32[B] this turn's reward (NaN: none).
    """

    observation: jax.Array
    observation_length: jax.Array
    goes_on: jax.Array
    reward: jax.Array


#: ``host_turn(turn i32[], episode i32[B], tokens i32[B, turn_length], ended bool[B], running bool[B],
#: stream_length i32[B]) -> HostAnswer``: ``episode`` is each row's place in the batch, ``tokens`` the turn's tokens
#: (pad where the row wrote none), ``ended`` whether the turn ended with the stop token, ``running`` whether the
#: episode was still on this turn, ``stream_length`` the tokens its stream holds. Traced: a function of arrays, or
#: a host callback (``ppojax.agents.episodes``).
HostTurn = Callable[..., HostAnswer]


class Episodes(NamedTuple):
    """A batch of sampled episodes (module docstring).

    stream:             i32[B, T] the model's and the observations' tokens in order, pad after the last.
    environment_mask:   bool[B, T] True on the observations' tokens.
    logprobs:           f32[B, T] the sampler's log-probs of the model's tokens; INVALID_LOGPROB elsewhere.
    completed:          bool[B] the episode ended by its environment after a turn that ended with the stop token
                        (not truncated): the multi-turn ``contains_stop``.
    environment_reward: f32[B] the sum of the environment's turn rewards (NaN where it gave none).
    turns:              i32[B] model turns taken.
    """

    stream: jax.Array
    environment_mask: jax.Array
    logprobs: jax.Array
    completed: jax.Array
    environment_reward: jax.Array
    turns: jax.Array


@dataclasses.dataclass(frozen=True, eq=False)
class EpisodeSource:
    """What a program plays its episodes against (``PPOProgram.episodes``; hashable by identity).

    host_turn: the :data:`HostTurn` (``host_callback(EpisodeHost.turn, ...)`` in a run); reward_name: the
    environment's reward among the run's rewards (its turn rewards and ``get_reward()``, weight 1, as TRL adds an
    environment's), or None: the environment gives none (standalone tools)."""

    host_turn: HostTurn
    reward_name: Optional[str] = None


def first_turn_only(shape: EpisodeShape, pad_token_id: int) -> HostTurn:
    """A traced stand-in environment that ends every episode after its first turn (no host): the programs keep
    their full shapes, for compiling them without the run's environment (``ppojax plan``)."""
    def host_turn(turn, episode, tokens, ended, running, stream_length):
        n = episode.shape[0]
        return HostAnswer(jnp.full((n, shape.observation_length), pad_token_id, jnp.int32), jnp.zeros((n,), jnp.int32),
                          jnp.zeros((n,), bool), jnp.full((n,), jnp.nan, jnp.float32))

    return host_turn


def host_callback(turn_fn, shape: EpisodeShape, mesh=None) -> HostTurn:
    """A :data:`HostTurn` that runs ``turn_fn`` on the host (``ppojax.agents.EpisodeHost.turn``: numpy arrays in,
    ``(observation i32[n, O], observation_length i32[n], goes_on bool[n], reward f32[n])`` out) through one
    ``io_callback`` per turn. On a mesh (``mesh``, more than one device) each device calls it with its own rows
    (``shard_map``), as Python reward functions are called. Unordered: the turn loop's data dependencies order
    the calls of one batch; ``turn_fn`` is user code with effects, so it is never assumed pure."""
    width = shape.observation_length

    def call(turn, episode, tokens, ended, running, stream_length):
        n = episode.shape[0]
        shapes = (jax.ShapeDtypeStruct((n, width), jnp.int32), jax.ShapeDtypeStruct((n,), jnp.int32),
                  jax.ShapeDtypeStruct((n,), jnp.bool_), jax.ShapeDtypeStruct((n,), jnp.float32))
        return io_callback(turn_fn, shapes, turn, episode, tokens, ended, running, stream_length, ordered=False)

    if mesh is not None and mesh.size > 1:
        rows = batch_partition_spec(mesh)
        call = jax.shard_map(call, mesh=mesh, in_specs=(PartitionSpec(), rows, rows, rows, rows, rows),
                             out_specs=(rows, rows, rows, rows))

    def host_turn(turn, episode, tokens, ended, running, stream_length):
        return HostAnswer(*call(turn, episode, tokens, ended, running, stream_length))

    return host_turn


def _nan_sum(total, value):
    """NaN-as-absent addition: a NaN ``value`` leaves ``total``; a NaN ``total`` counts as 0 when one arrives."""
    return jnp.where(jnp.isnan(value), total, jnp.where(jnp.isnan(total), 0.0, total) + value)


def generate_episodes(graphdef, params, prompt_ids, key, *, shape: EpisodeShape, host_turn: HostTurn,
                      pad_token_id: int, stop_token_id: int, temperature=1.0, top_k: int = 0, top_p: float = 1.0,
                      greedy: bool = False, cache_dtype=None, init_cache_fn=None) -> Episodes:
    """Sample a batch of multi-turn episodes (module docstring). Pure apart from ``host_turn``; call it under jit.

    graphdef, params: ``nnx.split(causal_lm)``; prompt_ids: i32[B, P] left padded; key: a PRNG key; temperature
    may be traced. Static: shape, host_turn, pad_token_id, stop_token_id (the end of a turn), top_k, top_p, greedy,
    cache_dtype, init_cache_fn (as ``ppojax.rl.sampler.generate``'s).
    """
    batch, prompt_length = prompt_ids.shape
    turn_length, obs_length, length = shape.turn_length, shape.observation_length, shape.episode_length
    model = nnx.merge(graphdef, params)
    sample = functools.partial(sample_rows, temperature=temperature, top_k=top_k, top_p=top_p, greedy=greedy,
                               argmax=model_kernels(model).argmax)
    rows = jnp.arange(batch, dtype=jnp.int32)
    pad, stop = jnp.int32(pad_token_id), jnp.int32(stop_token_id)

    cache = (init_cache_fn or _init_cache)(model, batch, shape.cache_length(prompt_length),
                                           _cache_dtype(model, params, cache_dtype))
    input_ids, attention_mask, position_ids = sequence_inputs(prompt_ids, pad_token_id)
    hidden, cache = model(input_ids, attention_mask, position_ids, cache=cache)
    logits = model.logits(hidden[:, -1:])[:, 0]

    def draw(logits, writing, stream, logprobs, stream_length):
        """One token for each row that is writing, appended to its stream (the others draw pad)."""
        token = jnp.where(writing, sample(logits, row_keys(key, stream_length, rows)), pad)
        at = jnp.where(writing, stream_length, length)  # out of range: dropped
        stream = stream.at[rows, at].set(token, mode="drop")
        logprobs = logprobs.at[rows, at].set(token_logprobs(logits, token, temperature), mode="drop")
        return token, stream, logprobs, stream_length + writing.astype(jnp.int32)

    def decode_turn(cache, logits, next_position, stream, logprobs, stream_length, running):
        """One model turn for every running row -> its tokens i32[B, Rt], whether it ended with the stop token, the
        last token drawn (not yet fed to the model) and the updated buffers."""
        writing = running & (stream_length < length)
        token, stream, logprobs, stream_length = draw(logits, writing, stream, logprobs, stream_length)
        ended = writing & (token == stop)
        writing = writing & ~ended & (token != pad)
        tokens = jnp.full((batch, turn_length), pad).at[:, 0].set(token)

        def cond(carry):
            step, writing = carry[0], carry[-1]
            return (step < turn_length) & jnp.any(writing)

        def body(carry):
            step, cache, token, next_position, stream, logprobs, stream_length, tokens, ended, writing = carry
            logits, cache, fed = decode_step(graphdef, params, cache, token, next_position, pad_token_id)
            next_position = next_position + fed.astype(jnp.int32)
            writing = writing & (stream_length < length)
            token, stream, logprobs, stream_length = draw(logits, writing, stream, logprobs, stream_length)
            tokens = jax.lax.dynamic_update_slice(tokens, token[:, None], (jnp.int32(0), step))
            ended = ended | (writing & (token == stop))
            return (step + 1, cache, token, next_position, stream, logprobs, stream_length, tokens, ended,
                    writing & (token != stop) & (token != pad))

        carry = (jnp.int32(1), cache, token, next_position, stream, logprobs, stream_length, tokens, ended, writing)
        _, cache, token, next_position, stream, logprobs, stream_length, tokens, ended, _ = jax.lax.while_loop(
            cond, body, carry)
        return cache, token, next_position, stream, logprobs, stream_length, tokens, ended

    def append(cache, pending, answer, goes_on, next_position, stream, environment, stream_length):
        """The turn's last drawn token and the observation through the model in one call of 1 + O tokens per row;
        the observation's tokens appended to the streams -> the next turn's first logits."""
        columns = jnp.arange(obs_length, dtype=jnp.int32)[None, :]
        first_real = obs_length - answer.observation_length[:, None]
        observed = goes_on[:, None] & (columns >= first_real)
        ids = jnp.concatenate([pending[:, None], answer.observation.astype(jnp.int32)], axis=1)
        live = jnp.concatenate([(goes_on & (pending != pad))[:, None], observed], axis=1)
        counted = live.astype(jnp.int32)
        positions = next_position[:, None] + jnp.cumsum(counted, axis=1) - counted
        hidden, cache = model(jnp.where(live, ids, 0), live, positions, cache=cache)
        at = jnp.where(observed, stream_length[:, None] + columns - first_real, length)
        stream = stream.at[rows[:, None], at].set(answer.observation.astype(jnp.int32), mode="drop")
        environment = environment.at[rows[:, None], at].set(True, mode="drop")
        stream_length = stream_length + jnp.where(goes_on, answer.observation_length, 0)
        return (model.logits(hidden[:, -1:])[:, 0], cache, next_position + jnp.sum(counted, axis=1), stream,
                environment, stream_length)

    def turn_cond(carry):
        turn, running = carry[0], carry[-1]
        return (turn < shape.max_turns) & jnp.any(running)

    def turn_body(carry):
        (turn, cache, logits, next_position, stream, environment, logprobs, stream_length, completed, reward, turns,
         running) = carry
        cache, pending, next_position, stream, logprobs, stream_length, tokens, ended = decode_turn(
            cache, logits, next_position, stream, logprobs, stream_length, running)
        answer = host_turn(turn, rows, tokens, ended, running, stream_length)
        last_turn = turn + 1 >= shape.max_turns
        goes_on = running & ended & answer.goes_on & ~last_turn
        reward = jnp.where(running, _nan_sum(reward, answer.reward.astype(jnp.float32)), reward)
        completed = completed | (running & ended & ~answer.goes_on)
        turns = turns + running.astype(jnp.int32)

        def appended(args):
            return append(*args)

        def skipped(args):
            cache, _, _, _, next_position, stream, environment, stream_length = args
            return logits, cache, next_position, stream, environment, stream_length

        logits, cache, next_position, stream, environment, stream_length = jax.lax.cond(
            jnp.any(goes_on), appended, skipped,
            (cache, pending, answer, goes_on, next_position, stream, environment, stream_length))
        return (turn + 1, cache, logits, next_position, stream, environment, logprobs, stream_length, completed,
                reward, turns, goes_on)

    carry = (jnp.int32(0), cache, logits, jnp.sum(attention_mask, axis=-1, dtype=jnp.int32),
             jnp.full((batch, length), pad), jnp.zeros((batch, length), bool), jnp.zeros((batch, length), jnp.float32),
             jnp.zeros((batch,), jnp.int32), jnp.zeros((batch,), bool), jnp.full((batch,), jnp.nan, jnp.float32),
             jnp.zeros((batch,), jnp.int32), jnp.ones((batch,), bool))
    (_, _, _, _, stream, environment, logprobs, stream_length, completed, reward, turns,
     _) = jax.lax.while_loop(turn_cond, turn_body, carry)
    written = jnp.arange(length)[None, :] < stream_length[:, None]
    logprobs = jnp.where(written & ~environment, logprobs, INVALID_LOGPROB)
    return Episodes(stream, environment, logprobs, completed, reward, turns)
