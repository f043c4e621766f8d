"""ppojax's optimizer: AdamW without the learning rate (TRL's ``adamw_torch``; optax's transformations), optional
global-norm clipping first, and its step.

`AdamW` is an optax transformation (``init``, ``update``) that also says what it is and carries its step
implementation: an object chosen once when a run is built (the seam to the backends, as the models' `Kernels`):
`OptaxStep`, optax's ``update`` then ``p - lr * u`` (the default, every backend), or a backend's own
(``ppojax.backends.optimizer_step_for``). The learning rate stays outside (the update multiplies by
``learning_rate_at``), so the schedule is a traced function of the update index.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Optional

import jax
import jax.numpy as jnp
import optax



@dataclasses.dataclass(frozen=True)
class OptaxStep:
    """An optimizer step as optax computes it: ``optimizer.update`` then ``p - lr * u`` (a 16-bit parameter stays
    16-bit). Works for any optax transformation.

    The interface of every step implementation (a backend's too; frozen and hashable, it is part of the program):
    ``name``; ``applies(optimizer, params, opt_state) -> bool`` (read at trace time, from shapes and dtypes only:
    where False, :func:`apply` runs optax's step instead); ``__call__(optimizer, grads, opt_state, params, lr,
    kept, frozen, critic_lr, critic_leaf) -> (params, opt_state)``."""

    name: str = dataclasses.field(default="optax", init=False)

    def applies(self, optimizer, params, opt_state) -> bool:
        return True

    def __call__(self, optimizer, grads, opt_state, params, lr, kept=None, frozen=None, critic_lr=None,
                 critic_leaf=None):
        updates, new_opt_state = optimizer.update(grads, opt_state, params)

        def stepped(path, p, u):
            rate = critic_lr if critic_lr is not None and critic_leaf(path) else lr
            return p - (rate * u).astype(p.dtype)
        new_params = jax.tree_util.tree_map_with_path(stepped, params, updates)
        if kept is not None:
            new_params = _keep(kept, frozen, new_params, params)
            new_opt_state = _keep(kept, frozen, new_opt_state, opt_state)
        return new_params, new_opt_state


#: the default step of every optimizer
OPTAX_STEP = OptaxStep()


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
    step: Any = None  # None: `OPTAX_STEP`; else a backend's (`ppojax.backends.optimizer_step_for`)

    def __post_init__(self):
        if self.step is not None and not (callable(self.step) and hasattr(self.step, "applies")):
            raise TypeError(f"step={self.step!r} is not an optimizer step (ppojax.rl.optimizer.OptaxStep or a "
                            f"backend's, ppojax.backends.optimizer_step_for)")

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
                   max_grad_norm=None, step=None) -> AdamW:
    """AdamW WITHOUT the learning rate (the update multiplies by ``learning_rate_at``), so the schedule is
    a traced function of the update index. Optional global-norm clipping first. step: how the step runs (optax's,
    or the backend's chosen when the run is built)."""
    return AdamW(adam_beta1, adam_beta2, adam_epsilon, weight_decay, max_grad_norm, step)


def optimizer_from_config(config, step=None) -> AdamW:
    return make_optimizer(adam_beta1=config.adam_beta1, adam_beta2=config.adam_beta2,
                          adam_epsilon=config.adam_epsilon, weight_decay=config.weight_decay,
                          max_grad_norm=config.max_grad_norm, step=step)


def apply(optimizer, grads, opt_state, params, lr, kept=None, frozen=None, critic_lr=None, critic_leaf=None):
    """One optimizer step -> (new params, new opt_state), by the optimizer's step implementation (`AdamW.step`;
    `OPTAX_STEP` for any other optax transformation).

    kept: a function of a parameter's tree path, True for a leaf (and its moments, which mirror the parameters)
    kept as it is while `frozen` (a traced bool[]): the policy's during the critic's warm-up. Leaves of neither
    (Adam's step count) follow the step. critic_lr (f32[]) with critic_leaf (a function of a parameter's path):
    the learning rate of the leaves critic_leaf names (the critic's own), ``lr`` the rest's."""
    if (critic_lr is None) != (critic_leaf is None):
        raise ValueError("critic_lr and critic_leaf come together (the critic's learning rate and which leaves "
                         "are the critic's)")
    step = (optimizer.step if isinstance(optimizer, AdamW) else None) or OPTAX_STEP
    if not step.applies(optimizer, params, opt_state):
        step = OPTAX_STEP
    return step(optimizer, grads, opt_state, params, lr, kept, frozen, critic_lr, critic_leaf)


def _keep(kept, frozen, new, old):
    """``new`` with every leaf whose path is `kept` replaced by ``old`` while ``frozen``. Works on parameters and on
    optimizer states that mirror them (a moment's path ends with its parameter's)."""
    def pick(path, n, o):
        return jnp.where(frozen, o, n) if kept(path) else n
    return jax.tree_util.tree_map_with_path(pick, new, old)
