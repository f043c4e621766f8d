"""``shared_prompt_prefix``: the first tokens every prompt starts with (a system message, a tool's schema) through
the model once for the whole batch, in the samplers' prefill and in the update's forward. The reference is the
plain forward and prefill, every row its whole prompt: hidden states, log-probs, gradients, sampled tokens,
episodes (tests/test_episodes.py) and an update must equal them to float rounding, and the model must see the
prefix on one row only."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from ppojax.models import CausalLM
from ppojax.rl import rollout, update
from ppojax.rl.forward import (SharedPromptLayout, logprobs_from_hidden, row_layout, sequence_inputs,
                               split_shared_prefix)
from ppojax.rl.sampler import generate
from ppojax.trainer.run_prompts import shared_prefix_length
from tests import test_packing as packing, test_shared_prompt as shared_prompt
from tests.tiny_setup import tiny_config

PAD, STOP = 0, 1
P, R, Q, G = 12, 8, 5, 2


def prompts_with_prefix(rows, seed, prefix_length=Q, length=P):
    """i32[rows, length]: left-padded prompts (each at least ``prefix_length`` + 1 real tokens) that all start with
    the same ``prefix_length`` tokens; after them each row's own tokens, one of them a pad id (a masked hole)."""
    rng = np.random.default_rng(seed)
    vocab = tiny_config().vocab_size
    prefix = rng.integers(2, vocab, size=prefix_length)
    out = np.full((rows, length), PAD)
    for i in range(rows):
        real = rng.integers(prefix_length + 2, length + 1)
        out[i, length - real:] = rng.integers(2, vocab, size=real)
        out[i, length - real:length - real + prefix_length] = prefix
        if real > prefix_length + 2:
            out[i, length - real + prefix_length + 1] = PAD
    return out


def test_shared_prefix_length_finds_the_common_start():
    rows = prompts_with_prefix(6, 0)
    assert shared_prefix_length(rows, PAD) == Q
    rows[3, -1] = PAD  # a hole moves nothing before it
    assert shared_prefix_length(rows, PAD) == Q
    short = np.array([[PAD, 5, 7, 8], [5, 7, 8, 9]])  # one prompt is a prefix of the other: it keeps a token
    assert shared_prefix_length(short, PAD) == 2
    assert shared_prefix_length(np.array([[PAD, 7, 8], [PAD, 6, 8]]), PAD) == 0
    holed = np.array([[7, PAD, 8, 9, 4], [7, PAD, 8, 9, 5]])  # a pad id is never part of the prefix
    assert shared_prefix_length(holed, PAD) == 1


def test_the_split_keeps_each_tokens_column_and_position():
    rows = jnp.asarray(prompts_with_prefix(4, 1))
    ids, mask, positions = sequence_inputs(rows, PAD)
    (p_ids, p_mask, p_pos), (r_ids, r_mask, r_pos) = split_shared_prefix(ids, mask, positions, Q)
    first = int(np.argmax(np.asarray(mask[0])))
    np.testing.assert_array_equal(p_ids[0], ids[0, first:first + Q])
    np.testing.assert_array_equal(p_pos[0], np.arange(Q))
    assert bool(p_mask.all())
    for b in range(rows.shape[0]):  # the rest: every real token after the prefix, in its column, at its position
        start = int(np.argmax(np.asarray(mask[b]))) + Q
        want = np.asarray(mask[b, start:])
        np.testing.assert_array_equal(np.asarray(r_mask[b])[start - Q:], want)
        assert not np.asarray(r_mask[b])[:start - Q].any()
        np.testing.assert_array_equal(np.asarray(r_ids[b])[start - Q:][want], np.asarray(ids[b, start:])[want])
        np.testing.assert_array_equal(np.asarray(r_pos[b])[start - Q:][want],
                                      np.asarray(positions[b, start:])[want])


