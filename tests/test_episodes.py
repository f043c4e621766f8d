"""Multi-turn episodes on one KV cache (ppojax.rl.episodes), against independent references:

- the stream is each row's turns and observations in order, as a plain Python replay of the scripted environment
  says (turn boundaries at the stop token, observations where the environment put them, nothing after the end);
- the sampler's log-probs of the model's tokens equal a plain forward over [prompt | stream] (the cache kept across
  turns, with the rows' idle slots masked, is the contiguous conversation);
- the environment mask is True exactly on the observations' tokens;
- a turn's prefill is its new tokens (the model calls traced: the prompt once, one token per row and step, and an
  observation with the stop token before it on its row alone; the calls run counted: each observation of n tokens
  in the smallest call size that holds 1 + n);
- one compiled program for every turn, and a second batch with other prompts and key does not recompile;
- with fewer rows than episodes, or G episodes per prompt, the same episodes as one row per episode with every
  prompt written out, the prompts prefilled once (a refill is a copy).
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ppojax.models import CausalLM
from ppojax.core.masks import INVALID_LOGPROB
from ppojax.rl.episodes import EpisodeShape, HostAnswer, generate_episodes, observation_call_sizes
from ppojax.rl.forward import response_logprobs
from ppojax.rl.sampler import generate_jit
from tests.tiny_setup import tiny_policy

PAD, B, P = 0, 12, 5
SHAPE = EpisodeShape(turn_length=6, observation_length=5, max_turns=3, episode_length=24)
OBSERVATION_CALLS = {(1, size) for size in observation_call_sizes(SHAPE.observation_length)}
TEMPERATURE, TOP_K = 1.3, 3
PROMPTS = np.random.default_rng(0).integers(2, 16, size=(B, P)).astype(np.int32)
for _i in range(B):
    PROMPTS[_i, :_i % 3] = PAD


@pytest.fixture(scope="module")
def policy():
    return nnx.split(tiny_policy(0))


@pytest.fixture(scope="module")
def stop_token(policy):
    """The token the tiny model samples most often: turns then end at it often enough to have several."""
    graphdef, params = policy
    out = np.asarray(generate_jit(graphdef, params, jnp.asarray(PROMPTS), jax.random.key(9), response_length=12,
                                  pad_token_id=PAD, temperature=TEMPERATURE, top_k=TOP_K))
    return int(np.bincount(out.ravel(), minlength=16)[2:].argmax() + 2)


def observation_of(episode, turn):
    """The scripted environment's observation: 1 + (episode + turn) % 4 tokens, ids from 2 to 15."""
    n = 1 + (episode + turn) % 4
    return [2 + (3 * episode + 5 * turn + j) % 14 for j in range(n)]


def goes_on(episode, turn):
    """Episodes 0, 4, 8 stop after their first turn; the others go on."""
    return episode % 4 != 0


def scripted_host(turn, episode, tokens, ended, running, stream_length):
    """The environment above as a traced function (what a host callback returns, without the host)."""
    width = SHAPE.observation_length
    table = np.full((B, SHAPE.max_turns, width), PAD, np.int32)
    lengths = np.zeros((B, SHAPE.max_turns), np.int32)
    for e in range(B):
        for t in range(SHAPE.max_turns):
            obs = observation_of(e, t)
            table[e, t, width - len(obs):] = obs
            lengths[e, t] = len(obs)
    go = jnp.asarray([goes_on(e, 0) for e in range(B)])[episode]
    fits = stream_length + jnp.asarray(lengths)[episode, turn] < SHAPE.episode_length
    return HostAnswer(jnp.asarray(table)[episode, turn], jnp.asarray(lengths)[episode, turn], go & fits,
                      jnp.where(running, 1.0 + turn, jnp.nan))


def run(policy, stop, prompts=PROMPTS, key=3, host=scripted_host, jitted=None):
    graphdef, params = policy
    fn = jitted or make_jitted(graphdef, stop, host)
    return fn(params, jnp.asarray(prompts), jax.random.key(key))


