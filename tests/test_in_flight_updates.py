"""In-flight weight updates (``ppojax.rl.in_flight_updates``, PipelineRL): a batch's decode spread over k + 1 updates,
the policy swapped between its chunks, the KV cache kept.

- the sampler's chunks with a policy swapped between them equal a plain token-by-token loop over the model with
  its own KV cache, each step run by its chunk's parameters (and differ from either policy alone, and from
  recomputing the earlier tokens' keys with the new policy);
- the program over 4 updates (k = 1 and 2) equals a plain loop written here: a Python list of decodes in progress,
  each advanced by the state of its time, the completed one scored and learned; each token's version is the
  update whose policy sampled it;
- a trainer run stopped and resumed equals the run never stopped (the part-decoded batches ride in checkpoints).
"""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ppojax.models import CausalLM, init_cache
from ppojax.rl import pipeline, rollout
from ppojax.rl.forward import sequence_inputs
from ppojax.rl.program import iteration_keys, make_fill, make_train_step, make_update
from ppojax.rl.sampler import (Draw, chunk_ends, continue_decoding, generate, row_keys, sample_rows, start_decoding,
                               token_logprobs)
from ppojax.rl.settings import AsyncSettings
from ppojax.trainer.loop import step_key
from tests.test_pipeline import NUM_UPDATES, TIGHT, fill_keys, program_with
from tests.test_train_step import init_state, prompt_blocks
from tests.tiny_setup import tiny_config as tiny_model_config

PAD, STOP = 0, 1


# ------------------------------------------------------------------------------------------------------------
# The sampler: chunks decoded by different parameters on one KV cache
# ------------------------------------------------------------------------------------------------------------
def two_policies():
    graphdef, first = nnx.split(CausalLM(tiny_model_config(), rngs=nnx.Rngs(params=jax.random.key(3))))
    second = jax.tree.map(lambda x: x + 0.3 * jax.random.normal(jax.random.key(4), x.shape, x.dtype)
                          if jnp.issubdtype(x.dtype, jnp.floating) else x, first)
    return graphdef, first, second


def plain_loop_decode(graphdef, policies, ends, prompts, key, response_length, temperature):
    """The reference: the model run step by step on its own KV cache (no while loop, no chunk bookkeeping); token t
    sampled by ``policies[j]`` where chunk j holds step t; no stop token. -> (tokens i32[B, R], log-probs f32[B, R])."""
    def policy_at(t):
        return next(p for p, end in zip(policies, ends) if t < end)

    batch, prompt_length = prompts.shape
    rows = jnp.arange(batch)

    @jax.jit  # the prompt's forward, one program (not operation by operation)
    def prefill(policy):
        model = nnx.merge(graphdef, policy)
        cache = init_cache(model.cfg, batch, prompt_length + response_length, jnp.float32, model.kernels)
        ids, mask, positions = sequence_inputs(prompts, PAD)
        hidden, cache = model(ids, mask, positions, cache=cache)
        return model.logits(hidden[:, -1:])[:, 0], cache, jnp.sum(mask, axis=-1)

    @jax.jit  # one token's forward; the loop around it stays plain
    def next_logits(policy, token, position, cache):
        model = nnx.merge(graphdef, policy)
        live = token != PAD  # a sampled pad id is a masked key, as the forward sees it
        hidden, cache = model(jnp.where(live, token, 0)[:, None], live[:, None], position[:, None], cache=cache)
        return model.logits(hidden)[:, 0], cache, position + live

    logits, cache, position = prefill(policies[0])
    tokens, logprobs = [], []
    for t in range(response_length):
        if t > 0:
            logits, cache, position = next_logits(policy_at(t), tokens[-1], position, cache)
        token = sample_rows(logits, row_keys(key, t, rows), temperature=temperature)
        tokens.append(token)
        logprobs.append(token_logprobs(logits, token, temperature))
    return np.stack(tokens, 1), np.stack(logprobs, 1)


