"""The off-policy corrections (``ppojax.core.offpolicy``; docs/algorithm.md, "Off-policy corrections") against TRL
1.12's own code where it has the option, else NumPy transcriptions of the papers' formulas.

- TRL's vLLM importance sampling (``vllm_importance_sampling_mode`` x its bounds, with and without
  ``mask_truncated_completions``): the weights and TRL's ``sampling/*`` metrics, within 1e-6 of the numbers
  TRL's ``_generate_and_score_completions`` gave in float32 (``tests/data/make_trl_offpolicy_reference.py``, run
  once);
- the loss with those weights and with ``off_policy_mask_threshold`` (grpo, dapo, vespo; with and without the KL
  term): loss, metrics and gradients within 1e-6 of TRL's ``_compute_loss``, the config written with TRL's names
  and run through the update's ``behaviour_weights`` and ``loss_of_outputs``;
- the geometric-mean sequence weights and AReaL's decoupled PPO objective against NumPy transcriptions; the
  decoupled objective with pi_prox = pi_behav is plain PPO (loss and gradient);
- the staleness metrics, the refused configurations, TRL's names, and a whole run on the tiny model with the
  sampler's log-probs as the behaviour policy.
"""
import json
from pathlib import Path
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ppojax import core as ppo
from ppojax.errors import ConfigError
from ppojax.rl.packed_update import rows_only
from ppojax.rl.settings import Hyperparams, StepSettings
from ppojax.rl.types import UpdateBatch
from ppojax.rl.update import behaviour_weights, loss_of_outputs
from ppojax.trainer.config import PPOConfig

REFERENCE = json.loads((Path(__file__).parent / "data" / "trl_offpolicy_reference.json").read_text())
HEADER, INPUTS = REFERENCE["header"], REFERENCE["inputs"]
N, G, T, EOS = HEADER["N"], HEADER["G"], HEADER["T"], HEADER["eos_id"]
PARITY = 1e-6  # float32 against TRL's float32
NO_CRITIC = SimpleNamespace(has_critic=False)
LIVE = np.asarray(INPUTS["completion_mask"], bool)


def _f32(x):
    return jnp.asarray(np.asarray(x, np.float64), jnp.float32)


def config_of(values: dict) -> PPOConfig:
    """A GRPOTrainer user's options (TRL's names), with the sampler's log-probs as the behaviour policy."""
    base = dict(loss_type="grpo", num_generations=G, max_completion_length=T, batch_size=N, stop_token="eos",
                behaviour_logprobs="sampler")
    return PPOConfig.from_dict({**base, **values})


def algorithm_of(config):
    return StepSettings.from_config(config, pad_token_id=0, stop_token_id=EOS, eos_token_id=EOS).algorithm


def update_batch(algorithm, *, behaviour=True, with_ref=False, old=None):
    """The fixed rollout as the update holds it: ``logprobs`` the proximal (TRL's old) log-probs, the sampler's as
    ``behaviour_logprobs``; rows without the stop token out with mask_truncated_completions; then the update's own
    behaviour weights."""
    live = jnp.asarray(LIVE)
    padding_mask = ~live
    last = jnp.sum(live, axis=1) - 1
    padding_mask_p1 = jnp.arange(T)[None, :] > (last[:, None] + 1)
    contains_stop = jnp.any((jnp.asarray(INPUTS["completion_ids"]) == EOS) & live, axis=1)
    invalid = lambda x: jnp.where(padding_mask, ppo.INVALID_LOGPROB, _f32(x))  # noqa: E731
    zeros = jnp.zeros((N, T), jnp.float32)
    batch = UpdateBatch(None, invalid(INPUTS["old_per_token_logps"] if old is None else old), zeros,
                        jnp.where(padding_mask, 0.0, _f32(INPUTS["advantages"])[:, None]), zeros, padding_mask,
                        padding_mask_p1, ref_logprobs=invalid(INPUTS["ref_per_token_logps"]) if with_ref else None,
                        behaviour_logprobs=invalid(INPUTS["sampling_per_token_logps"]) if behaviour else None)
    if algorithm.mask_truncated_completions:
        batch = rows_only(batch, contains_stop)
    metrics = {}
    if algorithm.weighs_behaviour and batch.behaviour_logprobs is not None:
        weights, metrics = behaviour_weights(algorithm, batch)
        batch = batch._replace(behaviour_weights=weights)
    return batch, metrics