def grouped_rows(seed, group):
    """i32[B, P+R]: prompts sharing the prefix, each repeated ``group`` times, then random responses."""
    prompts = np.repeat(prompts_with_prefix(8 // group, seed), group, axis=0)
    rng = np.random.default_rng(seed + 1)
    responses = rng.integers(2, tiny_config().vocab_size, size=(prompts.shape[0], R))
    responses[:, -2:] = PAD
    return jnp.asarray(np.concatenate([prompts, responses], axis=1), jnp.int32)


@pytest.mark.parametrize("cfg,group", [(tiny_config(), 1), (tiny_config(), G), (shared_prompt.gpt2_like(), G)],
                         ids=["llama", "llama-groups", "gpt2-groups"])
def test_the_shared_prefix_forward_equals_the_padded_forward(cfg, group):
    qr = grouped_rows(2, group)
    graphdef, params = nnx.split(CausalLM(cfg, rngs=nnx.Rngs(3)))
    weights = jnp.asarray(np.random.default_rng(4).normal(size=(qr.shape[0], R)), jnp.float32)

    def outputs(params, prefix):
        lm = nnx.merge(graphdef, params)
        layout = row_layout(qr, P, PAD, group, prefix)
        assert isinstance(layout, SharedPromptLayout) == (group > 1 or prefix > 0)
        hidden = layout.hidden(lm)
        return hidden, logprobs_from_hidden(lm, hidden, layout.tokens, 0.7)[0]

    def objective(params, prefix):
        return jnp.sum(outputs(params, prefix)[1] * weights)

    shared_prompt.assert_forwards_agree(outputs, objective, params, 0, Q)


def test_the_prefix_runs_once_for_the_batch():
    """The model sees one prefix row of Q tokens, B/G rows of the prompts' rest and B response rows."""
    qr = grouped_rows(5, G)
    lm = CausalLM(tiny_config(), rngs=nnx.Rngs(0))
    calls = []

    def recording(ids, *args, **kwargs):
        calls.append(ids.shape)
        return lm(ids, *args, **kwargs)

    row_layout(qr, P, PAD, G, Q).hidden(recording)
    assert calls == [(1, Q), (qr.shape[0] // G, P - Q), (qr.shape[0], R)]


@pytest.mark.parametrize("group", [1, G])
def test_generate_with_the_prefix_prefilled_once_equals_the_plain_prefill(group):
    prompts = jnp.asarray(prompts_with_prefix(4, 6), jnp.int32)
    graphdef, params = nnx.split(CausalLM(tiny_config(), rngs=nnx.Rngs(1)))

    def run(prefix, greedy):
        return jax.jit(lambda p, k: generate(graphdef, p, prompts, k, response_length=R, pad_token_id=PAD,
                                             temperature=0.7, greedy=greedy, stop_token_id=STOP,
                                             return_logprobs=True, group_size=group, prefix_length=prefix))(
            params, jax.random.key(0))

    for greedy in (True, False):
        (tokens_a, logprobs_a), (tokens_b, logprobs_b) = run(0, greedy), run(Q, greedy)
        np.testing.assert_array_equal(tokens_b, tokens_a)
        live = np.asarray(tokens_a) != PAD
        np.testing.assert_allclose(np.asarray(logprobs_b)[live], np.asarray(logprobs_a)[live], atol=2e-5)


def with_prefix(program, prefix):
    """``program`` whose update and rollout forwards run the prompts' first ``prefix`` tokens once."""
    batch = dataclasses.replace(program.settings.batch, prompt_prefix=prefix)
    return dataclasses.replace(program, settings=dataclasses.replace(program.settings, batch=batch))


def prefixed_rows(seed):
    """``tests.test_shared_prompt``'s grouped rows (test_packing's P, R, B) with every prompt's first real token 7."""
    qr, live, rng = shared_prompt.grouped_rows("long_tail", seed)
    qr = np.array(qr)
    qr[np.arange(len(qr)), np.argmax(qr[:, :packing.P] != PAD, axis=1)] = 7
    return jnp.asarray(qr), live, rng


@pytest.mark.parametrize("accumulation", [1, 2])
def test_an_update_and_experience_with_the_prefix_once_equal_the_plain_ones(accumulation):
    """``rollout.experience`` (policy and reference forwards) and ``learn`` (two epochs x two mini-batches, whole
    groups) with each group's prompt once, with and without the shared first token once for all."""
    qr, live, rng = prefixed_rows(7)
    program, config = packing.program_for("grpo", accumulation, False, optax.sgd(1.0), shared_prompt_forward=True,
                                          behaviour_logprobs="forward")
    state = packing.state_for(program, config, "grpo")
    state = state.replace(frozen={**state.frozen, "ref": packing.params_for("grpo", seed=5)["policy"]})
    experiences, updates = [], []
    for prefix in (0, 1):
        run = with_prefix(program, prefix)
        experiences.append(jax.jit(lambda s: rollout.experience(run, s, qr, packing.P)[0])(state))
        updates.append(jax.jit(lambda s, e: update.learn(run, s, e, jax.random.key(3)))(state, experiences[0]))
    for (path, a), (_, b) in zip(*(jax.tree_util.tree_flatten_with_path(e)[0] for e in experiences)):
        np.testing.assert_allclose(np.asarray(b, np.float64), np.asarray(a, np.float64), err_msg=str(path),
                                   rtol=1e-5, atol=1e-5)
    (state_a, metrics_a), (state_b, metrics_b) = updates
    for name, value in metrics_a.items():
        np.testing.assert_allclose(metrics_b[name], value, err_msg=name, rtol=1e-5, atol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-5), state_a.params,
                 state_b.params)
    assert float(jnp.max(jnp.abs(state_a.params["policy"]["lm_head"]["kernel"]
                                 - state.params["policy"]["lm_head"]["kernel"]))) > 0
