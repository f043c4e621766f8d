"""Multi-turn episodes: the model and an environment take turns on ONE KV cache, inside the compiled program
(docs/agents.md, "How an episode is sampled").

    episodes = generate_episodes(graphdef, params, prompt_ids, key, shape=EpisodeShape(...), host_turn=..., ...)

One loop of decode steps plays every row, each at its own pace. At a step, every row that is writing a model turn
draws a token; a row's turn ends at the end-of-turn token (the stop token) or after ``turn_length`` tokens. At a
step where any row's turn ends, ``host_turn`` (the environment, reached through one host callback under a
``lax.cond``, :class:`~ppojax.rl.episodes.HostTurn`) reads those rows' turns and answers each with its observation,
already rendered through the chat template and tokenized once; each row that goes on takes in its observation at
once (the stop token and the observation's n tokens through the model on that row's cache alone, in the smallest
of a few fixed call sizes that holds 1 + n: ``observation_call_sizes``; its write index moves by 1 + n) and starts
its next turn at the next step, while the other rows go on writing theirs: no row waits for another's turn. The
loop is a ``lax.while_loop``, so the program compiles once whatever the number of turns, and the cache is never
rebuilt: a turn's prefill is its new tokens only.

The trained stream. Each row's tokens in the order they entered the conversation, with no gaps:

    stream i32[B, T]:  [turn 0 | observation 0 | turn 1 | ... | last turn | pad ...]
    environment_mask:  False on the model's tokens, True on the observations' (the update leaves them out)

The model's tokens are kept as sampled, never decoded and re-tokenized. Each cache row has its own write index and
positions count only the tokens fed, so every row's keys, values and positions are those of its stream as one
contiguous sequence: a plain forward over ``[prompt | stream]`` gives the sampler's log-probs
(tests/test_episodes.py).

Prompts. ``prompt_ids`` holds each prompt once; its G = ``group_size`` episodes (GRPO's group) are consecutive.
Every prompt is prefilled ONCE, in one call, on a bank of B / G rows holding the prompts' slots only; a row
starting an episode takes its prompt's keys, values and key mask from the bank (the slots past the prompt empty),
so a group's G episodes and every refill cost a copy, not a prefill. A batch filled up to its compiled size
(``episodes`` below B: a held-out scoring's last call, a sample table) prefills its prompts a rows' worth at a time,
only as many blocks as hold a played prompt.

Rows. With ``slots`` S below the batch's B episodes, the cache has S rows: when an episode ends, its row takes the
next waiting episode (in order) at once, from the bank (nothing of the previous episode survives). The episodes'
tokens are the ones S >= B would sample (the same keys per episode, below), up to the float rounding of another
batch shape.

Slots read. With ``segments`` above 1 the loop over every row runs as up to that many loops, each reading only the
first slots of the cache (its ``read_length``), as the single-turn sampler's decode segments do: a loop hands on
to the next, which reads more, when a playing row's next step could write past its slots (a decode token, then an
observation). Each is a loop body compiled once.

The tail. A batch ends with its few longest episodes, the other rows idle; a decode step costs about as much for
them as for busy rows where the step is compute-bound (a CPU). With ``tail_rows`` R (below the cache's rows), once
no episode waits and at most R rows still play, those rows are gathered into a cache of R rows and the loop goes
on there (a second loop body, compiled once, for R rows).

An episode ends when its environment says so, when a turn ends without the stop token (``turn_length`` reached,
the stream's ``T`` tokens used, or the pad token drawn, which ends a response for the update too: the episode is
truncated), or after ``max_turns`` turns. Episode ``b``'s stream token ``t`` draws with
``fold_in(fold_in(key, t), b)`` (``ppojax.rl.sampler.row_keys``), as a single-turn response's does, so the tokens do
not depend on which row plays the episode or when.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Callable, NamedTuple, Optional

import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx
from jax.experimental import io_callback

from ppojax.core.masks import INVALID_LOGPROB
from ppojax.parallel import batch_partition_spec
from ppojax.rl.sampler import (SLOT_ALIGNMENT, aligned_slots, cache_dtype_for, cache_rows, copy_into_rows,
                               init_model_cache, model_kernels, prefill, prefill_shared_prefix, prefill_slots, row_keys,
                               sample_rows, slot_alignment_of, token_logprobs)


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
        """Slots one episode's row needs: the prompt, every turn's tokens (the step its turn ends at writes a
        masked slot), and each observation with the stop token before it."""
        turns, observations = self.max_turns * self.turn_length, (self.max_turns - 1) * (1 + self.observation_length)
        return prompt_length + turns + observations


class HostAnswer(NamedTuple):
    """What the environment answers after a turn, per row.

    observation:        i32[S, O] the observation's tokens, LEFT padded with the pad id (the last one is real).
    observation_length: i32[S] how many of them are real (0: none).
    goes_on:            bool[S] the episode continues with another model turn.
    reward:             f32[S] this turn's reward (NaN: none).
    """

    observation: jax.Array
    observation_length: jax.Array
    goes_on: jax.Array
    reward: jax.Array


#: ``host_turn(turn i32[S], episode i32[S], tokens i32[S, turn_length], ended bool[S], running bool[S],
#: stream_length i32[S]) -> HostAnswer`` over the cache's S rows, called at a step where some rows' turns end:
#: ``running`` marks those rows (the others' answers are ignored), ``turn`` is the turn the row's episode just took
#: (0 for its first), ``episode`` the episode the row plays (its place in the batch; B for the rows not answered),
#: ``tokens`` the turn's tokens (pad after the last), ``ended`` whether the turn ended with the stop token,
#: ``stream_length`` the tokens its stream holds.
#: Traced: a function of arrays, or a host callback (``ppojax.agents.episodes``).
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
    busy_row_steps:     f32[] the loop's row-steps that drew a model token (``ppojax.rl.sampler.decode_work``'s busy).
    computed_row_steps: f32[] every row-step its decode steps computed (each step: the rows its cache holds then);
                        the observations' and the refills' prefills are counted in neither, as the continuous
                        sampler's refills are not.
    """

    stream: jax.Array
    environment_mask: jax.Array
    logprobs: jax.Array
    completed: jax.Array
    environment_reward: jax.Array
    turns: jax.Array
    busy_row_steps: Optional[jax.Array] = None
    computed_row_steps: Optional[jax.Array] = None


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
        call = jax.shard_map(call, mesh=mesh, in_specs=(rows, rows, rows, rows, rows, rows),
                             out_specs=(rows, rows, rows, rows))

    def host_turn(turn, episode, tokens, ended, running, stream_length):
        return HostAnswer(*call(turn, episode, tokens, ended, running, stream_length))

    return host_turn