def loss_and_grad(algorithm, hyperparams, batch, new=None):
    tokens, value_tokens = jnp.sum(~batch.padding_mask), jnp.sum(~batch.padding_mask_p1)
    zeros = jnp.zeros((N, T), jnp.float32)

    def loss(n):
        return loss_of_outputs(NO_CRITIC, algorithm, hyperparams, n, _f32(INPUTS["entropies"]), zeros, batch, tokens,
                               value_tokens, N)

    (value, stats), grad = jax.value_and_grad(loss, has_aux=True)(
        _f32(INPUTS["per_token_logps"]) if new is None else new)
    return value, stats, grad


# --------------------------------------------------------------------------------------------------
# TRL's vLLM importance sampling: the weights and their metrics
# --------------------------------------------------------------------------------------------------
IS_CASES = REFERENCE["importance_sampling"]


@pytest.mark.parametrize("case", IS_CASES, ids=lambda c: c["name"])
def test_importance_weights_equal_trl(case):
    algorithm = algorithm_of(config_of(case["options_set"]))
    assert algorithm.vllm_importance_sampling_mode == case["config"]["vllm_importance_sampling_mode"]
    assert (algorithm.vllm_importance_sampling_clip_max, algorithm.vllm_importance_sampling_clip_min) == (
        case["config"]["vllm_importance_sampling_clip_max"], case["config"]["vllm_importance_sampling_clip_min"])
    batch, metrics = update_batch(algorithm)
    np.testing.assert_array_equal(~np.asarray(batch.padding_mask), np.asarray(case["completion_mask_used"], bool))
    expected = case["outputs_float32"]
    trl = np.broadcast_to(np.asarray(expected["importance_sampling_ratio"]), (N, T))  # [N, 1] per sequence
    np.testing.assert_allclose(np.asarray(batch.behaviour_weights), trl, rtol=0, atol=PARITY)
    np.testing.assert_allclose(np.asarray(batch.behaviour_weights), np.broadcast_to(
        np.asarray(case["outputs"]["importance_sampling_ratio"]), (N, T)), rtol=0, atol=2e-6)  # TRL in float64
    assert set(expected["metrics"]) == {name for name in metrics if name.startswith("sampling/")}
    for name, value in expected["metrics"].items():
        assert abs(float(metrics[name]) - value) <= PARITY, (name, float(metrics[name]), value)


def test_the_importance_sampling_cases_cross_every_bound():
    """Every mode x bounds is covered, and TRL's weights differ from the unbounded ratio (so the parity above can
    fail on the truncation or the mask)."""
    names = {c["name"] for c in IS_CASES}
    for mode in ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask"):
        assert {f"{mode}_default", f"{mode}_both", f"{mode}_minonly"} <= names
    assert min(HEADER["diagnostics"].values()) > 0, HEADER["diagnostics"]
    log_ratio = (np.asarray(INPUTS["old_per_token_logps"]) - np.asarray(INPUTS["sampling_per_token_logps"])) * LIVE
    for case in IS_CASES:
        if case["config"]["mask_truncated_completions"]:
            continue
        ratio = np.asarray(case["outputs"]["importance_sampling_ratio"])
        raw = np.exp(log_ratio.sum(1, keepdims=True) if ratio.shape[1] == 1 else log_ratio)
        assert not np.allclose(ratio, raw), case["name"]


