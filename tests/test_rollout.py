"""make_experience (ppojax.rollout) against SPEC's rollout steps, with independent references: torch
transformers forwards (TRL's forward / get_reward) for log-probs, values and scores, numpy for truncation and
masks; the Python reward-function path; no recompilation across rollouts."""
import dataclasses

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from ppojax.models import load_pretrained  # noqa: E402
from ppojax.ppo.masks import INVALID_LOGPROB  # noqa: E402
from ppojax.rollout import (RolloutSettings, _sample_responses_jit, experience_forwards, make_experience,  # noqa: E402
                            sample_responses, value_head_values)
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


def model_kwargs(models):
    return dict(policy_graphdef=models["policy"][1], policy_params=models["policy"][2],
                ref_params=models["ref"][2], value_graphdef=models["value"][1], value_params=models["value"][2],
                reward_graphdef=models["reward"][1], reward_params=models["reward"][2])


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
    """Every field of the experience, recomputed independently (SPEC rollout steps 2-8)."""
    stop = settings.stop_token_id
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
    if settings.missing_eos_penalty is not None:
        scores = scores - settings.missing_eos_penalty * ~has_stop
    np.testing.assert_allclose(exp.scores, scores, atol=3e-5, rtol=1e-5)
    np.testing.assert_array_equal(exp.contains_stop, has_stop)


@pytest.fixture(scope="module")
def rollouts(models):
    """The same key without and with a stop token; the stop token is picked from the unstopped sample so
    that some rows emit it mid-response and some never do."""
    key = jax.random.key(11)
    free_settings = RolloutSettings(response_length=R, pad_token_id=PAD, temperature=T, logprob_chunk_size=4)
    free = make_experience(PROMPTS, key, free_settings, **model_kwargs(models))
    raw = np.asarray(free.query_responses)[:, P:]
    candidates = [int(tok) for tok in raw[0, 1:-2] if not (raw[1:] == tok).all(-1).any()
                  and not (raw[1:] == tok).any(-1).all()]
    stop = candidates[0] if candidates else int(raw[0, 3])
    stop_settings = dataclasses.replace(free_settings, stop_token_id=stop, missing_eos_penalty=PENALTY)
    stopped = make_experience(PROMPTS, key, stop_settings, **model_kwargs(models))
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
    small = dataclasses.replace(settings, forward_batch_size=1, logprob_chunk_size=3, compute_full_kl=True)
    kw = model_kwargs(models)
    again = experience_forwards(kw["policy_params"], kw["ref_params"], kw["value_params"], kw["reward_params"],
                                exp.query_responses, prompt_length=P, settings=small,
                                policy_graphdef=kw["policy_graphdef"], value_graphdef=kw["value_graphdef"],
                                reward_graphdef=kw["reward_graphdef"])
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

    kw = {k: v for k, v in model_kwargs(models).items() if not k.startswith("reward")}
    got = make_experience(PROMPTS, key, settings, reward_fn=reward_fn, tokenizer=_Tokenizer(), **kw)
    np.testing.assert_array_equal(got.responses, exp.responses)
    responses = np.asarray(exp.responses)
    expected_prompts = [" ".join(f"w{i}" for i in row if i != PAD) for row in PROMPTS]
    expected_completions = [" ".join(f"w{i}" for i in row if i != PAD and i != 0) for row in responses]
    assert seen["prompts"] == expected_prompts  # pads dropped
    assert seen["completions"] == expected_completions  # truncated; special tokens (id 0) skipped
    lengths = np.array([len(c.split()) for c in seen["completions"]], np.float32)
    np.testing.assert_allclose(got.scores, lengths - PENALTY * ~np.asarray(exp.contains_stop))

    for bad, match in [(lambda p, c: [1.0] * (len(p) - 1), "2 scores for 3 prompts"),
                       (lambda p, c: [0.0, float("nan"), 0.0], "prompt index 1")]:
        with pytest.raises(ValueError, match=match):
            make_experience(PROMPTS, key, settings, reward_fn=bad, tokenizer=_Tokenizer(), **kw)


def test_caller_scores_and_value_head_hook(tmp_path):
    """Scores given by the caller; values from a value head on the policy (CausalLMWithValueHead)."""
    hf_dir = tmp_path / "vh"
    build_tiny_hf("llama", hf_dir, seed=0)
    policy, _ = load_pretrained(hf_dir, kind="value_head", seed=5)
    graphdef, params = nnx.split(policy)
    settings = RolloutSettings(response_length=4, pad_token_id=PAD, temperature=T)
    scores = np.array([0.5, -1.0, 2.0], np.float32)
    exp = make_experience(PROMPTS, jax.random.key(0), settings, policy_graphdef=graphdef, policy_params=params,
                          ref_params=params, policy_value_head=value_head_values, scores=scores)
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
        counts, cache_sizes = [], []
        for i in range(3):
            kw = model_kwargs(models)
            # a trainer may re-split its modules every step: equal graphdefs must hit the jit cache
            kw["policy_graphdef"] = nnx.graphdef(nnx.merge(kw["policy_graphdef"], kw["policy_params"]))
            jax.block_until_ready(make_experience(PROMPTS, jax.random.key(100 + i), settings, **kw))
            counts.append(len(compiles))
            cache_sizes.append((_sample_responses_jit._cache_size(), experience_forwards._cache_size()))
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert counts[2] == counts[0], f"compilations after each rollout: {counts}"
    assert cache_sizes[2] == cache_sizes[0], cache_sizes
    # the sampling temperature is traced: near-greedy sample completions reuse the compiled sampler
    kw = model_kwargs(models)
    cold = dataclasses.replace(settings, temperature=0.01)
    sample_responses(kw["policy_graphdef"], kw["policy_params"], PROMPTS, jax.random.key(0), cold)
    assert _sample_responses_jit._cache_size() == cache_sizes[2][0]