@flax.struct.dataclass
class _Rows:
    """The step loop's per-row carry (S rows, each with its own cache write index).

    cache; logits: f32[S, V] each row's next-token logits; episode: i32[S] the episode it plays (B: none); turn:
    i32[S] the turns that episode has finished; turn_tokens: i32[S, Rt] the current turn's tokens (pad after the
    last); turn_step: i32[S] how many it has drawn; next_position: i32[S] the position of the row's next token;
    stream_length: i32[S] its stream's tokens; reward: f32[S] its turn rewards so far (NaN: none); running:
    bool[S] it plays one; next_episode: i32[] the first episode not started."""

    cache: object
    logits: jax.Array
    episode: jax.Array
    turn: jax.Array
    turn_tokens: jax.Array
    turn_step: jax.Array
    next_position: jax.Array
    stream_length: jax.Array
    reward: jax.Array
    running: jax.Array
    next_episode: jax.Array


@flax.struct.dataclass
class _Played:
    """What the loop writes per episode (B): stream, environment, logprobs [B, T]; completed, reward, turns and
    stream_length (its stream's tokens) [B]; and of its own work: busy f32[] (row-steps that drew a model token),
    computed f32[] (row-steps its decode steps computed)."""

    stream: jax.Array
    environment: jax.Array
    logprobs: jax.Array
    completed: jax.Array
    reward: jax.Array
    turns: jax.Array
    stream_length: jax.Array
    busy: jax.Array
    computed: jax.Array


def _one_row(cache, slot):
    """Row ``slot`` of ``cache`` (one write index per row) as a one-row cache with its own index."""
    return cache.replace(keys=jax.lax.dynamic_slice_in_dim(cache.keys, slot, 1, axis=1),
                         values=jax.lax.dynamic_slice_in_dim(cache.values, slot, 1, axis=1),
                         key_mask=jax.lax.dynamic_slice_in_dim(cache.key_mask, slot, 1, axis=0),
                         index=cache.index[slot])