def numpy_geometric_weights(old, sampling, live, constraint, clip_max, clip_min):
    """The geometric-mean sequence weight: exp(mean over a row's live tokens of log pi_prox - log pi_behav),
    truncated to [clip_min, clip_max] or set to 0 outside it (verl's geometric level)."""
    log_ratio = np.where(live, old - sampling, 0.0)
    rows = np.exp(log_ratio.sum(1) / np.maximum(live.sum(1), 1))
    low = -np.inf if clip_min is None else clip_min
    high = np.inf if clip_max is None else clip_max
    if constraint == "truncate":
        return np.clip(rows, low, high)
    return np.where((rows < low) | (rows > high), 0.0, rows)


@pytest.mark.parametrize("constraint", ["truncate", "mask"])
@pytest.mark.parametrize("bounds", [(1.5, None), (1.2, 0.8), (None, 0.7)], ids=["maxonly", "both", "minonly"])
def test_geometric_weights_equal_a_numpy_transcription(constraint, bounds):
    clip_max, clip_min = bounds
    old, sampling = (np.asarray(INPUTS[k], np.float64) for k in ("old_per_token_logps", "sampling_per_token_logps"))
    expected = numpy_geometric_weights(old, sampling, LIVE, constraint, clip_max, clip_min)
    config = config_of(dict(vllm_importance_sampling_correction=True,
                            vllm_importance_sampling_mode=f"geometric_{constraint}",
                            vllm_importance_sampling_clip_max=clip_max, vllm_importance_sampling_clip_min=clip_min))
    batch, metrics = update_batch(algorithm_of(config))
    np.testing.assert_allclose(np.asarray(batch.behaviour_weights), np.broadcast_to(expected[:, None], (N, T)),
                               rtol=0, atol=PARITY)
    assert abs(float(metrics["sampling/importance_sampling_ratio/mean"]) - expected.mean()) <= PARITY
    unbounded = numpy_geometric_weights(old, sampling, LIVE, constraint, None, None)
    assert not np.allclose(expected, unbounded)  # the bounds act on these inputs
    masked = (expected == 0) & (unbounded != 0)
    assert abs(float(metrics["offpolicy/importance_sampling_masked_fraction"])
               - (masked[:, None] & LIVE).sum() / LIVE.sum()) <= PARITY


# --------------------------------------------------------------------------------------------------
# The loss with the weights and with off-policy sequence masking
# --------------------------------------------------------------------------------------------------
LOSS_CASES = REFERENCE["loss"]


@pytest.mark.parametrize("case", LOSS_CASES, ids=lambda c: c["name"])
def test_loss_equals_trl(case):
    config = config_of(case["options_set"])
    algorithm, hyperparams = algorithm_of(config), Hyperparams.from_config(config)
    assert algorithm.uses_policy_objective and algorithm.loss_type == case["config"]["loss_type"]
    assert algorithm.vllm_importance_sampling_correction == case["config"]["vllm_importance_sampling_correction"]
    assert algorithm.off_policy_mask_threshold == case["config"]["off_policy_mask_threshold"]
    batch, _ = update_batch(algorithm, behaviour=case["config"]["use_vllm"], with_ref=algorithm.kl_in_loss)
    loss, stats, grad = loss_and_grad(algorithm, hyperparams, batch)
    expected = case["outputs_float32"]
    assert abs(float(loss) - expected["loss"]) <= PARITY, (float(loss), expected["loss"])
    assert abs(float(loss) - case["outputs"]["loss"]) <= 1e-5  # TRL in float64
    np.testing.assert_allclose(np.asarray(grad), np.asarray(expected["grad_logps"]), rtol=0, atol=PARITY)
    mine = {"entropy": stats["entropy"], **stats["objective"]}
    for name, value in expected["metrics"].items():
        assert abs(float(mine[name]) - value) <= PARITY, (name, float(mine[name]), value)
    if algorithm.off_policy_mask_threshold is not None:
        assert 0 < float(mine["offpolicy/off_policy_masked_fraction"]) < 1