def make_jitted(graphdef, stop, host=scripted_host, **options):
    return jax.jit(lambda params, prompts, key: generate_episodes(
        graphdef, params, prompts, key, shape=SHAPE, host_turn=host, pad_token_id=PAD, stop_token_id=stop,
        temperature=TEMPERATURE, top_k=TOP_K, **options))


@pytest.fixture(scope="module")
def episodes(policy, stop_token):
    return jax.tree.map(np.asarray, run(policy, stop_token))


@pytest.fixture
def model_calls(monkeypatch):
    """The input shapes of every model call traced while the test runs (filled as they happen)."""
    seen = []
    original = CausalLM.__call__

    def recording(self, input_ids, *args, **kwargs):
        seen.append(tuple(input_ids.shape))
        return original(self, input_ids, *args, **kwargs)

    monkeypatch.setattr(CausalLM, "__call__", recording)
    return seen


def replay(stream, environment, stop):
    """A row's stream cut into its segments by a plain reading: [(kind, tokens)] with kind 'model' / 'env'."""
    segments = []
    for token, env in zip(stream, environment):
        if token == PAD and not env:
            break
        kind = "env" if env else "model"
        if segments and segments[-1][0] == kind:
            segments[-1][1].append(int(token))
        else:
            segments.append((kind, [int(token)]))
    return segments


def test_the_stream_is_the_turns_and_observations_in_order(episodes, stop_token):
    multi = 0
    for e in range(B):
        segments = replay(episodes.stream[e], episodes.environment_mask[e], stop_token)
        kinds = [kind for kind, _ in segments]
        assert kinds[::2] == ["model"] * len(kinds[::2]) and kinds[1::2] == ["env"] * len(kinds[1::2])
        model_turns = [tokens for kind, tokens in segments if kind == "model"]
        assert len(model_turns) == episodes.turns[e] <= SHAPE.max_turns
        for t, tokens in enumerate(model_turns[:-1]):  # a turn the environment answered ended with the stop token
            assert tokens[-1] == stop_token and stop_token not in tokens[:-1]
            assert len(tokens) <= SHAPE.turn_length
            assert goes_on(e, t)
            assert [toks for kind, toks in segments if kind == "env"][t] == observation_of(e, t)
        last = model_turns[-1]
        assert stop_token not in last[:-1]
        ended_with_stop = last[-1] == stop_token
        # completed: the last turn ended with the stop token and the environment ended the episode
        assert episodes.completed[e] == (ended_with_stop and (not goes_on(e, len(model_turns) - 1)))
        if not ended_with_stop:  # truncated: the turn's or the stream's budget ran out
            assert len(last) == SHAPE.turn_length or sum(len(s) for _, s in segments) == SHAPE.episode_length
        # the turn rewards 1, 2, ... summed over the turns taken
        assert episodes.environment_reward[e] == sum(1.0 + t for t in range(len(model_turns)))
        multi += len(model_turns) > 1
    assert multi >= 3, "the fixture should give several multi-turn episodes"


def test_sampler_logprobs_equal_a_forward_over_the_whole_conversation(policy, episodes):
    graphdef, params = policy
    model = nnx.merge(graphdef, params)
    query_responses = jnp.concatenate([jnp.asarray(PROMPTS), jnp.asarray(episodes.stream)], axis=1)
    forward = np.asarray(response_logprobs(model, query_responses, P, PAD, TEMPERATURE)[0])
    policy_tokens = (episodes.stream != PAD) & ~episodes.environment_mask
    assert policy_tokens.sum() > 40
    np.testing.assert_allclose(episodes.logprobs[policy_tokens], forward[policy_tokens], atol=2e-5, rtol=0)
    assert np.all(episodes.logprobs[~policy_tokens] == INVALID_LOGPROB)


