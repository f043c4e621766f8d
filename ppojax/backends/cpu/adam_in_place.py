"""AdamW's step in one pass over each parameter, in place: a C++ handler through jax.ffi (CPU).

XLA:CPU runs optax's AdamW (`ppojax.rl.optimizer.AdamW`: global-norm clipping, Adam's moments, decoupled weight
decay, then ``p - lr * u``) as three loops over each parameter, the first moment's, the second moment's and the
parameter's, which move 40 bytes per float32 parameter; the handler (`ppojax/backends/cpu/ffi/adam_in_place.cc`) reads
p, g, m, v once and writes p, m, v where they lie (28 bytes), all leaves in one call split over XLA's intra-op threads.
On a CPU the optimizer step is bound by memory traffic, so it takes less time in proportion.

Values: optax's arithmetic operation by operation, each rounded to float32; XLA fuses some multiply-adds, so the
two agree to a few units in the last place. The scalars of the step (the learning rate, the bias corrections, the
gradients' global norm and whether it clips) are computed by optax's own expressions before the call.

Where it runs: `InPlaceAdamStep` is an `AdamW`'s step implementation (`ppojax.rl.optimizer`), chosen when a run is
built (`ppojax.backends.optimizer_step_for`: a single CPU device, as XLA cannot partition a custom call, and the
handler built: Linux x86-64 with `g++`, or built before, `ppojax.backends.cpu.ffi.build`); at trace time it runs
where every parameter and moment is float32 (:meth:`InPlaceAdamStep.applies`), optax's step elsewhere.
"""
from __future__ import annotations

import ctypes
import dataclasses
import functools
import platform
import threading
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

from ppojax.backends.cpu import capabilities
from ppojax.backends.cpu.ffi.build import build_cached

SOURCE = Path(__file__).parent / "ffi" / "adam_in_place.cc"
#: optimised and vectorised (-fno-math-errno lets sqrt vectorise; it changes no value), each operation rounded
FLAGS = ("-O3", "-fno-math-errno", "-ffp-contract=off")
TARGET = "ppojax_adam_in_place"

_lock = threading.Lock()  # a compile_ahead thread and the main thread may both ask first


@functools.cache
def _built() -> tuple[Path | None, str]:
    """(the built handler, "") or (None, why not). Built once per source and jaxlib
    (`ppojax.backends.cpu.ffi.build`)."""
    off = capabilities.backend_off()
    if off:
        return None, off
    cpu = capabilities.probe()
    if platform.system() != "Linux" or not cpu.has("x86_64"):
        return None, f"its handler is built for Linux x86-64 (this is {platform.system()} {platform.machine()})"
    # its vector clones stop at the instruction sets the probe reports (a cap included)
    return build_cached(SOURCE, "ppojax's in-place Adam step", flags=build_flags(cpu))


def build_flags(cpu=None) -> tuple[str, ...]:
    """The compiler flags of the handler on `cpu` (default: the probe's): its vector clones stop at the CPU's
    instruction sets."""
    return FLAGS + capabilities.build_defines(cpu)


@functools.cache
def _registered() -> str:
    """Register the handler with XLA once; "" when done, else why it is unavailable."""
    built, why = _built()
    if built is None:
        return why
    try:
        handler = ctypes.cdll.LoadLibrary(str(built))
    except OSError as err:
        return f"loading {built} failed ({err})"
    jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(handler.AdamInPlace), platform="cpu")
    return ""


def unavailable_reason() -> str:
    """"" when the handler is registered (building it if needed), else why it cannot be."""
    with _lock:
        return _registered()


def adam_state_index(opt_state) -> int | None:
    """The position of `optax.ScaleByAdamState` in an `AdamW`'s chained state, or None."""
    found = [i for i, part in enumerate(opt_state) if isinstance(part, optax.ScaleByAdamState)]
    return found[0] if len(found) == 1 else None


def float32_adam(params, opt_state) -> bool:
    """Whether `opt_state` is an `AdamW`'s chained state whose parameters and moments are all float32 (shapes and
    dtypes only: read at trace time)."""
    index = adam_state_index(opt_state)
    if index is None:
        return False
    adam = opt_state[index]
    leaves = jax.tree.leaves((params, adam.mu, adam.nu))
    return bool(leaves) and all(jnp.dtype(x.dtype) == jnp.float32 for x in leaves)