def test_the_corrections_change_trls_loss():
    """Each correction moves TRL's loss (so the parity above can fail on it)."""
    by_name = {c["name"]: c["outputs_float32"]["loss"] for c in LOSS_CASES}
    modes = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
    assert len({by_name[f"grpo_{mode}"] for mode in modes}) == 4
    assert by_name["grpo_opsm_token_truncate"] != by_name["grpo_token_truncate"]
    assert by_name["vespo_token_truncate"] != by_name["vespo_token_mask"]
    algorithm = algorithm_of(config_of({}))  # no correction at all
    plain, _, _ = loss_and_grad(algorithm, Hyperparams.from_config(config_of({})), update_batch(algorithm)[0])
    assert all(abs(float(plain) - by_name[f"grpo_{mode}"]) > 1e-3 for mode in modes)
    assert abs(float(plain) - by_name["grpo_opsm_novllm"]) > 1e-3


# --------------------------------------------------------------------------------------------------
# AReaL's decoupled PPO objective
# --------------------------------------------------------------------------------------------------
def numpy_decoupled_ppo(new, proximal, behaviour, advantages, live, *, eps_clip, eps_clip_higher, c_clip,
                        behav_imp_weight_cap):
    """AReaL's decoupled PPO loss (Fu et al. 2025, eq. 5; its ``ppo_actor_loss_fn``) and its gradient with respect to
    the current log-probs, in NumPy: r = pi_theta / pi_prox clipped to [1 - eps, 1 + eps_high], the dual clip
    min(., c |A|), times the behaviour weight w = pi_prox / pi_behav (0 above the cap), summed over the live tokens
    and divided by their count."""
    ratio = np.where(live, np.exp(new - proximal), 0.0)
    clipped = np.clip(ratio, 1.0 - eps_clip, 1.0 + eps_clip_higher)
    pg1, pg2 = -advantages * ratio, -advantages * clipped
    loss = np.maximum(pg1, pg2)
    unclipped_wins = pg1 >= pg2
    if c_clip is not None:
        pg3 = np.sign(advantages) * c_clip * advantages
        unclipped_wins &= pg3 >= loss
        loss = np.minimum(loss, pg3)
    weight = np.exp(proximal - behaviour)
    kept = live if behav_imp_weight_cap is None else live & (weight <= behav_imp_weight_cap)
    weight = np.where(kept, weight, 0.0)
    count = live.sum()
    value = np.where(live, loss * weight, 0.0).sum() / count
    grad = np.where(live & unclipped_wins, -advantages * ratio * weight, 0.0) / count
    return value, grad


DECOUPLED = [dict(behav_imp_weight_cap=None, dual_clip_c=None), dict(behav_imp_weight_cap=1.5, dual_clip_c=None),
             dict(behav_imp_weight_cap=2.0, dual_clip_c=1.5)]


@pytest.mark.parametrize("options", DECOUPLED, ids=["uncapped", "cap1.5", "cap2_dualclip"])
def test_decoupled_ppo_equals_a_numpy_transcription(options):
    config = config_of(dict(loss_type="ppo", use_decoupled_loss=True, cliprange=0.2, cliprange_high=0.28, **options))
    algorithm, hyperparams = algorithm_of(config), Hyperparams.from_config(config)
    batch, metrics = update_batch(algorithm)
    loss, _, grad = loss_and_grad(algorithm, hyperparams, batch)
    new, proximal, behaviour = (np.asarray(INPUTS[k], np.float64) for k in
                                ("per_token_logps", "old_per_token_logps", "sampling_per_token_logps"))
    advantages = np.broadcast_to(np.asarray(INPUTS["advantages"])[:, None], (N, T))
    expected, expected_grad = numpy_decoupled_ppo(
        new, proximal, behaviour, advantages, LIVE, eps_clip=0.2, eps_clip_higher=0.28, c_clip=options["dual_clip_c"],
        behav_imp_weight_cap=options["behav_imp_weight_cap"])
    assert abs(float(loss) - expected) <= PARITY, (float(loss), expected)
    np.testing.assert_allclose(np.asarray(grad), expected_grad, rtol=0, atol=PARITY)
    weights = np.exp(proximal - behaviour)
    if options["behav_imp_weight_cap"] is not None:  # the cap filters some tokens out on these inputs
        capped = LIVE & (weights > options["behav_imp_weight_cap"])
        assert capped.any()
        assert abs(float(metrics["offpolicy/importance_sampling_masked_fraction"]) - capped.sum() / LIVE.sum()) < 1e-7