def _prefill_prompts(model, prompt_ids, pad_token_id, cache_length: int, dtype, alignment: int,
                     prefix_length: int = 0, needed=None, block: int = 0):
    """Each prompt of ``prompt_ids`` i32[N, P] (left padded) through the model once -> (next-token logits f32[N, V],
    the bank: a cache of N rows holding the prompts' slots only (rounded up to ``alignment``), each row its own
    write index, real tokens i32[N]). prefix_length: the prompts' shared first tokens, through the model once for
    all (``ppojax.rl.sampler.prefill``). needed: i32[] (may be traced) or None: only the first this many prompts are
    played; with 0 < ``block`` < N their rests go through the model ``block`` rows at a time, and only the blocks
    that hold a needed prompt run (a filled-up batch costs the prompts it holds; the bank's other rows, which no
    episode reads, keep their logits and slots unfilled)."""
    prompts, prompt_length = prompt_ids.shape
    bank = init_model_cache(model, prompts, prefill_slots(prompt_length, cache_length, alignment), dtype)
    bank = bank.replace(index=jnp.zeros((prompts,), jnp.int32))
    if needed is None or not 0 < block < prompts:
        last, bank, real = prefill(model, prompt_ids, pad_token_id, bank, prefix_length)
        return model.logits(last)[:, 0], bank, real
    bank, rest, real = prefill_shared_prefix(model, prompt_ids, pad_token_id, bank, prefix_length)
    fresh = bank.index  # each row's write index before its rest: a row written again starts there again

    def one_block(i, carry):
        bank, last = carry
        start = jnp.minimum(i * block, prompts - block)  # the last block may overlap the one before: its rows are
        rows = jax.tree.map(lambda x: jax.lax.dynamic_slice_in_dim(x, start, block, axis=0), rest)  # written again
        part = cache_rows(bank, start + jnp.arange(block, dtype=jnp.int32))
        hidden, part = model(*rows, cache=part.replace(index=jax.lax.dynamic_slice_in_dim(fresh, start, block)))
        return (copy_into_rows(bank, part, start),
                jax.lax.dynamic_update_slice_in_dim(last, hidden[:, -1:].astype(last.dtype), start, axis=0))

    first, part = model(*jax.tree.map(lambda x: x[:block], rest), cache=cache_rows(bank, jnp.arange(block)))
    last = jnp.zeros((prompts,) + first.shape[1:], first.dtype).at[:block].set(first[:, -1:])
    blocks = (jnp.asarray(needed, jnp.int32) + block - 1) // block
    bank, last = jax.lax.fori_loop(1, blocks, one_block, (copy_into_rows(bank, part), last))
    return model.logits(last)[:, 0], bank, real


def _gather_rows(rows: _Rows, order) -> _Rows:
    """The rows ``order`` (i32[n]) of ``rows``, in that order: a loop of n rows."""
    def take(x):
        return jnp.take(x, order, axis=0)

    return rows.replace(cache=cache_rows(rows.cache, order), logits=take(rows.logits), episode=take(rows.episode),
                        turn=take(rows.turn),
                        turn_tokens=take(rows.turn_tokens), turn_step=take(rows.turn_step),
                        next_position=take(rows.next_position), stream_length=take(rows.stream_length),
                        reward=take(rows.reward), running=take(rows.running))


