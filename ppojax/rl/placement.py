"""The RL program's objects placed on a mesh by the rule tables of `ppojax.parallel.rules`: the TrainState
created directly in its shardings, the sampler's KV cache constrained to its shardings."""
from __future__ import annotations

from typing import Any, Mapping

import jax
from jax.sharding import Mesh

from ppojax.models import init_cache
from ppojax import parallel
from ppojax.rl.types import init_train_state


def init_sharded_train_state(params, optimizer, mesh: Mesh, rules: Mapping[str, Any] = parallel.TRAIN_RULES, *,
                             hyperparams, frozen=None, kl_coef=0.05, logical_axes=None, donate: bool = False,
                             in_flight=None):
    """``ppojax.rl.types.init_train_state`` with params, frozen models and optimizer state created directly in
    their shardings (the optimizer state is never materialised whole on one device).

    donate: the caller hands ``params`` and ``frozen`` over: the state holds their very buffers (once sharded),
    so building it never holds the weights twice; the caller's arrays are deleted. Without it the state holds
    copies (the state is donated at every step, so it may not share the caller's buffers). in_flight: an
    asynchronous run's queue shapes (``init_train_state``'s).
    -> (state, state_shardings)."""
    init = lambda p, f: init_train_state(p, optimizer, hyperparams=hyperparams, frozen=f, kl_coef=kl_coef,  # noqa: E731
                                         in_flight=in_flight)
    shardings = parallel.train_state_shardings(jax.eval_shape(init, params, frozen), mesh, rules,
                                               logical_axes=logical_axes)
    params = parallel.shard_params(params, mesh, rules, logical_axes=logical_axes)
    frozen = None if frozen is None else parallel.shard_params(frozen, mesh, rules)
    if donate:
        params, frozen = parallel.each_buffer_once((params, frozen))
    state = jax.jit(init, out_shardings=shardings, donate_argnums=(0, 1) if donate else ())(params, frozen)
    return state, shardings


def make_init_cache_fn(mesh: Mesh, rules: Mapping[str, Any] = parallel.GENERATE_RULES):
    """An ``init_cache_fn`` for ``ppojax.rl.sampler.generate`` whose cache is constrained to
    :func:`ppojax.parallel.rules.kv_cache_shardings` (inside jit: ``with_sharding_constraint``)."""

    def init_cache_fn(model, batch_size, max_length, dtype):
        cache = init_cache(model.cfg, batch_size, max_length, dtype, model.kernels)
        return jax.lax.with_sharding_constraint(cache, parallel.kv_cache_shardings(cache, mesh, rules))

    return init_cache_fn