def test_the_environment_mask_is_the_observations(episodes, stop_token):
    for e in range(B):
        segments = replay(episodes.stream[e], episodes.environment_mask[e], stop_token)
        expected = np.concatenate([np.full(len(tokens), kind == "env") for kind, tokens in segments])
        n = len(expected)
        np.testing.assert_array_equal(episodes.environment_mask[e, :n], expected)
        assert not episodes.environment_mask[e, n:].any()
        assert np.all(episodes.stream[e, n:] == PAD)


def test_a_turns_prefill_is_its_new_tokens(policy, stop_token, model_calls):
    seen = model_calls
    jax.make_jaxpr(lambda params: generate_episodes(
        policy[0], params, jnp.asarray(PROMPTS), jax.random.key(0), shape=SHAPE, host_turn=scripted_host,
        pad_token_id=PAD, stop_token_id=stop_token))(policy[1])
    # the prompt once, one token per row and step, a row's stop token and observation: never the conversation
    assert observation_call_sizes(SHAPE.observation_length) == (2, 3, 5, 6)
    assert sorted(set(seen)) == sorted({(B, P), (B, 1)} | OBSERVATION_CALLS)
    assert seen.count((B, P)) == 1


def test_each_observation_runs_in_the_smallest_call_that_holds_it(policy, stop_token, episodes, monkeypatch):
    """The model calls that RUN (recorded by a callback inside each): one per observation taken in, of the
    smallest size that holds its stop token and its n tokens, whatever the longest observation allowed; the
    episodes those of a single call size of 1 + O tokens (a slot for every padding token)."""
    ran = []
    original = CausalLM.__call__

    def recording(self, input_ids, *args, **kwargs):
        jax.debug.callback(lambda: ran.append(tuple(input_ids.shape)))
        return original(self, input_ids, *args, **kwargs)

    monkeypatch.setattr(CausalLM, "__call__", recording)
    played = play(policy, stop_token)
    sizes = observation_call_sizes(SHAPE.observation_length)
    expected = sorted((1, min(s for s in sizes if s >= 1 + len(tokens)))
                      for e in range(B) for kind, tokens in replay(played.stream[e], played.environment_mask[e],
                                                                   stop_token) if kind == "env")
    assert len(expected) >= 6 and len({size for _, size in expected}) == 3
    assert sorted(shape for shape in ran if shape[0] == 1) == expected
    assert_same_episodes(played, episodes)
    assert_same_episodes(play(policy, stop_token, observation_buckets=1), episodes)


def test_one_program_for_every_turn_and_batch(policy, stop_token):
    jitted = make_jitted(policy[0], stop_token)
    first = run(policy, stop_token, jitted=jitted)
    other = np.random.default_rng(1).integers(2, 16, size=(B, P)).astype(np.int32)
    second = run(policy, stop_token, prompts=other, key=4, jitted=jitted)
    assert int(jnp.max(first.turns)) > 1 and int(jnp.max(second.turns)) > 1
    assert jitted._cache_size() == 1


def test_fewer_rows_than_episodes_play_the_same_episodes(policy, stop_token, episodes, model_calls):
    """``slots`` rows refilled as episodes end: every episode's stream, mask, log-probs, reward and turns are those
    of the batch played with one row per episode (the same keys per episode); the prompts are prefilled once,
    together, and a refill copies its prompt's keys and values (no model call of its own)."""
    graphdef, params = policy
    seen = model_calls
    refilled = jax.jit(lambda params, prompts, key: generate_episodes(
        graphdef, params, prompts, key, shape=SHAPE, host_turn=scripted_host, pad_token_id=PAD,
        stop_token_id=stop_token, temperature=TEMPERATURE, top_k=TOP_K, slots=5))
    out = jax.tree.map(np.asarray, refilled(params, jnp.asarray(PROMPTS), jax.random.key(3)))
    assert sorted(set(seen)) == sorted({(B, P), (5, 1)} | OBSERVATION_CALLS)
    assert seen.count((B, P)) == 1
    assert_same_episodes(out, episodes)


