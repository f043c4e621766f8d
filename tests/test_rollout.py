"""The rollout half of the PPO program (``ppojax.rl.program.make_rollout``) against the rollout's steps
(docs/algorithm.md, "Rollout"), with independent references: torch transformers forwards (TRL's forward / get_reward)
for log-probs, values and scores, numpy for truncation and masks; the Python reward-function path; no recompilation
across rollouts."""
import dataclasses

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from ppojax.rl import forward  # noqa: E402
from ppojax.rl import rollout  # noqa: E402
from ppojax.rl.actor_critic import ActorCritic  # noqa: E402
from ppojax.trainer.config import PPOConfig  # noqa: E402
from ppojax.models import load_pretrained  # noqa: E402
from ppojax.core.masks import INVALID_LOGPROB  # noqa: E402
from ppojax.rl.rewards import GivenScores, FunctionScores, ModelScores  # noqa: E402
from ppojax.rl.settings import Hyperparams, StepSettings  # noqa: E402
from ppojax.rl.program import PPOProgram, make_rollout  # noqa: E402
from ppojax.rl.types import init_train_state  # noqa: E402
from ppojax.rl.optimizer import make_optimizer  # noqa: E402
from tests.test_forward import trl_first_true_indices, trl_inputs  # noqa: E402
from tests.test_generate import PAD, PROMPTS, build_tiny_hf  # noqa: E402

