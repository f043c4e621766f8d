"""The policy objectives (``loss_type``) and their options against TRL 1.12's own code, and what TRL lacks against
transcriptions of verl's code and the papers' formulas.

- every TRL loss_type x importance_sampling_level x option, and GMPO: the loss, TRL's metrics and the gradients
  w.r.t. the new log-probs and the entropies, within 1e-6 of the numbers TRL's ``_compute_loss`` gave in float32
  (``tests/data/make_trl_objectives_reference.py``, run once). The configs are written with TRL's names and go
  through ``PPOConfig`` and the update's own ``loss_of_outputs``;
- multi_objective_aggregation (both modes) against TRL's advantages; the soft overlong punishment against TRL's
  reward function; REINFORCE++-baseline against a NumPy transcription of verl's estimator;
- micro-batches with the mini-batch's counts sum to the big batch for every objective.
"""
import json
from pathlib import Path
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ppojax import core as ppo
from ppojax.rl.packed_update import rows_only
from ppojax.rl.rewards import weighted_total
from ppojax.rl.settings import Hyperparams, StepSettings
from ppojax.rl.types import UpdateBatch
from ppojax.rl.update import loss_of_outputs
from ppojax.trainer.config import PPOConfig

REFERENCE = json.loads((Path(__file__).parent / "data" / "trl_objectives_reference.json").read_text())
HEADER, INPUTS = REFERENCE["header"], REFERENCE["inputs"]
N, G, T, EOS = HEADER["N"], HEADER["G"], HEADER["T"], HEADER["eos_id"]
PARITY = 1e-6  # float32 against TRL's float32
NO_CRITIC = SimpleNamespace(has_critic=False)
#: TRL GRPOTrainer metrics that are the objective's own (ppo_loss's stats["objective"])
OBJECTIVE_METRICS = ("kl", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean",
                     "clip_ratio/low_min", "clip_ratio/high_max", "cispo_clip_ratio", "vespo/phi_seq_mean")


def _f32(x):
    return jnp.asarray(np.asarray(x, np.float64), jnp.float32)


def trl_config(case) -> PPOConfig:
    """The case's options as a GRPOTrainer user writes them (TRL's names), read by PPOConfig."""
    values = dict(loss_type=case["config"]["loss_type"], num_generations=G, max_completion_length=T,
                  batch_size=N, stop_token="eos")
    return PPOConfig.from_dict({**values, **case["options_set"]})


def update_batch(algorithm, with_ref):
    """The fixed rollout as the update holds it; rows without the stop token left out with
    mask_truncated_completions, as ``shaped_rewards_and_advantages`` does."""
    live = jnp.asarray(INPUTS["completion_mask"], bool)
    padding_mask = ~live
    last = jnp.sum(live, axis=1) - 1
    padding_mask_p1 = jnp.arange(T)[None, :] > (last[:, None] + 1)
    contains_stop = jnp.any((jnp.asarray(INPUTS["completion_ids"]) == EOS) & live, axis=1)
    invalid = lambda x: jnp.where(padding_mask, ppo.INVALID_LOGPROB, _f32(x))  # noqa: E731
    zeros = jnp.zeros((N, T), jnp.float32)
    batch = UpdateBatch(None, invalid(INPUTS["old_per_token_logps"]), zeros,
                        jnp.where(padding_mask, 0.0, _f32(INPUTS["advantages"])[:, None]), zeros, padding_mask,
                        padding_mask_p1, ref_logprobs=invalid(INPUTS["ref_per_token_logps"]) if with_ref else None)
    if algorithm.mask_truncated_completions:
        batch = rows_only(batch, contains_stop)
    return batch


def ppojax_loss(case):
    """(loss, stats, d loss / d new log-probs, d loss / d entropies) through the update's loss_of_outputs."""
    config = trl_config(case)
    settings = StepSettings.from_config(config, pad_token_id=0, stop_token_id=EOS, eos_token_id=EOS)
    algorithm, hyperparams = settings.algorithm, Hyperparams.from_config(config)
    batch = update_batch(algorithm, algorithm.kl_in_loss)
    tokens, value_tokens = jnp.sum(~batch.padding_mask), jnp.sum(~batch.padding_mask_p1)
    zeros = jnp.zeros((N, T), jnp.float32)

    def loss(new, entropy):
        return loss_of_outputs(NO_CRITIC, algorithm, hyperparams, new, entropy, zeros, batch, tokens, value_tokens, N)

    (value, stats), (grad_new, grad_entropy) = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(
        _f32(INPUTS["per_token_logps"]), _f32(INPUTS["entropies"]))
    return config, batch, value, stats, grad_new, grad_entropy