def test_chunks_swapped_between_policies_equal_a_plain_loop_on_one_kv_cache():
    graphdef, first, second = two_policies()
    prompts = jnp.array([[0, 0, 5, 6, 7], [8, 9, 10, 11, 12], [0, 13, 14, 3, 2]], jnp.int32)
    key, response_length, temperature = jax.random.key(11), 9, 1.3
    ends = chunk_ends(response_length, 3)
    assert ends == [4, 7, 9]  # 8 decode steps in 3 chunks of 3, 3, 2; chunk 0 also owns the prefill's token 0
    policies = [first, second, first]
    draw = Draw(temperature=temperature, pad_token_id=PAD, return_logprobs=True)

    decoding = jax.jit(lambda p: start_decoding(graphdef, p, prompts, key, draw, response_length=response_length))(
        policies[0])
    advance = jax.jit(lambda p, d, end: continue_decoding(graphdef, p, d, key, draw, end=end), static_argnums=2)
    for policy, end in zip(policies, ends):
        decoding = advance(policy, decoding, end)
    want_tokens, want_logprobs = plain_loop_decode(graphdef, policies, ends, prompts, key, response_length,
                                                   temperature)
    np.testing.assert_array_equal(decoding.responses, want_tokens)
    np.testing.assert_allclose(decoding.logprobs, want_logprobs, rtol=1e-5, atol=1e-5)

    # the swap matters: neither policy alone samples these tokens' log-probs ...
    for alone in (first, second):
        _, logprobs = generate(graphdef, alone, prompts, key, response_length=response_length, pad_token_id=PAD,
                               temperature=temperature, return_logprobs=True)
        assert np.max(np.abs(np.asarray(logprobs) - want_logprobs)) > 1e-3
    # ... and the cache is kept: the first chunk's keys recomputed by the second policy give other log-probs
    recomputed = plain_loop_decode(graphdef, [second, second, first], ends, prompts, key, response_length,
                                   temperature)[1]
    assert np.max(np.abs(recomputed[:, ends[0]:ends[1]] - want_logprobs[:, ends[0]:ends[1]])) > 1e-3


# ------------------------------------------------------------------------------------------------------------
# The program: k batches part-decoded in the state
# ------------------------------------------------------------------------------------------------------------
def in_flight_program(k, **config):
    program = program_with(k, **config)
    return dataclasses.replace(program, settings=dataclasses.replace(
        program.settings, asynchronous=AsyncSettings(k, in_flight_weight_updates=True)))


def plain_in_flight_loop(program, state, prompts, keys, k):
    """The reference: decodes in progress kept as a Python list (oldest first); each update's state starts one on its
    prompts and runs the next chunk of every other with its own weights; the completed one is scored and learned
    with the synchronous program's forwards and update. -> (state, metrics per update, versions learned)."""
    sampling = program.settings.sampling
    draw = Draw(temperature=sampling.temperature, pad_token_id=sampling.pad_token_id,
                stop_token_id=sampling.stop_token_id, return_logprobs=True)
    ends = chunk_ends(sampling.response_length, k + 1)
    graphdef = program.actor_critic.policy_graphdef
    group = sampling.num_generations

    @jax.jit
    def start(state, prompt_ids, key):
        return start_decoding(graphdef, state.params["policy"], prompt_ids, key, draw,
                              response_length=sampling.response_length, group_size=group)

    @functools.partial(jax.jit, static_argnums=4)
    def chunk(state, decoding, key, versions, chunk_index):
        begin, end = (0 if chunk_index == 0 else ends[chunk_index - 1]), ends[chunk_index]
        decoding = continue_decoding(graphdef, state.params["policy"], decoding, key, draw, end=end)
        return decoding, versions.at[:, begin:end].set(state.update_count)

    score = jax.jit(lambda state, qr, logprobs, versions: pipeline.scored_batch(
        program, state, qr, logprobs, jnp.zeros(qr.shape[0], jnp.int32), versions)[0])
    forwards = jax.jit(lambda s, qr, behaviour: rollout.experience_forwards(program, s, qr, 6, behaviour))
    update = make_update(program)

    def begin(state, prompt_ids, key):
        decoding = start(state, prompt_ids, key)
        versions = jnp.zeros(decoding.responses.shape, jnp.int32)
        return [prompt_ids, key, *chunk(state, decoding, key, versions, 0)]

    queue = []
    for i, key in enumerate(fill_keys(k)):
        entry = begin(state, prompts[i], iteration_keys(key)[0])
        for c in range(1, k - i):
            entry[2:] = chunk(state, entry[2], entry[1], entry[3], c)
        queue.append(entry)
    history, learned_versions = [], []
    for i, key in enumerate(keys):
        sample_key, update_key = iteration_keys(key)
        for j, entry in enumerate(queue):
            entry[2:] = chunk(state, entry[2], entry[1], entry[3], k - j)
        queue.append(begin(state, prompts[k + i], sample_key))
        prompt_ids, _, decoding, versions = queue.pop(0)
        query_responses = jnp.concatenate([jnp.repeat(prompt_ids, group, axis=0), decoding.responses], axis=1)
        batch = score(state, query_responses, decoding.logprobs, versions)
        experience = forwards(state, query_responses, decoding.logprobs).replace(
            scores=batch.scores, reward_components=batch.reward_components, policy_versions=versions)
        state, metrics = update(state, experience, update_key)
        history.append(jax.device_get(metrics))
        learned_versions.append(np.asarray(versions))
    return state, history, learned_versions