@pytest.mark.parametrize("loss_type", ["ppo", "grpo", "dapo"])
def test_decoupled_with_the_behaviour_policy_as_proximal_is_plain_ppo(loss_type):
    """pi_prox = pi_behav: every behaviour weight is 1 and the decoupled objective is the plain one, loss and
    gradient (for ppo: ppo_loss's own clipped surrogate, not the objective path)."""
    options = dict(loss_type=loss_type, cliprange=0.2, cliprange_high=0.28, dual_clip_c=3.0)
    plain_config = config_of(options)
    plain_algorithm = algorithm_of(plain_config)
    assert plain_algorithm.uses_policy_objective == (loss_type != "ppo")
    plain_batch, _ = update_batch(plain_algorithm, old=INPUTS["sampling_per_token_logps"])
    plain, _, plain_grad = loss_and_grad(plain_algorithm, Hyperparams.from_config(plain_config), plain_batch)

    config = config_of(dict(options, use_decoupled_loss=True, behav_imp_weight_cap=2.0))
    algorithm = algorithm_of(config)
    batch, metrics = update_batch(algorithm, old=INPUTS["sampling_per_token_logps"])
    np.testing.assert_array_equal(np.asarray(batch.behaviour_weights), 1.0)
    assert float(metrics["offpolicy/importance_sampling_masked_fraction"]) == 0.0
    decoupled, _, grad = loss_and_grad(algorithm, Hyperparams.from_config(config), batch)
    np.testing.assert_allclose(float(decoupled), float(plain), rtol=1e-7, atol=1e-9)
    np.testing.assert_allclose(np.asarray(grad), np.asarray(plain_grad), rtol=1e-6, atol=1e-9)
    assert np.abs(np.asarray(grad)).max() > 1e-3  # a gradient worth comparing


def test_decoupled_weights_are_token_masked_importance_weights():
    proximal, behaviour = _f32(INPUTS["old_per_token_logps"]), _f32(INPUTS["sampling_per_token_logps"])
    live = jnp.asarray(LIVE)
    capped = ppo.decoupled_weights(proximal, behaviour, live, 2.0)
    masked = ppo.importance_weights(proximal, behaviour, live, "token_mask", 2.0)
    np.testing.assert_array_equal(np.asarray(capped.weights), np.asarray(masked.weights))
    uncapped = ppo.decoupled_weights(proximal, behaviour, live)
    expected = np.where(LIVE, np.exp(np.asarray(proximal) - np.asarray(behaviour)), 1.0)
    np.testing.assert_allclose(np.asarray(uncapped.weights), expected, rtol=1e-6)
    assert not np.asarray(uncapped.masked).any()


def test_the_weights_carry_no_gradient():
    proximal, behaviour = _f32(INPUTS["old_per_token_logps"]), _f32(INPUTS["sampling_per_token_logps"])
    live = jnp.asarray(LIVE)
    for mode in ppo.IMPORTANCE_SAMPLING_MODES:
        grads = jax.grad(lambda p, b: jnp.sum(ppo.importance_weights(p, b, live, mode, 2.0, 0.5).weights),
                         argnums=(0, 1))(proximal, behaviour)
        assert all(not np.asarray(g).any() for g in grads), mode