R, T, PENALTY = 10, 0.7, 1.0
P = PROMPTS.shape[1]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Policy, reference (different weights), value and reward models: torch originals + ppojax splits."""
    out = {}
    for name, seed, score in [("policy", 0, False), ("ref", 1, False), ("value", 2, True), ("reward", 3, True)]:
        directory = tmp_path_factory.mktemp(name)
        hf = build_tiny_hf("llama", directory, seed=seed, score=score)
        module, _ = load_pretrained(directory, kind="score" if score else "causal_lm")
        out[name] = (hf, *nnx.split(module))
    return out


def settings_for(stop=None, penalty=None, chunk=4, forward_batch_size=None, kl_estimator="k1", response_length=R,
                 behaviour_logprobs="forward"):
    config = PPOConfig(response_length=response_length, temperature=T, stop_token_id=stop,
                       missing_eos_penalty=penalty, logits_chunk_size=chunk, batch_size=len(PROMPTS),
                       local_rollout_forward_batch_size=forward_batch_size, kl_estimator=kl_estimator,
                       behaviour_logprobs=behaviour_logprobs)
    return StepSettings.from_config(config, pad_token_id=PAD, stop_token_id=stop)


def program_and_state(models, settings, reward=None):
    """A PPOProgram over the tiny torch-twin models (reward: a ModelScores on models['reward'] by default)
    and a TrainState holding their parameters."""
    actor_critic = ActorCritic(models["policy"][1], models["value"][1], PAD, T)
    reward = reward or ModelScores(models["reward"][1], PAD, settings.batch.local_rollout_forward_batch_size)
    program = PPOProgram(actor_critic, reward, settings, make_optimizer())
    state = init_train_state({"policy": models["policy"][2], "value": models["value"][2]}, program.optimizer,
                             hyperparams=Hyperparams.create(),
                             frozen={"ref": models["ref"][2], "reward": models["reward"][2]})
    return program, state


def make_experience(models, settings, key, reward=None):
    program, state = program_and_state(models, settings, reward)
    experience, failures = make_rollout(program)(state, PROMPTS, key)
    assert int(failures) == 0
    return experience


def torch_logprobs(hf, query_responses):
    with torch.no_grad():
        ids, mask, pos = trl_inputs(query_responses)
        logits = hf(input_ids=ids, attention_mask=mask, position_ids=pos).logits[:, P - 1:-1].double() / (T + 1e-7)
    responses = torch.tensor(query_responses[:, P:], dtype=torch.long)
    return torch.gather(torch.log_softmax(logits, -1), 2, responses[..., None])[..., 0].numpy()


def torch_scores(hf, query_responses):
    with torch.no_grad():
        ids, mask, pos = trl_inputs(query_responses)
        hidden = getattr(hf, hf.base_model_prefix)(input_ids=ids, attention_mask=mask, position_ids=pos)[0]
        return hf.score(hidden)[..., 0].double().numpy()


def check_against_spec(exp, models, settings):
    """Every field of the experience, recomputed independently (docs/algorithm.md, "Rollout", steps 2-8)."""
    stop = settings.sampling.stop_token_id
    queries, qr = np.asarray(exp.queries), np.asarray(exp.query_responses)
    np.testing.assert_array_equal(queries, PROMPTS)
    raw = qr[:, P:]
    # step 2: truncate after the first stop token (kept), pad after
    truncated = raw.copy()
    for row in truncated:
        hits = np.flatnonzero(row == stop) if stop is not None else []
        if len(hits):
            row[hits[0] + 1:] = PAD
    np.testing.assert_array_equal(exp.responses, truncated)
    # steps 3-4
    seq = trl_first_true_indices(truncated == PAD) - 1
    t = np.arange(R)[None]
    np.testing.assert_array_equal(exp.last_index, seq)
    np.testing.assert_array_equal(exp.padding_mask, t > seq[:, None])
    np.testing.assert_array_equal(exp.padding_mask_p1, t > seq[:, None] + 1)
    live, live_p1 = t <= seq[:, None], t <= seq[:, None] + 1
    # step 5: behaviour and reference log-probs on the UNtruncated query_responses; INVALID on padding
    for name, field in [("policy", exp.logprobs), ("ref", exp.ref_logprobs)]:
        expected = np.where(live, torch_logprobs(models[name][0], qr), INVALID_LOGPROB)
        np.testing.assert_allclose(field, expected, atol=3e-5, rtol=1e-5, err_msg=name)
    # step 6: values at positions P-1 ... P+R-2, 0 on padding_mask_p1
    expected_values = np.where(live_p1, torch_scores(models["value"][0], qr)[:, P - 1:-1], 0.0)
    np.testing.assert_allclose(exp.values, expected_values, atol=3e-5, rtol=1e-5)
    # step 7: reward model at the last non-pad token of the TRUNCATED sequence; step 8: penalty
    postprocessed = np.concatenate([queries, truncated], axis=1)
    scores = torch_scores(models["reward"][0], postprocessed)[np.arange(len(qr)), seq + P]
    has_stop = (truncated == stop).any(-1) if stop is not None else np.zeros(len(qr), bool)
    penalty = settings.algorithm.missing_eos_penalty
    if penalty is not None:
        scores = scores - penalty * ~has_stop
    np.testing.assert_allclose(exp.scores, scores, atol=3e-5, rtol=1e-5)
    np.testing.assert_array_equal(exp.contains_stop, has_stop)


@pytest.fixture(scope="module")
def rollouts(models):
    """The same key without and with a stop token; the stop token is picked from the unstopped sample so
    that some rows emit it mid-response and some never do."""
    key = jax.random.key(11)
    free_settings = settings_for()
    free = make_experience(models, free_settings, key)
    raw = np.asarray(free.query_responses)[:, P:]
    candidates = [int(tok) for tok in raw[0, 1:-2] if not (raw[1:] == tok).all(-1).any()
                  and not (raw[1:] == tok).any(-1).all()]
    stop = candidates[0] if candidates else int(raw[0, 3])
    stop_settings = settings_for(stop=stop, penalty=PENALTY)
    stopped = make_experience(models, stop_settings, key)
    return key, (free_settings, free), (stop_settings, stopped)


def test_experience_without_stop_token(models, rollouts):
    _, (settings, exp), _ = rollouts
    check_against_spec(exp, models, settings)
    assert not np.asarray(exp.padding_mask).any()  # (no pad sampled here) every position is live


def test_experience_with_stop_token(models, rollouts):
    _, (_, free), (settings, exp) = rollouts
    check_against_spec(exp, models, settings)
    contains = np.asarray(exp.contains_stop)
    assert contains.any() and not contains.all()  # both cases are exercised
    # same key: identical samples up to and including the stop token, pad after (one key per step)
    free_raw, raw = np.asarray(free.query_responses)[:, P:], np.asarray(exp.query_responses)[:, P:]
    np.testing.assert_array_equal(np.where(np.asarray(exp.padding_mask), PAD, free_raw), raw)


def test_num_eos_tokens_counts_the_sampled_eos_tokens(models, rollouts):
    """val/num_eos_tokens (TRL's): eos tokens in the sampled responses; here eos is a token some rows emit, once
    or more, when nothing stops the sampling."""
    key, (free_settings, free), _ = rollouts
    raw = np.asarray(free.query_responses)[:, P:]
    values, counts = np.unique(raw, return_counts=True)
    eos = int(values[np.argmax(counts)])  # the most sampled token: several occurrences
    assert counts.max() > 1
    settings = dataclasses.replace(free_settings,
                                   sampling=dataclasses.replace(free_settings.sampling, eos_token_id=eos))
    exp = make_experience(models, settings, key)
    np.testing.assert_array_equal(np.asarray(exp.query_responses), np.asarray(free.query_responses))
    assert int(exp.num_eos_tokens) == int(np.sum(raw == eos)) == counts.max()


@pytest.mark.parametrize("forward_batch_size", [None, 1])
def test_sampler_logprobs_equal_the_forwards_and_skip_the_policy_forward(models, rollouts, forward_batch_size):
    """behaviour_logprobs: sampler (TRL's way): the decode loop's log-probs pass the same check against
    torch as the forward's, the samples are the same, and the compiled rollout runs one model forward fewer."""
    key, _, (settings, exp) = rollouts
    sampler = settings_for(stop=settings.sampling.stop_token_id, penalty=PENALTY, forward_batch_size=forward_batch_size,
                           behaviour_logprobs="sampler")
    program, state = program_and_state(models, sampler)
    run = make_rollout(program)
    got, failures = run(state, PROMPTS, key)
    assert int(failures) == 0
    np.testing.assert_array_equal(got.query_responses, exp.query_responses)
    check_against_spec(got, models, sampler)
    np.testing.assert_allclose(got.logprobs, exp.logprobs, atol=1e-5)

    if forward_batch_size is not None:
        return  # (lax.map's body is counted once below: compare whole-batch programs only)

    def flops(jitted, *args):  # XLA's count (a loop body counted once), the same way for every program
        return jitted.lower(*args).compile().cost_analysis()["flops"]

    forward_program, _ = program_and_state(models, settings_for(stop=settings.sampling.stop_token_id, penalty=PENALTY,
                                                                forward_batch_size=forward_batch_size))
    saved = (flops(make_rollout(forward_program).jitted, state, jnp.asarray(PROMPTS), key)
             - flops(run.jitted, state, jnp.asarray(PROMPTS), key))
    policy_graphdef = models["policy"][1]
    one_forward = flops(jax.jit(lambda params, qr: forward.response_logprobs(
        nnx.merge(policy_graphdef, params), qr, P, PAD, T, chunk_size=settings.batch.rollout_logits_chunk)[0]),
        state.params["policy"], exp.query_responses)
    assert one_forward > 0 and saved == pytest.approx(one_forward, rel=0.1), (saved, one_forward)


def torch_full_kl(policy_hf, ref_hf, query_responses):
    """sum_v pi (log pi - log pi_ref) of the tempered distributions at the response positions."""
    with torch.no_grad():
        ids, mask, pos = trl_inputs(query_responses)
        logp, logq = (torch.log_softmax(hf(input_ids=ids, attention_mask=mask, position_ids=pos)
                                        .logits[:, P - 1:-1].double() / (T + 1e-7), -1) for hf in (policy_hf, ref_hf))
    return (logp.exp() * (logp - logq)).sum(-1).numpy()


def test_forward_batch_size_chunking_and_full_kl(models, rollouts):
    """Micro-batched, differently chunked forwards give the same experience; the legacy `full` KL matches."""
    _, _, (settings, exp) = rollouts
    assert exp.full_kl is None
    small = settings_for(stop=settings.sampling.stop_token_id, penalty=PENALTY, chunk=3, forward_batch_size=1,
                         kl_estimator="full")
    program, state = program_and_state(models, small)
    again = jax.jit(lambda s, qr: rollout.experience(program, s, qr, P)[0])(state, exp.query_responses)
    for name in ("logprobs", "ref_logprobs", "values"):
        np.testing.assert_allclose(getattr(again, name), getattr(exp, name), atol=1e-5, err_msg=name)
    expected = torch_full_kl(models["policy"][0], models["ref"][0], np.asarray(exp.query_responses))
    expected = np.where(np.asarray(exp.padding_mask), 0.0, expected)
    np.testing.assert_allclose(again.full_kl, expected, atol=3e-5, rtol=1e-4)


class _Tokenizer:
    """Decodes id i to 'w{i}'; skip_special_tokens drops the eos id 0."""

    def batch_decode(self, rows, skip_special_tokens=False):
        return [" ".join(f"w{i}" for i in row if not (skip_special_tokens and i == 0)) for row in rows]


def test_reward_function_scores(models, rollouts):
    key, _, (settings, exp) = rollouts
    seen = {}

    def reward_fn(prompts, completions):
        seen.update(prompts=prompts, completions=completions)
        return [float(len(c.split())) for c in completions]

    got = make_experience(models, settings, key, FunctionScores(reward_fn, _Tokenizer(), PAD))
    np.testing.assert_array_equal(got.responses, exp.responses)
    responses = np.asarray(exp.responses)
    expected_prompts = [" ".join(f"w{i}" for i in row if i != PAD) for row in PROMPTS]
    expected_completions = [" ".join(f"w{i}" for i in row if i != PAD and i != 0) for row in responses]
    assert seen["prompts"] == expected_prompts  # pads dropped
    assert seen["completions"] == expected_completions  # truncated; special tokens (id 0) skipped
    lengths = np.array([len(c.split()) for c in seen["completions"]], np.float32)
    np.testing.assert_allclose(got.scores, lengths - PENALTY * ~np.asarray(exp.contains_stop))

    # A failing function never raises inside the program: its rows get NaN, the failures are counted, and
    # raise_pending() re-raises the function's own error afterwards.
    for bad, match in [(lambda p, c: [1.0] * (len(p) - 1), "2 scores for 3 prompts"),
                       (lambda p, c: [0.0, float("nan"), 0.0], "prompt index 1")]:
        source = FunctionScores(bad, _Tokenizer(), PAD)
        program, state = program_and_state(models, settings, source)
        failed, failures = make_rollout(program)(state, PROMPTS, key)
        assert int(failures) == len(PROMPTS) and np.isnan(np.asarray(failed.scores)).all()
        with pytest.raises(ValueError, match=match):
            source.raise_pending()
        source.raise_pending()  # forgotten once raised


def test_caller_scores_and_value_head_hook(tmp_path):
    """Scores given by the caller; values from a value head on the policy (CausalLMWithValueHead)."""
    hf_dir = tmp_path / "vh"
    build_tiny_hf("llama", hf_dir, seed=0)
    policy, _ = load_pretrained(hf_dir, kind="value_head", seed=5)
    graphdef, params = nnx.split(policy)
    settings = settings_for(response_length=4)
    scores = np.array([0.5, -1.0, 2.0], np.float32)
    program = PPOProgram(ActorCritic(graphdef, None, PAD, T), GivenScores(scores), settings, make_optimizer())
    state = init_train_state({"policy": params}, program.optimizer, hyperparams=Hyperparams.create(),
                             frozen={"ref": params, "reward": None})
    exp, _ = make_rollout(program)(state, PROMPTS, jax.random.key(0))
    np.testing.assert_allclose(exp.scores, scores)
    np.testing.assert_allclose(exp.ref_logprobs, exp.logprobs, atol=1e-6)
    qr = np.asarray(exp.query_responses)
    ids, mask, pos = (jnp.asarray(x.numpy()) for x in trl_inputs(qr))
    values = jax.jit(lambda ids, mask, pos: policy.value(policy(ids, mask, pos)[0]))(ids, mask, pos)
    expected = np.where(np.asarray(exp.padding_mask_p1), 0.0, np.asarray(values)[:, P - 1:-1])
    np.testing.assert_allclose(exp.values, expected, atol=1e-5)


def test_no_recompilation_across_rollouts(models, rollouts):
    """Three rollouts of the same shape (fresh keys, re-split graphdefs): zero compilations after the first."""
    _, _, (settings, _) = rollouts
    compiles = []

    def listener(event, duration, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(duration)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        counts = []
        program, state = program_and_state(models, settings)
        run = make_rollout(program)
        for i in range(3):
            jax.block_until_ready(run(state, PROMPTS, jax.random.key(100 + i)))
            counts.append(len(compiles))
        # the stand-alone sampler: the temperature is traced, so near-greedy sample completions reuse it,
        # and a re-split (equal) graphdef hits the jit cache
        policy_def, policy_params = models["policy"][1], models["policy"][2]
        for i, temperature in enumerate([T, 0.01]):
            graphdef = nnx.graphdef(nnx.merge(policy_def, policy_params))
            jax.block_until_ready(rollout.sample_jit(graphdef, policy_params, PROMPTS, jax.random.key(i),
                                                     temperature, sampling=settings.sampling))
            counts.append(len(compiles))
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert counts[2] == counts[0], f"compilations after each rollout: {counts}"
    assert counts[4] == counts[3], f"the sampler recompiled for another temperature: {counts}"
    assert run.jitted._cache_size() == 1