@dataclasses.dataclass(frozen=True)
class InPlaceAdamStep:
    """AdamW's step by the handler (`ppojax.rl.optimizer.OptaxStep`'s interface). Make it only where the handler
    is registered on a single CPU device (`ppojax.backends.optimizer_step_for` checks)."""

    name: str = dataclasses.field(default="adam_in_place", init=False)

    def applies(self, optimizer, params, opt_state) -> bool:
        return float32_adam(params, opt_state)

    def __call__(self, optimizer, grads, opt_state, params, lr, kept=None, frozen=None, critic_lr=None,
                 critic_leaf=None):
        paths = [path for path, _ in jax.tree_util.tree_leaves_with_path(params)]
        frozen_leaves = None if kept is None else tuple(bool(kept(path)) for path in paths)
        critic_leaves = None if critic_lr is None else tuple(bool(critic_leaf(path)) for path in paths)
        return step(optimizer, grads, opt_state, params, lr, frozen_leaves, frozen, critic_lr, critic_leaves)


def step(optimizer, grads, opt_state, params, lr, frozen_leaves=None, frozen=None, critic_lr=None,
         critic_leaves=None):
    """One AdamW step -> (new params, new opt_state), as ``optimizer.update`` then ``p - lr * u`` give them.

    optimizer: `ppojax.rl.optimizer.AdamW`; grads, params: trees of float32 leaves alike; opt_state: its chained
    state; lr: f32[]. frozen_leaves: a tuple of bools, one per leaf of `params` in tree order, True for a leaf (and its
    moments) kept as it is while `frozen` (a traced bool[]): the policy's during the critic's warm-up. Adam's step
    count advances either way, as optax's does. critic_lr (f32[]) with critic_leaves (a bool per leaf, as
    frozen_leaves): the leaves stepped by ``p - critic_lr * u`` instead. Call only where :func:`float32_adam` and
    the handler is registered."""
    index = adam_state_index(opt_state)
    adam = opt_state[index]
    count = optax.safe_increment(adam.count)
    # optax's expressions (scale_by_adam's bias correction, clip_by_global_norm's norm and test)
    corrections = [(1 - b ** count).astype(jnp.float32) for b in (optimizer.b1, optimizer.b2)]
    if optimizer.max_grad_norm:
        norm = optax.tree.norm(grads)
        clip = ~jnp.squeeze(norm < optimizer.max_grad_norm)
    else:
        norm, clip = jnp.float32(1), jnp.bool_(False)
    lr = jnp.asarray(lr, jnp.float32)
    critic_lr = lr if critic_lr is None else jnp.asarray(critic_lr, jnp.float32)
    scalars = jnp.stack([lr, critic_lr, *corrections, norm.astype(jnp.float32)])
    flags = jnp.stack([clip, jnp.bool_(False) if frozen is None else frozen]).astype(jnp.int32)

    p_leaves, treedef = jax.tree.flatten(params)
    g_leaves, m_leaves, v_leaves = (treedef.flatten_up_to(tree) for tree in (grads, adam.mu, adam.nu))
    operands = [scalars, flags]
    for leaf in zip(p_leaves, g_leaves, m_leaves, v_leaves):
        operands += leaf
    results = [jax.ShapeDtypeStruct(x.shape, jnp.float32) for x in p_leaves for _ in range(3)]
    aliases = {}
    for i in range(len(p_leaves)):  # p, m, v of leaf i are written where they lie
        aliases.update({2 + 4 * i: 3 * i, 4 + 4 * i: 3 * i + 1, 5 + 4 * i: 3 * i + 2})
    kept = frozen_leaves if frozen_leaves is not None else (False,) * len(p_leaves)
    critic = critic_leaves if critic_leaves is not None else (False,) * len(p_leaves)
    out = jax.ffi.ffi_call(TARGET, results, input_output_aliases=aliases, vmap_method="sequential")(
        *operands, b1=np.float32(optimizer.b1), one_minus_b1=np.float32(1 - optimizer.b1),
        b2=np.float32(optimizer.b2), one_minus_b2=np.float32(1 - optimizer.b2), eps=np.float32(optimizer.eps),
        weight_decay=np.float32(optimizer.weight_decay),
        max_norm=np.float32(optimizer.max_grad_norm or 0.0), frozen_leaves=np.asarray(kept, np.int64),
        critic_leaves=np.asarray(critic, np.int64))
    new_params = treedef.unflatten(out[0::3])
    new_adam = adam._replace(count=count, mu=treedef.unflatten(out[1::3]), nu=treedef.unflatten(out[2::3]))
    return new_params, tuple(new_adam if i == index else part for i, part in enumerate(opt_state))