@pytest.mark.parametrize("count, blocks, prefix", [(7, 2, 0), (12, 3, 0), (12, 3, 2)])
def test_a_filled_up_batch_prefills_the_prompt_blocks_it_plays(policy, stop_token, episodes, monkeypatch, count,
                                                              blocks, prefix):
    """``episodes`` = n (traced) on 5 rows: the bank's prompts go through the model 5 rows at a time, only the
    blocks that hold one of the first n run (the last overlapping the one before where 5 does not divide 12):
    n = 7 runs 2 blocks, n = 12 all 3; the n episodes are the whole batch's, also after a shared prefix
    prefilled once (prompts that start with the same 2 tokens)."""
    graphdef, params = policy
    prompts = PROMPTS.copy()
    if prefix:
        for i in range(B):
            prompts[i, i % 3:i % 3 + 2] = (7, 9)
        episodes = jax.tree.map(np.asarray, run(policy, stop_token, prompts))
    traced, ran = [], []
    original = CausalLM.__call__

    def counting(self, input_ids, *args, **kwargs):
        traced.append(tuple(input_ids.shape))
        if input_ids.shape == (5, P - prefix):
            jax.debug.callback(lambda: ran.append(1))
        return original(self, input_ids, *args, **kwargs)

    monkeypatch.setattr(CausalLM, "__call__", counting)
    out = jax.tree.map(np.asarray, jax.jit(lambda params, prompts, key, n: generate_episodes(
        graphdef, params, prompts, key, shape=SHAPE, host_turn=scripted_host, pad_token_id=PAD,
        stop_token_id=stop_token, temperature=TEMPERATURE, top_k=TOP_K, slots=5, tail_rows=3, episodes=n,
        prefix_length=prefix))(params, jnp.asarray(prompts), jax.random.key(3), jnp.int32(count)))
    jax.effects_barrier()
    assert (B, P - prefix) not in traced and len(ran) == blocks
    assert_same_episodes(jax.tree.map(lambda x: x[:count] if np.ndim(x) else x, out),
                         jax.tree.map(lambda x: x[:count] if np.ndim(x) else x, episodes))
    assert (out.stream[count:] == PAD).all()


def assert_same_episodes(out, expected):
    np.testing.assert_array_equal(out.stream, expected.stream)
    np.testing.assert_array_equal(out.environment_mask, expected.environment_mask)
    np.testing.assert_array_equal(out.turns, expected.turns)
    np.testing.assert_array_equal(out.completed, expected.completed)
    np.testing.assert_array_equal(out.environment_reward, expected.environment_reward)
    np.testing.assert_allclose(out.logprobs, expected.logprobs, atol=2e-5, rtol=0)