# --------------------------------------------------------------------------------------------------
# Policy versions, configuration
# --------------------------------------------------------------------------------------------------
def test_staleness_metrics():
    versions = jnp.asarray([[5, 5, 3], [4, 4, 0]], jnp.int32)
    live = jnp.asarray([[True, True, True], [True, False, False]])
    metrics = ppo.staleness_metrics(versions, jnp.int32(5), live)
    assert float(metrics["offpolicy/staleness_mean"]) == pytest.approx((0 + 0 + 2 + 1) / 4)
    assert int(metrics["offpolicy/staleness_max"]) == 2  # the dead slot's 5 behind is not counted
    none = ppo.staleness_metrics(versions, jnp.int32(5), jnp.zeros_like(live))
    assert (float(none["offpolicy/staleness_mean"]), int(none["offpolicy/staleness_max"])) == (0.0, 0)


SAMPLER = dict(behaviour_logprobs="sampler")
REFUSED = [
    (dict(vllm_importance_sampling_correction=True), "behaviour_logprobs='forward'"),
    (dict(use_decoupled_loss=True), "behaviour_logprobs='forward'"),
    (dict(SAMPLER, vllm_importance_sampling_correction=True, vllm_importance_sampling_mode="token"),
     "vllm_importance_sampling_mode='token': expected one of"),
    (dict(SAMPLER, vllm_importance_sampling_correction=True, vllm_importance_sampling_clip_max=0.0),
     "vllm_importance_sampling_clip_max=0.0: expected null or a number > 0"),
    (dict(SAMPLER, vllm_importance_sampling_correction=True, vllm_importance_sampling_cap=-1.0),
     "vllm_importance_sampling_clip_max=-1.0"),
    (dict(SAMPLER, vllm_importance_sampling_correction=True, vllm_importance_sampling_clip_min=2.0,
          vllm_importance_sampling_clip_max=2.0), "is not below vllm_importance_sampling_clip_max=2.0"),
    (dict(SAMPLER, vllm_importance_sampling_correction=True, vllm_importance_sampling_mode="token_truncate",
          vllm_importance_sampling_clip_max=None), "set at least one of them"),
    (dict(SAMPLER, vllm_importance_sampling_mode="token_mask"), "read only with vllm_importance_sampling_correction"),
    (dict(SAMPLER, use_decoupled_loss=True, vllm_importance_sampling_correction=True), "keep one"),
    (dict(SAMPLER, behav_imp_weight_cap=2.0), "set use_decoupled_loss: true"),
    (dict(SAMPLER, use_decoupled_loss=True, behav_imp_weight_cap=1.0), "behav_imp_weight_cap=1.0: expected null or "
                                                                        "a number > 1"),
    (dict(off_policy_mask_threshold=-0.1), "off_policy_mask_threshold=-0.1"),
    (dict(SAMPLER, loss_type="gmpo", advantage_estimator="rloo", use_decoupled_loss=True),
     "loss_type='gmpo', which takes no off-policy correction"),
    (dict(SAMPLER, loss_type="vespo", advantage_estimator="rloo", vllm_importance_sampling_correction=True),
     "'sequence_mask' with loss_type='vespo': it takes per-token weights only"),
]


@pytest.mark.parametrize("values, message", REFUSED, ids=[m[:40] for _, m in REFUSED])
def test_bad_combinations_are_refused_before_compute(values, message):
    with pytest.raises(ConfigError, match="Fix|[Ss]et|[Uu]se|keep|remove") as err:
        PPOConfig.from_dict(dict(num_generations=2, **values))
    assert message in str(err.value), str(err.value)