def ppojax_metrics(config, stats):
    """ppojax's values of the metrics TRL's GRPOTrainer logged."""
    out = {"entropy": stats["entropy"], "entropy_coef": config.entropy_coef,
           "policy_loss": stats["pg_loss"] + config.kl_loss_coef * stats.get("kl_loss", 0.0)}
    out.update(stats.get("objective", {}))
    return out


def gmpo_truncated_rows_constant(case):
    """TRL's GMPO loss keeps -A_i exp(0) for the rows mask_truncated_completions empties (a constant: no gradient);
    ppojax leaves them out. The difference, -sum(A_i) / N over those rows."""
    if case["config"]["loss_type"] != "gmpo" or not case["config"]["mask_truncated_completions"]:
        return 0.0
    emptied = np.asarray(case["completion_mask_used"]).sum(1) == 0
    return -float(np.sum(np.asarray(INPUTS["advantages"])[emptied])) / N


def cispo_truncated_rows_share(case):
    """TRL's sequence-level cispo_clip_ratio averages over every row, the ones mask_truncated_completions empties
    included, at their ratio exp(0) = 1 and their advantage: counted as capped when 1 > epsilon_high and A > 0.
    ppojax counts a row it left out as not capped. The difference, that share of the rows."""
    config = case["config"]
    if not (config["loss_type"] == "cispo" and config["importance_sampling_level"] == "sequence"
            and config["mask_truncated_completions"] and config["epsilon_high_used"] < 1):
        return 0.0
    emptied = np.asarray(case["completion_mask_used"]).sum(1) == 0
    return float(np.sum(emptied & (np.asarray(INPUTS["advantages"]) > 0))) / N


CASES = REFERENCE["objective_loss"]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c["name"])
def test_objective_equals_trl(case):
    config, batch, loss, stats, grad_new, grad_entropy = ppojax_loss(case)
    expected, loose = case["outputs_float32"], case["outputs"]
    assert config.loss_type == case["config"]["loss_type"]
    assert (config.cliprange, config.cliprange_high or config.cliprange) == pytest.approx(
        (case["config"]["epsilon_low_used"], case["config"]["epsilon_high_used"]))
    np.testing.assert_array_equal(~np.asarray(batch.padding_mask), np.asarray(case["completion_mask_used"], bool))
    constant = gmpo_truncated_rows_constant(case)
    assert abs(float(loss) + constant - expected["loss"]) <= PARITY
    assert abs(float(loss) + constant - loose["loss"]) <= 1e-5  # TRL in float64
    np.testing.assert_allclose(np.asarray(grad_new), np.asarray(expected["grad_logps"]), rtol=0, atol=PARITY)
    np.testing.assert_allclose(np.asarray(grad_entropy), np.asarray(expected["grad_entropies"]), rtol=0,
                               atol=PARITY)
    mine = ppojax_metrics(config, stats)
    assert set(expected["metrics"]) <= set(mine), set(expected["metrics"]) - set(mine)
    for name, value in expected["metrics"].items():
        if name == "policy_loss":
            value = value - constant
        if name == "cispo_clip_ratio":
            value = value - cispo_truncated_rows_share(case)
        assert abs(float(mine[name]) - value) <= PARITY, (name, float(mine[name]), value)


def test_the_cases_cover_every_loss_type_level_and_option():
    names = {c["name"] for c in CASES}
    for loss_type, levels in {"grpo": "ts", "dr_grpo": "ts", "dapo": "ts", "bnpo": "ts", "cispo": "ts",
                              "sapo": "ts", "luspo": "s", "vespo": "t", "gmpo": "t"}.items():
        for level in levels:
            level = {"t": "token", "s": "sequence"}[level]
            for option in ("plain", "eh", "beta", "beta_nobiascorr", "topent0.5", "masktrunc", "all"):
                if loss_type != "gmpo" or option in ("plain", "eh", "beta", "topent0.5", "masktrunc"):
                    assert f"{loss_type}_{level}_{option}" in names, (loss_type, level, option)
    assert {f"{t}_token_delta" for t in ("grpo", "dr_grpo", "dapo", "bnpo")} <= names
    assert "sapo_token_temps" in names and "vespo_token_params" in names and "cispo_sequence_entcoef" in names
    diagnostics = HEADER["diagnostics"]  # every clip is active on some valid tokens / sequences
    assert min(diagnostics.values()) > 0, diagnostics
    truncated = [c for c in CASES if c["config"]["mask_truncated_completions"]]
    assert truncated and all(np.asarray(c["completion_mask_used"]).sum() < diagnostics["n_valid_tokens"]
                             for c in truncated)