@pytest.mark.parametrize("k", [1, 2])
def test_in_flight_updates_equal_a_plain_loop_over_chunks(k):
    program = in_flight_program(k, use_decoupled_loss=True)
    blocks = prompt_blocks(NUM_UPDATES)
    prompts = jnp.concatenate([blocks[NUM_UPDATES - k:], blocks])
    keys = [step_key(0, i) for i in range(NUM_UPDATES)]

    state, failures = make_fill(program)(init_state(program, 0), prompts[:k], jnp.stack(fill_keys(k)))
    assert int(failures) == 0 and state.in_flight.state.responses.shape == (k, 16, 6)
    step, history = make_train_step(program), []
    for i, key in enumerate(keys):
        state, metrics = step(state, prompts[k + i], key)
        history.append(jax.device_get(metrics))
    ref_state, reference, versions = plain_in_flight_loop(program, init_state(program, 0), prompts, keys, k)

    for update, (got, want) in enumerate(zip(history, reference)):
        for name, value in want.items():
            np.testing.assert_allclose(got[name], value, **TIGHT, err_msg=f"update {update + 1}: {name}")
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, **TIGHT), state.params, ref_state.params)
    # update u (0-based) learns a batch whose chunk j was sampled by version max(u - k + j, 0): the last chunk
    # on-policy, the first k behind (the fill's chunks are version 0)
    ends = chunk_ends(6, k + 1)
    for u, learned in enumerate(versions):
        for j, end in enumerate(ends):
            begin = 0 if j == 0 else ends[j - 1]
            np.testing.assert_array_equal(learned[:, begin:end], max(u - k + j, 0))
        assert history[u]["offpolicy/staleness_max"] == min(u, k)
    assert history[-1]["sampling/sampling_logp_difference/mean"] > 1e-4  # older chunks: pi_prox != pi_behav


# ------------------------------------------------------------------------------------------------------------
# The trainer: the part-decoded batches in checkpoints
# ------------------------------------------------------------------------------------------------------------
def test_an_in_flight_run_resumed_equals_the_run_never_stopped(tmp_path):
    from tests.test_pipeline import async_trainer
    straight = async_trainer(tmp_path / "a", in_flight_weight_updates=True)
    expected = straight.train(progress=False)
    assert [m["offpolicy/staleness_max"] for m in expected] == [0, 1, 2, 2]
    first = async_trainer(tmp_path / "b", save_steps=2, in_flight_weight_updates=True)
    first.train(num_updates=2, progress=False)
    resumed = async_trainer(tmp_path / "b", resume="auto", in_flight_weight_updates=True)
    got = resumed.train(progress=False)
    assert int(resumed.state.update_count) == 4 and len(got) == 2
    for a, b in zip(expected[2:], got):
        for name in ("objective/scores", "objective/kl", "loss/policy_avg", "sampling/sampling_logp_difference/mean",
                     "offpolicy/staleness_mean"):
            assert a[name] == b[name], name
    jax.tree.map(np.testing.assert_array_equal, straight.state.params, resumed.state.params)
    jax.tree.map(np.testing.assert_array_equal, straight.state.in_flight, resumed.state.in_flight)


# ------------------------------------------------------------------------------------------------------------
# The continuous sampler: slots decoding on with a policy swapped in, chunks cut by sequences done
# ------------------------------------------------------------------------------------------------------------
def test_slots_swapped_mid_batch_sample_each_token_with_its_versions_policy():
    """7 rows through 3 slots: the first policy until 3 sequences are done, then the second until all are. A row
    whose tokens are all version 0 is the first policy's own sample, all version 1 the second's (rows draw with
    their own keys); a row decoding across the swap starts as the first policy's sample; both kinds occur."""
    from ppojax.rl.continuous import SlotLoop

    graphdef, first, second = two_policies()
    prompts = jnp.array(np.random.default_rng(1).integers(2, 16, size=(7, 5)), jnp.int32)
    key, length = jax.random.key(5), 10
    plain = [generate(graphdef, p, prompts, key, response_length=length, pad_token_id=PAD, temperature=1.0)
             for p in (first, second)]
    stop = int(plain[0][0, 1])  # a token the first policy draws early: sequences end at different lengths
    plain = [np.asarray(generate(graphdef, p, prompts, key, response_length=length, pad_token_id=PAD,
                                 temperature=1.0, stop_token_id=stop)) for p in (first, second)]

    def loop(params, version):
        return SlotLoop(graphdef, params, prompts, key, response_length=length, pad_token_id=PAD, stop_token_id=stop,
                        version=version)

    state = jax.jit(lambda: loop(first, 0).run(loop(first, 0).fresh(3), 3))()
    state = jax.jit(lambda s: loop(second, 1).run(s, 7))(state)
    tokens, versions = np.asarray(state.responses), np.asarray(state.versions)
    lengths = np.where((tokens == stop).any(1), (tokens == stop).argmax(1) + 1, length)
    kinds = []
    for row in range(7):
        sampled = versions[row, :lengths[row]]
        if (sampled == 0).all():
            np.testing.assert_array_equal(tokens[row], plain[0][row]), kinds.append("first")
        elif (sampled == 1).all():
            np.testing.assert_array_equal(tokens[row], plain[1][row]), kinds.append("second")
        else:  # version 0 then 1, never back
            swap = int(np.argmax(sampled == 1))
            assert (sampled[:swap] == 0).all() and (sampled[swap:] == 1).all()
            np.testing.assert_array_equal(tokens[row, :swap], plain[0][row, :swap]), kinds.append("across")
    assert kinds.count("first") >= 3 and "second" in kinds and "across" in kinds, kinds