def test_trls_names_are_read():
    """A GRPOTrainer config's off-policy options are ppojax fields (the deprecated cap is clip_max); without
    them nothing changes."""
    config = PPOConfig.from_dict(dict(loss_type="dapo", behaviour_logprobs="sampler",
                                      vllm_importance_sampling_correction=True, vllm_importance_sampling_cap=2.5,
                                      vllm_importance_sampling_mode="token_truncate", off_policy_mask_threshold=0.5))
    algorithm = algorithm_of(config)
    assert (algorithm.vllm_importance_sampling_clip_max, algorithm.vllm_importance_sampling_mode,
            algorithm.off_policy_mask_threshold) == (2.5, "token_truncate", 0.5)
    assert algorithm.weighs_behaviour and algorithm.uses_policy_objective
    plain = algorithm_of(PPOConfig())
    assert not plain.weighs_behaviour and not plain.uses_policy_objective


def test_the_off_policy_traits_are_spelled_without_jax():
    from ppojax.core.objectives import registry
    from ppojax.trainer.config.sections.offpolicy import (IMPORTANCE_SAMPLING_MODES, POLICY_OBJECTIVE_OFF_POLICY,
                                                          POLICY_OBJECTIVE_OFF_POLICY_REASONS)
    from ppojax.trainer.config.sections.objective import BUILTIN_POLICY_OBJECTIVES
    traits = {name: registry.policy_objective(name).off_policy for name in BUILTIN_POLICY_OBJECTIVES}
    assert {n: k for n, k in traits.items() if k != "weighted"} == POLICY_OBJECTIVE_OFF_POLICY
    assert set(POLICY_OBJECTIVE_OFF_POLICY_REASONS) == set(POLICY_OBJECTIVE_OFF_POLICY)
    assert IMPORTANCE_SAMPLING_MODES == ppo.IMPORTANCE_SAMPLING_MODES


# --------------------------------------------------------------------------------------------------
# Whole runs: the sampler's log-probs as the behaviour policy, the training forward as the proximal one
# --------------------------------------------------------------------------------------------------
RUNS = {  # TRL's and AReaL's names
    "trl_token_truncate_opsm": dict(loss_type="grpo", vllm_importance_sampling_correction=True,
                                    vllm_importance_sampling_mode="token_truncate", off_policy_mask_threshold=0.5),
    "areal_decoupled_padding_free": dict(loss_type="ppo", advantage_estimator="grpo", use_decoupled_loss=True,
                                         behav_imp_weight_cap=2.0, padding_free=True),
}


@pytest.mark.parametrize("name", RUNS)
def test_a_run_weighs_the_samplers_tokens(tmp_path, name):
    """A synchronous run with behaviour_logprobs: sampler: the rollout keeps the training forward beside the
    sampler's log-probs, the update weighs them (one compile; on packed rows too), and every token is of the
    current version. The tiny float32 model samples with the training forward's numbers, so the weights are 1 to
    float rounding (not exactly: two computations)."""
    from tests.test_objective_runs import trainer_for

    trainer = trainer_for(tmp_path, dict(num_generations=4, max_completion_length=8, learning_rate=1e-3,
                                         total_episodes=16 * 2, behaviour_logprobs="sampler", **RUNS[name]))
    algorithm = trainer.run.settings.algorithm
    assert algorithm.weighs_behaviour and algorithm.uses_policy_objective
    history = trainer.train(progress=False)
    assert len(history) == 2 and trainer.train_step.jitted._cache_size() == 1
    for metrics in history:
        assert np.isfinite(metrics["loss/policy_avg"]) and metrics["ppo/skipped_steps"] == 0
        assert metrics["offpolicy/staleness_mean"] == 0 and metrics["offpolicy/staleness_max"] == 0
        for side in ("min", "mean", "max"):
            assert abs(metrics[f"sampling/importance_sampling_ratio/{side}"] - 1.0) < 1e-3, side
        assert 0 <= metrics["sampling/sampling_logp_difference/mean"] <= metrics[
            "sampling/sampling_logp_difference/max"] < 1e-3
        assert metrics["offpolicy/importance_sampling_masked_fraction"] == 0
        if algorithm.off_policy_mask_threshold is not None:
            assert metrics["offpolicy/off_policy_masked_fraction"] == 0  # on-policy: no sequence drifted