def test_the_objective_options_change_the_loss():
    """Each option the parity cases set moves TRL's loss (so the parity above can fail on it)."""
    by_name = {c["name"]: c["outputs_float32"]["loss"] for c in CASES}
    for loss_type in ("grpo", "cispo", "sapo", "vespo"):
        plain = by_name[f"{loss_type}_token_plain"]
        for option in ("beta", "topent0.5", "masktrunc"):
            assert by_name[f"{loss_type}_token_{option}"] != plain, (loss_type, option)
    assert by_name["grpo_sequence_plain"] != by_name["grpo_token_plain"]
    assert by_name["grpo_token_delta"] != by_name["grpo_token_plain"]
    assert by_name["cispo_token_eh"] != by_name["cispo_token_plain"]
    assert by_name["gmpo_token_eh"] != by_name["gmpo_token_plain"]


# --------------------------------------------------------------------------------------------------
# Advantages and rewards
# --------------------------------------------------------------------------------------------------
def _advantage_inputs(scores, components=None, weights=None):
    live = jnp.asarray(REFERENCE["multi_objective"][0]["inputs"]["completion_mask"], bool)
    last = jnp.sum(live, axis=1) - 1
    slot = ppo.score_index(last, T)
    rewards = jnp.zeros((N, T), jnp.float32).at[jnp.arange(N), slot].set(scores)
    padding_mask_p1 = jnp.arange(T)[None, :] > (last[:, None] + 1)
    return ppo.AdvantageInputs(rewards, scores, None, ~live, padding_mask_p1, components, weights), live


@pytest.mark.parametrize("case", REFERENCE["multi_objective"], ids=lambda c: c["name"])
def test_multi_objective_aggregation_equals_trl(case):
    """Two rewards (NaN where one does not apply), weighted: sum_then_normalize is GRPO on the weighted sum (the
    reward source's weighted_total); normalize_then_sum normalises each within its group first (GDPO)."""
    components = _f32(np.asarray(case["inputs"]["rewards_per_func"]).T)
    weights = _f32(case["config"]["reward_weights"])
    scores = weighted_total(components, weights)
    batch, live = _advantage_inputs(scores, components, weights)
    settings = SimpleNamespace(num_generations=G, scale_rewards=case["config"]["scale_rewards"],
                               multi_objective_aggregation=case["config"]["multi_objective_aggregation"])
    advantages = np.asarray(ppo.advantage_estimator("grpo").fn(batch, settings).advantages)
    expected = np.asarray(case["outputs_float32"]["advantages"])
    if case["config"]["multi_objective_aggregation"] == "sum_then_normalize":
        expected = np.where(np.isnan(np.asarray(scores)), np.nan, expected)  # TRL zeroes them; ppojax skips the
        advantages = np.where(np.isnan(np.asarray(scores))[:, None], np.nan, advantages)  # update (NaN reward)
    np.testing.assert_allclose(advantages, np.where(live, expected[:, None], 0.0), rtol=0, atol=PARITY * 2)


@pytest.mark.parametrize("case", REFERENCE["soft_overlong_punishment"],
                         ids=lambda c: f"L{c['max_completion_len']}_cache{c['soft_punish_cache']}")
def test_soft_overlong_punishment_equals_trl(case):
    mine = ppo.soft_overlong_punishment(jnp.asarray(case["lengths"]), case["max_completion_len"],
                                        case["soft_punish_cache"])
    np.testing.assert_allclose(np.asarray(mine), case["rewards"], rtol=0, atol=PARITY)


def reinforce_pp_baseline_verl(token_level_rewards, response_mask, index, epsilon=1e-6):
    """verl's compute_reinforce_plus_plus_baseline_outcome_advantage (verl/trainer/ppo/core_algos.py), in NumPy:
    scores minus their group's mean (0 for a group of one), tiled over the response, masked_whiten over the batch
    (unbiased variance, rsqrt(var + 1e-8)), masked."""
    scores = token_level_rewards.sum(-1)
    groups = {}
    for i, g in enumerate(index):
        groups.setdefault(g, []).append(scores[i])
    means = {g: (0.0 if len(s) == 1 else np.mean(s)) for g, s in groups.items()}
    scores = np.array([scores[i] - means[g] for i, g in enumerate(index)])
    tiled = scores[:, None] * response_mask
    m = response_mask.astype(bool)
    mean = tiled[m].mean()
    var = ((tiled[m] - mean) ** 2).sum() / (m.sum() - 1)
    return (tiled - mean) / np.sqrt(var + 1e-8) * response_mask


