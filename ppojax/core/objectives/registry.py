"""The policy objectives' registry and the values every objective reads and returns.

An objective turns one micro-batch's current and behaviour log-probs and advantages into per-token policy losses
(before aggregation) and its diagnostics. What is common to all of them happens around it
(``ppojax.core.objectives.term``): the importance weights at the configured level, the high-entropy token
selection, the aggregation into one number and the KL term.
"""
from typing import Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp

IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")
#: How an objective takes the off-policy behaviour weights (``ppojax.core.offpolicy``): 'weighted', its per-token
#: loss is multiplied by them (``policy_term``); 'folded', it reads ``ObjectiveInputs.behaviour_weights`` itself
#: (token-level weights only); 'unsupported', the off-policy corrections are refused with it.
OFF_POLICY_KINDS = ("weighted", "folded", "unsupported")


class ObjectiveInputs(NamedTuple):
    """What an objective reads, for B rows of R response tokens (one micro-batch).

    logprobs:     f32[B, R] the current policy's log-probs (INVALID_LOGPROB on padding; gradients flow here).
    old_logprobs: f32[B, R] the ratio's denominator, pi_old (the proximal policy's under an off-policy
                  correction; INVALID_LOGPROB on padding).
    advantages:   f32[B, R] 0 on padding.
    live:         bool[B, R] the tokens in the loss.
    selected:     bool[B, R] the live tokens that train (``top_entropy_quantile``; ``live`` when it is 1).
    log_weights:  f32[B, R] log importance weights at ``importance_sampling_level``: per token ``logprobs -
                  old_logprobs``; per sequence each row's mean of that over its live tokens, on every slot of
                  the row (GSPO).
    sequence_level: whether ``log_weights`` is per sequence (a Python bool).
    behaviour_weights: f32[B, R] the off-policy behaviour weights sg(pi_prox / pi_behav) (``ppojax.core.offpolicy``),
                  given to an objective registered with ``off_policy='folded'`` (None: no correction, or the
                  term multiplies the objective's loss by them).
    """

    logprobs: jax.Array
    old_logprobs: jax.Array
    advantages: jax.Array
    live: jax.Array
    selected: jax.Array
    log_weights: jax.Array
    sequence_level: bool = False
    behaviour_weights: Optional[jax.Array] = None


class ObjectiveParams(NamedTuple):
    """The objectives' hyperparameters. cliprange_low / cliprange_high: traced f32 scalars (``Hyperparams``);
    the rest static floats (None: off)."""

    cliprange_low: jax.Array
    cliprange_high: jax.Array
    dual_clip_c: Optional[float] = None
    sapo_temperature_pos: float = 1.0
    sapo_temperature_neg: float = 1.05
    vespo_k_pos: float = 2.0
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0


class ObjectiveTerms(NamedTuple):
    """An objective's result.

    per_token: f32[B, R] policy loss per token, the token selection applied, to be aggregated over live tokens.
    clipped:   bool[B, R] tokens whose gradient the objective clipped (``pg_clipfrac``).
    kl_weight: f32[B, R] the importance weight ``use_bias_correction_kl`` multiplies the KL term by, or None
               when the objective takes no such correction.
    metrics:   {TRL's metric name: f32[]} the objective's own diagnostics.
    """

    per_token: jax.Array
    clipped: jax.Array
    kl_weight: Optional[jax.Array]
    metrics: dict


class PolicyObjective(NamedTuple):
    """A registered objective.

    fn: (ObjectiveInputs, ObjectiveParams) -> ObjectiveTerms.
    aggregation: the ``loss_agg_mode`` its losses are averaged by (None: the config's ``loss_agg_mode``).
    levels: the importance-sampling levels it takes (``importance_sampling_level``), and ``level_reason``: why
        not the others, said when a config asks for one.
    sequence_advantages: it reads one advantage per sequence (an estimator whose advantages vary along a
        response cannot feed it).
    options: the config fields only it reads (refused with another objective when set).
    off_policy: how it takes the off-policy behaviour weights, one of ``OFF_POLICY_KINDS``.
    """

    name: str
    fn: Callable
    aggregation: Optional[str]
    levels: tuple = IMPORTANCE_SAMPLING_LEVELS
    level_reason: str = ""
    sequence_advantages: bool = False
    options: tuple = ()
    off_policy: str = "weighted"


_REGISTRY: dict[str, PolicyObjective] = {}


def register_policy_objective(name: str, *, aggregation: Optional[str], levels: tuple = IMPORTANCE_SAMPLING_LEVELS,
                              level_reason: str = "", sequence_advantages: bool = False, options: tuple = (),
                              off_policy: str = "weighted"):
    """Decorator: make ``fn(inputs: ObjectiveInputs, params: ObjectiveParams) -> ObjectiveTerms`` available as
    ``loss_type: name`` (see :class:`PolicyObjective` for the traits)."""
    if off_policy not in OFF_POLICY_KINDS:
        raise ValueError(f"off_policy={off_policy!r}: expected one of {OFF_POLICY_KINDS}")

    def register(fn):
        _REGISTRY[name] = PolicyObjective(name, fn, aggregation, tuple(levels), level_reason, sequence_advantages,
                                          tuple(options), off_policy)
        return fn
    return register


def policy_objective(name: str) -> PolicyObjective:
    if name not in _REGISTRY:
        raise ValueError(f"loss_type={name!r}: expected one of {policy_objective_names()}.")
    return _REGISTRY[name]


def policy_objective_names() -> tuple[str, ...]:
    return tuple(_REGISTRY)


# --------------------------------------------------------------------------------------------------
# Means as TRL's GRPOTrainer logs them
# --------------------------------------------------------------------------------------------------
def logged_mean(values, inputs: ObjectiveInputs):
    """TRL's ``global_masked_mean`` of f32/bool[B, R]: over live tokens, or over rows (every row counts) when the
    values are per sequence."""
    values = values.astype(jnp.float32)
    if inputs.sequence_level:
        return jnp.mean(values[:, 0])
    return jnp.sum(jnp.where(inputs.live, values, 0.0)) / jnp.maximum(jnp.sum(inputs.live), 1)


def row_means(values, inputs: ObjectiveInputs):
    """TRL's ``masked_seq_mean``: each row's mean over its live tokens (NaN for a row without any), or the row's
    value when per sequence. f32/bool[B, R] -> f32[B]."""
    values = values.astype(jnp.float32)
    if inputs.sequence_level:
        return values[:, 0]
    return jnp.sum(jnp.where(inputs.live, values, 0.0), axis=-1) / jnp.sum(inputs.live, axis=-1)


def sequence_advantages(inputs: ObjectiveInputs):
    """f32[B]: each row's advantage, read at its first token (a row's live tokens start at 0, and the estimators
    these objectives take put one advantage on every live token); 0 for a row without live tokens."""
    return jnp.where(inputs.live[:, 0], inputs.advantages[:, 0], 0.0)