def test_a_groups_prompt_is_prefilled_once(policy, stop_token, model_calls):
    """G = 3 episodes per prompt (GRPO's groups) on 5 refilled rows: the 4 prompts are prefilled once, in one call,
    and the 12 episodes equal those of the prompts written out 3 times each, one row per episode."""
    graphdef, params = policy
    group, prompts = 3, PROMPTS[:B // 3]
    expected = jax.tree.map(np.asarray, run(policy, stop_token, prompts=np.repeat(prompts, group, axis=0)))
    model_calls.clear()
    out = jax.tree.map(np.asarray, jax.jit(lambda params, prompts, key: generate_episodes(
        graphdef, params, prompts, key, shape=SHAPE, host_turn=scripted_host, pad_token_id=PAD,
        stop_token_id=stop_token, temperature=TEMPERATURE, top_k=TOP_K, slots=5, group_size=group))(
        params, jnp.asarray(prompts), jax.random.key(3)))
    assert sorted(set(model_calls)) == sorted({(B // group, P), (5, 1)} | OBSERVATION_CALLS)
    assert model_calls.count((B // group, P)) == 1
    assert int(np.max(out.turns)) > 1
    assert_same_episodes(out, expected)


def list_schedule(durations, rows):
    """Episodes of ``durations`` model tokens each (one token per row per step) on a loop of ``rows`` rows, each
    waiting episode taking, in order, the first row to come free (plain list scheduling) -> (the steps, the rows
    busy at each step, the step the last episode starts at)."""
    import heapq
    free, spans = [0] * rows, []
    for duration in durations:
        start = heapq.heappop(free)
        heapq.heappush(free, start + duration)
        spans.append((start, start + duration))
    end = max(stop for _, stop in spans)
    busy = [sum(start <= t < stop for start, stop in spans) for t in range(end)]
    return end, busy, max(start for start, _ in spans)


def computed_row_steps(durations, rows, tail_rows=0):
    """The row-steps the loop computes: every row at every step, until no episode waits and at most ``tail_rows``
    rows play; from then on ``tail_rows`` rows."""
    end, busy, last_start = list_schedule(durations, rows)
    if not tail_rows:
        return rows * end
    switch = next(t for t in range(end + 1) if t == end or (t >= last_start and busy[t] <= tail_rows))
    return rows * switch + tail_rows * (end - switch)


def play(policy, stop_token, prompts=PROMPTS, **options):
    graphdef, params = policy
    return jax.tree.map(np.asarray, jax.jit(lambda params, prompts, key: generate_episodes(
        graphdef, params, prompts, key, shape=SHAPE, host_turn=scripted_host, pad_token_id=PAD,
        stop_token_id=stop_token, temperature=TEMPERATURE, top_k=TOP_K, **options))(
        params, jnp.asarray(prompts), jax.random.key(3)))


@pytest.mark.parametrize("slots,tail_rows,segments", [(0, 0, 1), (5, 0, 1), (5, 2, 3), (0, 3, 1)])
def test_the_decode_work_counts_each_model_token_once_and_every_row_step(policy, stop_token, episodes, slots,
                                                                       tail_rows, segments):
    """busy: the model's tokens of the batch (one per row-step that drew one); computed: each step's rows, the
    steps those of list scheduling the episodes' model tokens onto the rows (every episode's own row with slots 0),
    the batch's tail on ``tail_rows`` rows."""
    played = episodes if not (slots or tail_rows) else play(policy, stop_token, slots=slots, tail_rows=tail_rows,
                                                            segments=segments, slot_alignment=4)
    model_tokens = np.sum(played.logprobs != INVALID_LOGPROB, axis=1)
    assert float(played.busy_row_steps) == model_tokens.sum()
    rows = slots or len(PROMPTS)
    assert float(played.computed_row_steps) == computed_row_steps(model_tokens, rows, tail_rows)
    assert slots == 0 or float(played.computed_row_steps) < len(PROMPTS) * model_tokens.max()  # refills pay
    if tail_rows:
        assert float(played.computed_row_steps) < computed_row_steps(model_tokens, rows)  # the tail saves


def test_the_loops_read_only_the_slots_filled_and_play_the_same_episodes(policy, stop_token, episodes,
                                                                        monkeypatch):
    """The loop over every row cut into loops reading 16, 28 and all 35 slots of the cache (P + the turns and
    observations): the same episodes; each model call reads no more slots than its loop's bound, and the first
    loops' calls fewer than the cache holds."""
    from ppojax.rl.episodes import read_bounds

    cache_length = SHAPE.cache_length(P)
    assert read_bounds(P, cache_length, 3, alignment=4) == [16, 28, cache_length] == [16, 28, 35]
    assert read_bounds(P, cache_length, 1, alignment=4) == [cache_length]
    reads = []
    original = CausalLM.__call__

    def recording(self, input_ids, *args, cache=None, **kwargs):
        reads.append((tuple(input_ids.shape), cache.slots_read))
        return original(self, input_ids, *args, cache=cache, **kwargs)

    monkeypatch.setattr(CausalLM, "__call__", recording)
    out = play(policy, stop_token, segments=3, slot_alignment=4)
    assert {read for shape, read in reads if shape[1] == 1} == {16, 28, cache_length}  # one decode body per loop
    assert {read for shape, read in reads if shape in OBSERVATION_CALLS} == {16, 28, cache_length}
    assert_same_episodes(out, episodes)


@pytest.mark.parametrize("slots,tail_rows", [(5, 2), (0, 3)])
def test_the_tail_on_fewer_rows_plays_the_same_episodes(policy, stop_token, episodes, model_calls, slots,
                                                       tail_rows):
    """Once no episode waits, the last playing rows gathered into ``tail_rows`` rows: every episode as the batch
    with one row per episode played it; the tail's steps are one token on each of its rows."""
    out = play(policy, stop_token, slots=slots, tail_rows=tail_rows)
    assert (tail_rows, 1) in model_calls and (slots or B, 1) in model_calls
    assert_same_episodes(out, episodes)


def test_a_shared_prefix_prefilled_once_plays_the_same_episodes(policy, stop_token):
    """Every prompt starting with the same 2 tokens (``shared_prompt_prefix``): those prefilled once for the bank,
    on 5 rows for the 12 episodes (refills from the bank), give the episodes of the plain prefill."""
    prompts = PROMPTS.copy()
    for i in range(B):
        prompts[i, i % 3:i % 3 + 2] = (7, 9)
    plain = jax.tree.map(np.asarray, run(policy, stop_token, prompts, jitted=make_jitted(policy[0], stop_token,
                                                                                            slots=5)))
    once = jax.tree.map(np.asarray, run(policy, stop_token, prompts, jitted=make_jitted(
        policy[0], stop_token, slots=5, prefix_length=2)))
    assert plain.environment_mask.sum() > 0 and (plain.turns > 1).any()
    np.testing.assert_array_equal(once.stream, plain.stream)
    np.testing.assert_array_equal(once.environment_mask, plain.environment_mask)
    np.testing.assert_array_equal(once.turns, plain.turns)
    np.testing.assert_allclose(once.logprobs, plain.logprobs, atol=2e-5)


@pytest.mark.parametrize("slots", [0, 5])
def test_only_the_first_episodes_are_played(policy, stop_token, episodes, slots):
    """``episodes`` = 5 (traced) of the 12: those 5 are the whole batch's first five, the rest empty and never
    handed to the environment; on the batch's tail rows (3) the loop computes the five episodes' steps only."""
    graphdef, params = policy
    answered = []

    def host(turn, episode, tokens, ended, running, stream_length):
        jax.debug.callback(lambda e, r: answered.extend(np.asarray(e)[np.asarray(r)].tolist()), episode, running)
        return scripted_host(turn, episode, tokens, ended, running, stream_length)

    out = jax.tree.map(np.asarray, jax.jit(lambda params, prompts, key, n: generate_episodes(
        graphdef, params, prompts, key, shape=SHAPE, host_turn=host, pad_token_id=PAD, stop_token_id=stop_token,
        temperature=TEMPERATURE, top_k=TOP_K, slots=slots, tail_rows=3, episodes=n))(
        params, jnp.asarray(PROMPTS), jax.random.key(3), jnp.int32(5)))
    first = jax.tree.map(lambda x: x[:5] if np.ndim(x) else x, episodes)
    assert_same_episodes(jax.tree.map(lambda x: x[:5] if np.ndim(x) else x, out), first)
    assert (out.stream[5:] == PAD).all() and not out.environment_mask[5:].any() and (out.turns[5:] == 0).all()
    assert answered and set(answered) <= set(range(5))
    model_tokens = np.sum(first.logprobs != INVALID_LOGPROB, axis=1)
    assert float(out.busy_row_steps) == model_tokens.sum()
    assert float(out.computed_row_steps) == computed_row_steps(model_tokens, slots or len(PROMPTS), 3)