@pytest.mark.parametrize("k", [1])
def test_in_flight_updates_on_slots_equal_a_plain_loop(k):
    """rollout_slots 4 (16 rows): each update's policy runs every batch in flight until its chunk's share of the
    sequences is done; equal to a plain loop of the continuous sampler's pieces kept in a Python list."""
    from ppojax.rl.continuous import SlotLoop

    program = in_flight_program(k, use_decoupled_loss=True, rollout_slots=4)
    blocks = prompt_blocks(NUM_UPDATES)
    prompts = jnp.concatenate([blocks[NUM_UPDATES - k:], blocks])
    keys = [step_key(0, i) for i in range(NUM_UPDATES)]
    state, _ = make_fill(program)(init_state(program, 0), prompts[:k], jnp.stack(fill_keys(k)))
    step, history = make_train_step(program), []
    for i, key in enumerate(keys):
        state, metrics = step(state, prompts[k + i], key)
        history.append(jax.device_get(metrics))

    sampling = program.settings.sampling
    graphdef = program.actor_critic.policy_graphdef

    def slot_loop(state, prompt_ids, key):
        return SlotLoop(graphdef, state.params["policy"], prompt_ids, key, response_length=sampling.response_length,
                        pad_token_id=sampling.pad_token_id, stop_token_id=sampling.stop_token_id,
                        temperature=sampling.temperature, return_logprobs=True, version=state.update_count)

    @functools.partial(jax.jit, static_argnums=3)
    def chunk(state, slots, prompt_ids_and_key, target):
        return slot_loop(state, *prompt_ids_and_key).run(slots, target)

    @jax.jit
    def begin(state, prompt_ids, key):
        loop = slot_loop(state, prompt_ids, key)
        return loop.run(loop.fresh(4), 8)  # half of the 16 sequences done: chunk 0 of 2

    score = jax.jit(lambda state, qr, logprobs, versions: pipeline.scored_batch(
        program, state, qr, logprobs, jnp.zeros(qr.shape[0], jnp.int32), versions)[0])
    forwards = jax.jit(lambda s, qr, behaviour: rollout.experience_forwards(program, s, qr, 6, behaviour))
    update = make_update(program)
    ref = init_state(program, 0)
    first_key = iteration_keys(fill_keys(1)[0])[0]
    queue = [((prompts[0], first_key), begin(ref, prompts[0], first_key))]
    reference = []
    for i, key in enumerate(keys):
        sample_key, update_key = iteration_keys(key)
        (prompt_ids, decode_key), slots = queue.pop(0)
        slots = chunk(ref, slots, (prompt_ids, decode_key), 16)
        queue.append(((prompts[k + i], sample_key), begin(ref, prompts[k + i], sample_key)))
        query_responses = jnp.concatenate([prompt_ids, slots.responses], axis=1)
        batch = score(ref, query_responses, slots.logprobs, slots.versions)
        experience = forwards(ref, query_responses, slots.logprobs).replace(
            scores=batch.scores, reward_components=batch.reward_components, policy_versions=slots.versions)
        ref, metrics = update(ref, experience, update_key)
        reference.append(jax.device_get(metrics))
    for update_index, (got, want) in enumerate(zip(history, reference)):
        for name, value in want.items():
            np.testing.assert_allclose(got[name], value, **TIGHT, err_msg=f"update {update_index + 1}: {name}")
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, **TIGHT), state.params, ref.params)
    assert max(h["offpolicy/staleness_max"] for h in history) == 1
