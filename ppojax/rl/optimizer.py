"""ppojax's optimizer: AdamW without the learning rate (TRL's ``adamw_torch``; optax's transformations), optional
global-norm clipping first, and its step.

`AdamW` is an optax transformation (``init``, ``update``) that also says what it is, so :func:`apply` can run its
step in one pass over each parameter where it can (`ppojax.backends.cpu.adam_in_place`: float32 on a single CPU device) and
optax's ``update`` then ``p - lr * u`` elsewhere. The learning rate stays outside (the update multiplies by
``learning_rate_at``), so the schedule is a traced function of the update index.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import jax
import jax.numpy as jnp
import optax

from ppojax.backends.cpu import adam_in_place

#: "auto": the step in one pass where `ppojax.backends.cpu.adam_in_place` applies, optax's elsewhere; "optax": always optax's
IMPLEMENTATIONS = ("auto", "optax")


@dataclasses.dataclass(frozen=True)
class AdamW:
    """optax's ``chain(clip_by_global_norm(max_grad_norm), scale_by_adam(b1, b2, eps),
    add_decayed_weights(weight_decay))``, each part only where it does something (no clipping without
    ``max_grad_norm``, no decay at 0), as an optax transformation; its state is that chain's."""
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0
    max_grad_norm: Optional[float] = None
    implementation: str = "auto"

    def __post_init__(self):
        if self.implementation not in IMPLEMENTATIONS:
            raise ValueError(f"optimizer implementation {self.implementation!r} is not one of {IMPLEMENTATIONS}")

    @functools.cached_property
    def transformation(self) -> optax.GradientTransformation:
        parts = [optax.clip_by_global_norm(self.max_grad_norm)] if self.max_grad_norm else []
        parts += [optax.scale_by_adam(b1=self.b1, b2=self.b2, eps=self.eps)]
        if self.weight_decay:
            parts.append(optax.add_decayed_weights(self.weight_decay))
        return optax.chain(*parts)

    def init(self, params):
        return self.transformation.init(params)

    def update(self, updates, state, params=None):
        return self.transformation.update(updates, state, params)


def make_optimizer(*, adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, weight_decay=0.0,
                   max_grad_norm=None, implementation="auto") -> AdamW:
    """AdamW WITHOUT the learning rate (the update multiplies by ``learning_rate_at``), so the schedule is
    a traced function of the update index. Optional global-norm clipping first."""
    return AdamW(adam_beta1, adam_beta2, adam_epsilon, weight_decay, max_grad_norm, implementation)


def optimizer_from_config(config) -> AdamW:
    return make_optimizer(adam_beta1=config.adam_beta1, adam_beta2=config.adam_beta2,
                          adam_epsilon=config.adam_epsilon, weight_decay=config.weight_decay,
                          max_grad_norm=config.max_grad_norm, implementation=config.optimizer_implementation)


def in_place(optimizer, params, opt_state) -> bool:
    """Whether :func:`apply` runs `optimizer`'s step on these in one pass (`ppojax.backends.cpu.adam_in_place`)."""
    return (isinstance(optimizer, AdamW) and optimizer.implementation == "auto"
            and adam_in_place.applies(params, opt_state))


def apply(optimizer, grads, opt_state, params, lr, kept=None, frozen=None):
    """One optimizer step -> (new params, new opt_state): ``optimizer.update`` then ``p - lr * u`` (a 16-bit
    parameter stays 16-bit), in one pass where :func:`in_place`. optimizer: any optax transformation.

    kept: a function of a parameter's tree path, True for a leaf (and its moments, which mirror the parameters)
    kept as it is while `frozen` (a traced bool[]): the policy's during the critic's warm-up. Leaves of neither
    (Adam's step count) follow the step."""
    if in_place(optimizer, params, opt_state):
        frozen_leaves = None if kept is None else \
            tuple(bool(kept(path)) for path, _ in jax.tree_util.tree_leaves_with_path(params))
        return adam_in_place.step(optimizer, grads, opt_state, params, lr, frozen_leaves, frozen)
    updates, new_opt_state = optimizer.update(grads, opt_state, params)
    new_params = jax.tree.map(lambda p, u: p - (lr * u).astype(p.dtype), params, updates)
    if kept is not None:
        new_params = _keep(kept, frozen, new_params, params)
        new_opt_state = _keep(kept, frozen, new_opt_state, opt_state)
    return new_params, new_opt_state


def _keep(kept, frozen, new, old):
    """``new`` with every leaf whose path is `kept` replaced by ``old`` while ``frozen``. Works on parameters and on
    optimizer states that mirror them (a moment's path ends with its parameter's)."""
    def pick(path, n, o):
        return jnp.where(frozen, o, n) if kept(path) else n
    return jax.tree_util.tree_map_with_path(pick, new, old)