def read_bounds(prompt_length: int, cache_length: int, segments: int, alignment: int = SLOT_ALIGNMENT) -> list[int]:
    """The slots each of the step loops reads (module docstring, "Slots read"): up to ``segments`` bounds spread
    evenly from the prompt to the cache's end, rounded up to ``alignment``; the last is the whole cache. A loop
    of its own is worth its compile only where it reads at least half an ``alignment`` fewer slots than the next."""
    if segments < 1:
        raise ValueError(f"segments={segments}; expected >= 1")
    spread = cache_length - prompt_length
    bounds = sorted({aligned_slots(prompt_length + -(-spread * k // segments), cache_length, alignment)
                     for k in range(1, segments + 1)} | {cache_length})
    kept = [cache_length]
    for bound in reversed(bounds[:-1]):
        if kept[0] - bound >= alignment // 2:
            kept.insert(0, bound)
    return kept


def observation_call_sizes(observation_length: int, buckets: int = 4) -> tuple[int, ...]:
    """The token counts of the model calls that take in an observation (its stop token and up to
    ``observation_length`` tokens): ``buckets`` sizes spread evenly up to ``1 + observation_length``; an observation
    of n tokens takes the smallest that holds 1 + n. Each is a model call compiled once."""
    if buckets < 1:
        raise ValueError(f"observation buckets={buckets}; expected >= 1")
    full = 1 + observation_length
    return tuple(sorted({-(-full * k // buckets) for k in range(1, buckets + 1)}))


def tail_rows_for(rows: int, mesh=None) -> int:
    """The rows a batch's tail plays on (``generate_episodes``' ``tail_rows``): a quarter of the cache's ``rows``;
    0 (the whole loop on every row) on a mesh of several devices, whose rows are split over the devices and whose
    host callback takes each device's own."""
    if mesh is not None and mesh.size > 1:
        return 0
    return max(1, rows // 4) if rows >= 4 else 0


def _nan_sum(total, value):
    """NaN-as-absent addition: a NaN ``value`` leaves ``total``; a NaN ``total`` counts as 0 when one arrives."""
    return jnp.where(jnp.isnan(value), total, jnp.where(jnp.isnan(total), 0.0, total) + value)


@dataclasses.dataclass(frozen=True, eq=False)
class _Play:
    """What every step of one :func:`generate_episodes` call reads (module docstring): the model and its sampler,
    the sampling key and temperature, the episodes' shape and host, the pad and stop tokens, the prompts' bank
    (next-token logits f32[B / G, V], its cache, real tokens i32[B / G]), the observation call sizes, and the sizes:
    B episodes (``batch``; ``none``, i32[] = B, a row's episode when it holds none: its writes are dropped) on S
    cache rows (``num_rows``), of which the first ``episodes`` (i32[]) are played."""

    model: nnx.Module
    sample: Callable
    key: jax.Array
    temperature: object
    shape: EpisodeShape
    host_turn: HostTurn
    pad: jax.Array
    stop: jax.Array
    bank_logits: jax.Array
    bank: object
    bank_tokens: jax.Array
    cache_length: int
    group_size: int
    call_sizes: tuple[int, ...]
    batch: int
    none: jax.Array
    num_rows: int
    episodes: jax.Array

    def no_answer(self, turn, *_):
        """The host's answer at a step where no turn ended: no observation, nothing goes on, no reward."""
        n, obs_length = turn.shape[0], self.shape.observation_length
        return HostAnswer(jnp.full((n, obs_length), self.pad), jnp.zeros((n,), jnp.int32), jnp.zeros((n,), bool),
                          jnp.full((n,), jnp.nan, jnp.float32))

    def step(self, carry, refills=True):
        """One token for every row writing a turn; the host for the rows whose turns ended; the observations of
        those that go on appended; the freed rows refilled (``refills``). Any number of rows."""
        shape, model, pad, stop, none = self.shape, self.model, self.pad, self.stop, self.none
        length, turn_length, temperature = shape.episode_length, shape.turn_length, self.temperature
        rows, out = carry
        row_ids = jnp.arange(rows.running.shape[0], dtype=jnp.int32)
        writing = rows.running & (rows.stream_length < length)
        drawn = self.sample(rows.logits, row_keys(self.key, rows.stream_length, rows.episode))
        token = jnp.where(writing, drawn, pad)
        episode = jnp.where(rows.running, rows.episode, none)
        at = jnp.where(writing, rows.stream_length, length)  # out of range: dropped
        out = out.replace(stream=out.stream.at[episode, at].set(token, mode="drop"),
                          logprobs=out.logprobs.at[episode, at].set(
                              token_logprobs(rows.logits, drawn, temperature), mode="drop"),
                          busy=out.busy + jnp.sum(writing, dtype=jnp.float32),
                          computed=out.computed + rows.running.shape[0])
        stream_length = rows.stream_length + writing.astype(jnp.int32)
        turn_tokens = rows.turn_tokens.at[row_ids, jnp.where(rows.running, rows.turn_step, turn_length)].set(
            token, mode="drop")
        turn_step = rows.turn_step + rows.running.astype(jnp.int32)

        # a turn ends at the stop token, at a drawn pad, at its turn_length tokens or when the stream is full
        stopped = writing & (drawn == stop)
        turn_over = rows.running & (~writing | stopped | (drawn == pad) | (turn_step >= turn_length)
                                    | (stream_length >= length))
        answer = jax.lax.cond(jnp.any(turn_over), self.host_turn, self.no_answer, rows.turn,
                              jnp.where(turn_over, rows.episode, none), turn_tokens, stopped, turn_over, stream_length)
        goes_on = turn_over & stopped & answer.goes_on & (rows.turn + 1 < shape.max_turns)
        reward = jnp.where(turn_over, _nan_sum(rows.reward, answer.reward.astype(jnp.float32)), rows.reward)
        finished = jnp.where(turn_over & ~goes_on, rows.episode, none)  # the episodes that end now
        out = out.replace(completed=out.completed.at[finished].set(stopped & ~answer.goes_on, mode="drop"),
                          reward=out.reward.at[finished].set(reward, mode="drop"),
                          turns=out.turns.at[finished].set(rows.turn + 1, mode="drop"),
                          stream_length=out.stream_length.at[finished].set(stream_length, mode="drop"))

        # the turns going on: their tokens through the model in one call of one token per row
        live = rows.running & ~turn_over
        hidden, cache = model(jnp.where(live, token, 0)[:, None], live[:, None], rows.next_position[:, None],
                              cache=rows.cache)
        rows = rows.replace(
            cache=cache, logits=model.logits(hidden)[:, 0], turn=rows.turn + goes_on.astype(jnp.int32),
            turn_tokens=jnp.where(turn_over[:, None], pad, turn_tokens), turn_step=jnp.where(turn_over, 0, turn_step),
            next_position=rows.next_position + live.astype(jnp.int32), stream_length=stream_length,
            reward=reward, running=rows.running & ~(turn_over & ~goes_on))
        rows, out, _, _ = jax.lax.while_loop(lambda state: jnp.any(state[2]), self.append_one,
                                             (rows, out, goes_on, answer))
        return (self.refill(rows) if refills else rows), out

    def take_in(self, one, ids, live, positions, last):
        """``ids`` i32[1 + O] (live first: ``live``, at ``positions``) through the model on the one-row cache
        ``one``, as the first ``size`` of them for the smallest of ``call_sizes`` that holds ``last + 1`` (one
        ``lax.switch`` branch per size) -> (the cache, the logits f32[V] at column ``last``)."""
        model = self.model

        def call(size):
            def run(one):
                hidden, one = model(jnp.where(live, ids, 0)[None, :size], live[None, :size],
                                    positions[None, :size], cache=one)
                return one, model.logits(jax.lax.dynamic_slice_in_dim(hidden, last, 1, axis=1))[0, 0]
            return run

        index = jnp.sum(jnp.asarray(self.call_sizes) < last + 1)  # the smallest call that holds the live tokens
        return jax.lax.switch(index, [call(size) for size in self.call_sizes], one)

    def append_one(self, state):
        """The first row in ``waiting`` (bool[S]) takes in its observation: the turn's stop token and the n tokens
        of the observation through the model in one call on that row's cache alone (the other rows' are not
        touched), the smallest of ``call_sizes`` that holds them, live tokens first; the row's write index moves
        by 1 + n (the call's padding slots are masked and written over next). Its tokens are appended to the
        episode's stream; its last live logits start the row's next turn."""
        obs_length, length = self.shape.observation_length, self.shape.episode_length
        rows, out, waiting, answer = state
        slot = jnp.argmax(waiting).astype(jnp.int32)
        n = answer.observation_length[slot]
        columns = jnp.arange(obs_length, dtype=jnp.int32)
        observation = jnp.roll(answer.observation[slot].astype(jnp.int32), n - obs_length)  # live tokens first
        ids = jnp.concatenate([self.stop[None], observation])
        live = jnp.arange(1 + obs_length) <= n
        positions = rows.next_position[slot] + jnp.arange(1 + obs_length, dtype=jnp.int32)
        start = rows.cache.index[slot]
        one, logits = self.take_in(_one_row(rows.cache, slot), ids, live, positions, n)
        e, at = rows.episode[slot], jnp.where(columns < n, rows.stream_length[slot] + columns, length)
        out = out.replace(stream=out.stream.at[e, at].set(observation, mode="drop"),
                          environment=out.environment.at[e, at].set(True, mode="drop"))
        rows = rows.replace(cache=copy_into_rows(rows.cache, one.replace(index=start + 1 + n), slot),
                            logits=rows.logits.at[slot].set(logits),
                            next_position=rows.next_position.at[slot].add(1 + n),
                            stream_length=rows.stream_length.at[slot].add(n))
        return rows, out, waiting.at[slot].set(False), answer

    def refill_one(self, rows):
        """The next waiting episode into the first free row: its prompt's row of the bank copied over the row's."""
        pad = self.pad
        slot, e = jnp.argmax(~rows.running).astype(jnp.int32), rows.next_episode
        prompt = e // self.group_size
        one = cache_rows(self.bank, prompt[None], self.cache_length)
        return rows.replace(
            cache=copy_into_rows(rows.cache, one, slot),
            logits=rows.logits.at[slot].set(self.bank_logits[prompt]),
            episode=rows.episode.at[slot].set(e), turn=rows.turn.at[slot].set(0),
            turn_tokens=rows.turn_tokens.at[slot].set(pad), turn_step=rows.turn_step.at[slot].set(0),
            next_position=rows.next_position.at[slot].set(self.bank_tokens[prompt]),
            stream_length=rows.stream_length.at[slot].set(0), reward=rows.reward.at[slot].set(jnp.nan),
            running=rows.running.at[slot].set(True), next_episode=e + 1)

    def refill(self, rows):
        """Every free row refilled while an episode waits (nothing to do when the cache holds every episode)."""
        if self.num_rows == self.batch:
            return rows
        return jax.lax.while_loop(lambda r: jnp.any(~r.running) & (r.next_episode < self.episodes), self.refill_one,
                                  rows)


def generate_episodes(graphdef, params, prompt_ids, key, *, shape: EpisodeShape, host_turn: HostTurn,
                      pad_token_id: int, stop_token_id: int, temperature=1.0, top_k: int = 0, top_p: float = 1.0,
                      greedy: bool = False, cache_dtype=None, init_cache_fn=None, slots: int = 0,
                      group_size: int = 1, tail_rows: int = 0, segments: int = 1,
                      slot_alignment: int | None = None, observation_buckets: int = 4,
                      prefix_length: int = 0, episodes=None) -> Episodes:
    """Sample a batch of multi-turn episodes (module docstring). Pure apart from ``host_turn``; call it under jit.

    graphdef, params: ``nnx.split(causal_lm)``; prompt_ids: i32[B / G, P] left padded, each prompt once (its G =
    ``group_size`` episodes consecutive: episode b plays prompt b // G); key: a PRNG key; temperature may be
    traced. Static: shape, host_turn, pad_token_id, stop_token_id (the end of a turn), top_k, top_p, greedy,
    cache_dtype, init_cache_fn (as ``ppojax.rl.sampler.generate``'s), slots: the cache's rows, S (0 or at least B:
    one row per episode); with fewer, an episode that ends frees its row for the next waiting one (module
    docstring, "Rows"), group_size, tail_rows: the rows the batch's tail plays on (module docstring, "The tail"; 0 or
    at least the cache's rows: off; :func:`tail_rows_for`), segments and slot_alignment: the loops over every row and
    the slots each reads (module docstring, "Slots read"; :func:`read_bounds`; None: the model's kernels'
    alignment, ``ppojax.rl.sampler.slot_alignment_of``), observation_buckets: the sizes of the calls that take in
    an observation (:func:`observation_call_sizes`), prefix_length: the prompts' shared first tokens (a system
    message), prefilled once for all (``ppojax.rl.sampler.prefill``; 0: off), episodes: i32[] (may be traced) or
    None: only the first this many episodes are played, the others left empty (no token, no turn, their
    environments never stepped): a batch filled up to its compiled size (a last evaluation batch) costs the
    episodes it holds (the tail's rows take them as soon as at most that many play). -> ``Episodes`` of B rows.
    """
    prompts, prompt_length = prompt_ids.shape
    batch = prompts * group_size
    num_rows = batch if not slots else min(slots, batch)
    turn_length, obs_length, length = shape.turn_length, shape.observation_length, shape.episode_length
    model = nnx.merge(graphdef, params)
    pad = jnp.int32(pad_token_id)
    dtype, cache_length = cache_dtype_for(model, params, cache_dtype), shape.cache_length(prompt_length)
    row_ids = jnp.arange(num_rows, dtype=jnp.int32)
    alignment = slot_alignment_of(model, slot_alignment)
    live = jnp.int32(batch) if episodes is None else jnp.minimum(jnp.asarray(episodes, jnp.int32), batch)

    # every prompt prefilled once (module docstring, "Prompts"); the first S episodes' rows copied from the bank
    bank_logits, bank, bank_tokens = _prefill_prompts(
        model, prompt_ids, pad_token_id, cache_length, dtype, alignment, prefix_length,
        needed=None if episodes is None else (live + group_size - 1) // group_size, block=num_rows // group_size)
    first = row_ids // group_size
    started = cache_rows(bank, first)  # the prompts' slots only: the empty cache's other slots stay empty
    # written into the empty cache (its placement on a mesh), one write index per row: rows run apart
    cache = copy_into_rows((init_cache_fn or init_model_cache)(model, num_rows, cache_length, dtype), started)
    play = _Play(model=model, sample=functools.partial(sample_rows, temperature=temperature, top_k=top_k, top_p=top_p,
                                                       greedy=greedy, argmax=model_kernels(model).argmax),
                 key=key, temperature=temperature, shape=shape, host_turn=host_turn, pad=pad,
                 stop=jnp.int32(stop_token_id), bank_logits=bank_logits, bank=bank, bank_tokens=bank_tokens,
                 cache_length=cache_length, group_size=group_size,
                 call_sizes=observation_call_sizes(obs_length, observation_buckets), batch=batch,
                 none=jnp.int32(batch), num_rows=num_rows, episodes=live)

    rows = _Rows(cache=cache, logits=bank_logits[first], episode=row_ids, turn=jnp.zeros_like(row_ids),
                 turn_tokens=jnp.full((num_rows, turn_length), pad), turn_step=jnp.zeros_like(row_ids),
                 next_position=bank_tokens[first],
                 stream_length=jnp.zeros_like(row_ids), reward=jnp.full((num_rows,), jnp.nan, jnp.float32),
                 running=row_ids < live, next_episode=jnp.int32(num_rows))
    out = _Played(stream=jnp.full((batch, length), pad), environment=jnp.zeros((batch, length), bool),
                  logprobs=jnp.zeros((batch, length), jnp.float32), completed=jnp.zeros((batch,), bool),
                  reward=jnp.full((batch,), jnp.nan, jnp.float32), turns=jnp.zeros((batch,), jnp.int32),
                  stream_length=jnp.zeros((batch,), jnp.int32), busy=jnp.float32(0), computed=jnp.float32(0))

    def playing(carry):
        return jnp.any(carry[0].running)

    tail = tail_rows if 0 < tail_rows < num_rows else 0

    def needs_every_row(carry):  # an episode waits, or more rows play than the tail's
        rows = carry[0]
        return playing(carry) & ((rows.next_episode < live) | (jnp.sum(rows.running) > tail))

    every_row = needs_every_row if tail else playing

    def reading(rows, bound):
        return rows.replace(cache=rows.cache.replace(read_length=None if bound == cache_length else bound))

    for bound in read_bounds(prompt_length, cache_length, segments, alignment):
        def within(carry, bound=bound):  # a decode token, then the stop token and an observation, fit below bound
            rows = carry[0]
            furthest = jnp.max(jnp.where(rows.running, rows.cache.index, 0))
            return every_row(carry) & (furthest + 2 + obs_length <= bound)

        rows, out = jax.lax.while_loop(every_row if bound == cache_length else within, play.step,
                                       (reading(rows, bound), out))
    if tail:
        playing_first = jnp.argsort(~rows.running, stable=True)[:tail].astype(jnp.int32)
        _, out = jax.lax.while_loop(playing, functools.partial(play.step, refills=False),
                                    (_gather_rows(rows, playing_first), out))
    written = jnp.arange(length)[None, :] < out.stream_length[:, None]
    logprobs = jnp.where(written & ~out.environment, out.logprobs, INVALID_LOGPROB)
    return Episodes(out.stream, out.environment, logprobs, out.completed, out.reward, out.turns,
                    busy_row_steps=out.busy, computed_row_steps=out.computed)