@pytest.mark.parametrize("group_size", [4, 1])
def test_reinforce_pp_baseline_equals_verls_estimator(group_size):
    rng = np.random.default_rng(3)
    scores = rng.normal(size=N).astype(np.float32)
    batch, live = _advantage_inputs(jnp.asarray(scores))
    settings = SimpleNamespace(num_generations=group_size)
    adv = ppo.advantage_estimator("reinforce_pp_baseline").fn(batch, settings)
    token_rewards = np.asarray(batch.rewards, np.float64)
    expected = reinforce_pp_baseline_verl(token_rewards, np.asarray(live, np.float64),
                                          [i // group_size for i in range(N)])
    np.testing.assert_allclose(np.asarray(adv.advantages), expected, rtol=0, atol=1e-5)
    assert ppo.advantage_estimator("reinforce_pp_baseline").per_sequence


# --------------------------------------------------------------------------------------------------
# Accumulation
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("loss_type, level", [("grpo", "sequence"), ("dr_grpo", "token"), ("dapo", "token"),
                                              ("luspo", "sequence"), ("cispo", "token"), ("sapo", "token"),
                                              ("vespo", "token"), ("gmpo", "token")])
def test_micro_batches_sum_to_the_big_batch(loss_type, level):
    """With the mini-batch's counts, two halves' losses and gradients sum to the whole batch's."""
    case = {"config": {"loss_type": loss_type},
            "options_set": {"importance_sampling_level": level, "beta": 0.04, "epsilon_high": 0.28}}
    config = trl_config(case)
    algorithm = StepSettings.from_config(config, pad_token_id=0, stop_token_id=EOS).algorithm
    hyperparams = Hyperparams.from_config(config)
    batch = update_batch(algorithm, True)
    tokens, value_tokens = jnp.sum(~batch.padding_mask), jnp.sum(~batch.padding_mask_p1)
    new, entropy = _f32(INPUTS["per_token_logps"]), _f32(INPUTS["entropies"])

    def loss(n, rows=slice(None)):
        part = jax.tree.map(lambda x: x[rows], batch)
        return loss_of_outputs(NO_CRITIC, algorithm, hyperparams, n[rows], entropy[rows], jnp.zeros_like(n[rows]),
                               part, tokens, value_tokens, N)[0]

    whole, grad = jax.value_and_grad(loss)(new)
    halves = [jax.value_and_grad(lambda n, s=s: loss(n, s))(new) for s in (slice(0, 6), slice(6, 12))]
    np.testing.assert_allclose(sum(h[0] for h in halves), whole, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(sum(h[1] for h in halves), grad, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("mode", ppo.LOSS_AGG_MODES)
def test_the_ppo_objective_is_ppo_losss_own_clipped_surrogate(mode):
    """loss_type ppo through the objective path (as with an objective option set) gives ppo_loss's own numbers:
    clip-higher, dual clip, the KL term, every aggregation."""
    batch = update_batch(SimpleNamespace(mask_truncated_completions=False), True)
    new, entropy = _f32(INPUTS["per_token_logps"]), _f32(INPUTS["entropies"])
    zeros = jnp.zeros((N, T), jnp.float32)
    options = dict(cliprange=0.2, cliprange_high=0.28, dual_clip_c=1.5, loss_agg_mode=mode)
    params = ppo.ObjectiveParams(cliprange_low=jnp.float32(0.2), cliprange_high=jnp.float32(0.28), dual_clip_c=1.5)

    def loss(n, through_objective):
        term = None
        if through_objective:
            def term(new_logprobs, b, ent):
                return ppo.policy_term("ppo", params, new_logprobs, b.logprobs, b.advantages, b.padding_mask, ent,
                                       loss_agg_mode=mode, policy_tokens=None, rows=N)
        return ppo.ppo_loss(n, zeros, entropy, batch, cliprange_value=0.2, vf_coef=0.0, rows=N, kl_loss_coef=0.1,
                            kl_loss_fn=ppo.kl_estimator("k3").fn, with_value=False, policy_term=term, **options)[0]

    plain, grad = jax.value_and_grad(loss)(new, False)
    objective, objective_grad = jax.value_and_grad(loss)(new, True)
    np.testing.assert_allclose(objective, plain, rtol=1e-7)
    np.testing.assert_allclose(objective_grad, grad, rtol=1e-6, atol=1e-9)
