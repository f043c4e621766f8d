"""The CPU's `Kernels` (`ppojax.models.kernels`): what XLA:CPU does worse than it could, done another way.

- 16-bit products ask XLA for a float32 result rounded to the compute dtype: XLA:CPU runs a bf16 x bf16 -> f32 dot
  in YNNPACK's bf16 kernels (the CPU's bf16 units) but a bf16 -> bf16 dot as a float32 dot after converting its
  operands. Both accumulate in float32; only the summation order differs. The backward's
  two products run in the bf16 kernels too (`_matmul_16_bit`'s custom VJP). The rounded product is what
  `remat: dots` saves, as its uint16 bits (`slot_storage.saved_as_bits`).
- 16-bit values written or read slot by slot travel as uint16 bits (`stores_bits`; `slot_storage` says why): the
  KV cache, the weight stacks a forward with a cache reads, the residual stream the layer scan carries.
- The update's finiteness check is a matrix-vector product per gradient (`all_finite`) and the sampler's argmax
  two plain reductions (`argmax`): XLA:CPU's forms of both are slow loops.
- float32 projections on one CPU device read their layer's kernel where it lies in the stacked weights, through
  the in-place GEMM handlers (`stacked_matmul`), instead of XLA's per-layer copy then dot; the LM head's product
  too, at an update's rows.

`CpuKernels.for_shapes` makes every choice when a run is built (it builds the handlers and, for "auto", reads or
measures this CPU's fastest GEMM library per projection shape); tracing only looks the choices up.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional

import jax
import jax.numpy as jnp
from jax.experimental.layout import Layout, with_layout_constraint

from ppojax.backends.cpu import matmul_tuning, stacked_matmul
from ppojax.backends.cpu import slot_storage
from ppojax.models.kernels import LAYER_PROJECTIONS, Kernels

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class CpuKernels(Kernels):
    """implementation: the models' `matmul_implementation` ("auto", "xla", or a GEMM library's name).
    libraries: ((d_in, d_out), Libraries) for each projection shape the in-place handlers multiply (empty: XLA's
    dots for float32 projections). few_rows: the most rows the handlers' few-rows kernels take (a decode step's).
    bits: whether 16-bit values stored slot by slot travel as their bits (off only to measure what that saves)."""

    implementation: str = "xla"
    libraries: tuple = ()
    few_rows: int = 0
    bits: bool = True
    name: str = dataclasses.field(default="cpu", init=False)
    # no lane tiles to fill, and a decode step's attention costs about in proportion to the slots it reads
    slot_alignment: int = dataclasses.field(default=32, init=False)

    @classmethod
    def for_shapes(cls, implementation: str, groups, device_count: int) -> "CpuKernels":
        """The choices for models whose weights have the shapes `groups` (per backbone a layer's projection shapes
        (d_in, d_out); per LM head its weight's shape), on `device_count` CPU devices. Builds the handlers and, for
        "auto", measures the libraries where this CPU has no record, for the groups large enough to gain
        (`AUTO_MIN_LAYER_ELEMENTS`); a library named that cannot run raises `ValueError` naming why."""
        stacked_matmul.check_implementation(implementation)
        if implementation == "auto":
            groups = [g for g in groups if sum(a * b for a, b in g) >= stacked_matmul.AUTO_MIN_LAYER_ELEMENTS]
        shapes = tuple(dict.fromkeys(tuple(map(int, s)) for group in groups for s in group))
        if implementation == "xla" or not shapes:
            return cls(implementation)
        why = matmul_tuning.unavailable_on(device_count, implementation, shapes)
        if why:
            if implementation != "auto":
                raise ValueError(f"matmul_implementation={implementation!r} cannot be used here: {why}; use 'auto' "
                                 f"or 'xla'")
            return cls(implementation)
        chosen = matmul_tuning.library_of(implementation, shapes)
        few = min(stacked_matmul.few_rows_limit(libraries.fwd) for libraries in chosen.values())
        return cls(implementation, tuple(chosen.items()), few)

    # ------------------------------------------------------------------------------------------ 16-bit values

    def stores_bits(self, dtype) -> bool:
        return self.bits and _is_16_bit(dtype)

    def slot_dtype(self, dtype):
        return slot_storage.BITS if self.stores_bits(dtype) else jnp.dtype(dtype)

    def to_slots(self, x: Array, dtype) -> Array:
        x = x.astype(dtype)
        return slot_storage.to_bits(x) if self.stores_bits(dtype) else x

    def from_slots(self, stored: Array, dtype) -> Array:
        return slot_storage.from_bits(stored, dtype) if stored.dtype == slot_storage.BITS else stored.astype(dtype)

    def read_only_layers(self, layers):
        # generation reads every layer's weights once per token: a 16-bit stack is sliced as its bits
        return slot_storage.sliced_as_bits(layers, self.stores_bits)

    def residual_carry(self, dtype):
        # the layer scan saves each layer's input for the backward, stacked over the layers: a 16-bit stream
        # travels as float32 holding exactly its 16-bit values (an integer carry would stop the gradient)
        return slot_storage.float32_holding if self.stores_bits(dtype) else super().residual_carry(dtype)

    def all_finite(self, tree) -> Array:
        return all_finite_by_dots(tree)

    def argmax(self, x: Array) -> Array:
        return first_argmax(x)

    def matmul(self, x: Array, w: Array) -> Array:
        if not _is_16_bit(x.dtype):
            return jnp.dot(x, w)
        y = _matmul_16_bit(x, w.astype(x.dtype))
        return slot_storage.saved_as_bits(y) if self.stores_bits(y.dtype) else y

    def output_projection(self, o: Array, kernel: Array) -> Array:
        if not _is_16_bit(o.dtype):
            return jnp.einsum("bshk,hkd->bsd", o, kernel)
        w2 = kernel.reshape(-1, kernel.shape[-1])
        return self.matmul(o.reshape(-1, w2.shape[0]), w2).reshape(*o.shape[:2], w2.shape[1])

    def dots_policy(self):
        return jax.checkpoint_policies.save_from_both_policies(
            _dot_saved_whole,
            jax.checkpoint_policies.save_only_these_names(slot_storage.SAVED_BITS, stacked_matmul.SAVED_NAME))

    # ----------------------------------------------------------------------------- in-place float32 products

    def _in_place(self, kernels, rows: int, dtype) -> bool:
        """Whether the handlers multiply these stacked kernels ([L, d_in, d_out] shapes) for calls of `rows` rows.
        Only float32 (XLA's bf16 kernels serve the 16-bit policies): a library named for a 16-bit model raises."""
        if not self.libraries:
            return False
        if jnp.dtype(dtype) != jnp.float32 or any(jnp.dtype(k.dtype) != jnp.float32 for k in kernels):
            if self.implementation != "auto":
                raise ValueError(f"matmul_implementation={self.implementation!r} cannot be used here: it runs float32 "
                                 f"models on a single CPU device only; use 'auto' or 'xla'")
            return False
        table = dict(self.libraries)
        if any(shape not in table for shape in stacked_matmul.kernel_shapes(kernels)):
            return False
        if self.implementation != "auto":
            return True
        if sum(k.size // k.shape[0] for k in kernels) < stacked_matmul.AUTO_MIN_LAYER_ELEMENTS:
            return False
        return rows >= stacked_matmul.AUTO_MIN_ROWS or rows <= self.few_rows  # a decode step's: its own kernels

    def split_layer_kernels(self, layers: dict, rows: int, dtype) -> tuple[dict, Any]:
        stacks = _layer_stacks(layers)
        if not stacks or not self._in_place([stack for stack, _ in stacks.values()], rows, dtype):
            return layers, None
        table = dict(self.libraries)
        layers = jax.tree.map(lambda a: a, layers)  # a fresh nesting of dicts, the leaves shared
        for group, name in stacks:
            del layers[group][name]["kernel"]
        return layers, {key: (stack, out_shape, table[tuple(stack.shape[1:])])
                        for key, (stack, out_shape) in stacks.items()}

    def layer_products(self, split: Any, layer_idx: Array) -> dict:
        if split is None:
            return {}

        def product(stack, out_shape, library):
            return lambda x2: stacked_matmul.matmul(x2, stack, layer_idx, library).reshape(x2.shape[0], *out_shape)

        return {key: product(*entry) for key, entry in split.items()}

    def head_logits(self, hidden: Array, weight: Array, tied: bool) -> Optional[Array]:
        # a decode step's few rows keep XLA's dot: the few-row kernels do not read a weight transposed
        rows = math.prod(hidden.shape[:-1])
        as_stack = jax.ShapeDtypeStruct((1, *weight.shape), weight.dtype)
        if rows < stacked_matmul.AUTO_MIN_ROWS or not self._in_place([as_stack], rows, hidden.dtype):
            return None
        libraries = dict(self.libraries)[tuple(weight.shape)]
        product = stacked_matmul.matmul_transposed if tied else stacked_matmul.matmul
        x = hidden.reshape(rows, hidden.shape[-1]).astype(jnp.float32)
        return product(x, weight[None], jnp.int32(0), libraries).reshape(*hidden.shape[:-1], -1)


def all_finite_by_dots(tree) -> Array:
    """bool[]: True when no floating leaf of ``tree`` holds an inf or a NaN.

    Each leaf ``x`` is multiplied by a zero vector as a matrix-vector product (``x [N, last] @ 0 [last]``):
    ``x * 0`` is NaN exactly where ``x`` is inf or NaN and 0 elsewhere, so the sum of the products is finite
    iff the leaf is, and no overflow of large finite values can trip it. Why not ``jnp.isfinite(x).all()``:
    XLA:CPU writes that as a parameter-sized bool array reduced in a tree of windows, a pass several times slower
    than the dot, which reads each gradient once at memory speed.
    """
    checks = []
    for x in jax.tree.leaves(tree):
        if not jnp.issubdtype(x.dtype, jnp.inexact) or x.size == 0:
            continue
        rows = x.reshape(-1, x.shape[-1]) if x.ndim else x.reshape(1, 1)
        zeros = jnp.zeros((rows.shape[-1],), x.dtype)
        checks.append(jnp.sum(jnp.dot(rows, zeros, preferred_element_type=jnp.float32)))
    return jnp.isfinite(sum(checks)) if checks else jnp.bool_(True)


def first_argmax(x: Array) -> Array:
    """x: f[..., V] -> i32[...]: the index of the first largest value along the last axis, as ``jnp.argmax``
    gives it (ties go to the lowest index; a NaN counts as the largest).

    Two plain reductions (the maximum, then the lowest index holding it) instead of ``jnp.argmax``'s one
    (value, index) reduction, which XLA:CPU runs as a slow scalar loop: over a vocabulary that loop cost
    more than the rest of a categorical draw."""
    return _first_index_of_top(x, jnp.max(x, axis=-1, keepdims=True))


def _first_index_of_top(x: Array, top: Array) -> Array:
    """x: f[..., V], top: f[..., 1] (x's maximum along the last axis) -> i32[...]: the first index holding
    ``top`` (or the first NaN), always inside ``[0, V)``.

    XLA may compute an element-wise ``x`` twice, once into the maximum and once into the comparison here,
    and the two copies need not round alike (seen on the CPU at ``--xla_backend_optimization_level=0``): a
    row then holds no ``top``. Such rows take jnp.argmax's single reduction, which cannot disagree with
    itself; that branch runs only when a row missed."""
    vocab = x.shape[-1]
    nan = jnp.isnan(x)  # XLA:CPU's max may skip a NaN: NaN rows are told apart
    hit = jnp.where(jnp.any(nan, axis=-1, keepdims=True), nan, x == top)
    iota = jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
    index = jnp.min(jnp.where(hit, iota, vocab), axis=-1)
    return jax.lax.cond(jnp.any(index == vocab), _argmax_where_missed, lambda x, index: index, x, index)


def _argmax_where_missed(x: Array, index: Array) -> Array:
    """x: f[..., V], index: i32[...] -> i32[...]: ``jnp.argmax(x)`` where ``index == V``, else ``index``."""
    return jnp.where(index == x.shape[-1], jnp.argmax(x, axis=-1).astype(jnp.int32), index)


def _layer_stacks(layers: dict) -> dict:
    """{(group, projection): (kernel as a 3-D stack [L, in, prod(out)] (a reshape, no copy), its output shape)}."""
    found = {}
    for (group, name), n_in in LAYER_PROJECTIONS.items():
        d = layers.get(group, {}).get(name)
        if d is not None and "kernel" in d:
            kernel = d["kernel"]
            shape = kernel.shape[1:]
            stack = kernel.reshape(kernel.shape[0], math.prod(shape[:n_in]), math.prod(shape[n_in:]))
            found[(group, name)] = (stack, shape[n_in:])
    return found


def projection_shapes(layers: dict) -> list:
    """The (d_in, d_out) of each projection kernel in a backbone's stacked layer weights (arrays or shapes)."""
    shapes = []
    for (group, name), n_in in LAYER_PROJECTIONS.items():
        d = layers.get(group, {}).get(name)
        if d is not None and "kernel" in d:
            shape = d["kernel"].shape[1:]
            shapes.append((math.prod(shape[:n_in]), math.prod(shape[n_in:])))
    return shapes


def _is_16_bit(dtype) -> bool:
    dtype = jnp.dtype(dtype)
    return jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize == 2


def _dot_saved_whole(prim, *avals, **params) -> bool:
    """A dot without batch dimensions, unless its 16-bit operands ask for a float32 product (the projections of
    `_matmul_16_bit`, whose rounded output is saved as bits instead)."""
    if not jax.checkpoint_policies.dots_with_no_batch_dims_saveable(prim, *avals, **params):
        return False
    float32_of_16_bit = (params.get("preferred_element_type") == jnp.float32
                         and all(_is_16_bit(a.dtype) for a in avals[:2]))
    return not float32_of_16_bit


@jax.custom_vjp
def _matmul_16_bit(x: Array, w: Array) -> Array:
    """x [N, D] @ w [D, F] -> [N, F], 16-bit operands and result, float32 accumulation.

    The custom VJP exists for the backward's layouts: XLA:CPU's bf16 kernels take a dot only with row-major
    operands contracted lhs-minor / rhs-major, and autodiff's two products (`g @ w.T`, `x.T @ g`) contract a
    minor axis of w and a major axis of x, so XLA would convert them to float32 dots. Here each operand that needs
    it is transposed physically (a layout constraint), a pass over a weight or an activation, and both products
    run in the bf16 kernels. The values are autodiff's: float32 products rounded to the operands' dtype."""
    return jnp.dot(x, w, preferred_element_type=jnp.float32).astype(x.dtype)


def _matmul_16_bit_fwd(x, w):
    return _matmul_16_bit(x, w), (x, w)


def _matmul_16_bit_bwd(residuals, g):
    x, w = residuals
    g = g.astype(x.dtype)
    dx = jnp.dot(g, _row_major_transpose(w), preferred_element_type=jnp.float32).astype(x.dtype)
    dw = jnp.dot(_row_major_transpose(x), g, preferred_element_type=jnp.float32).astype(w.dtype)
    return dx, dw


_matmul_16_bit.defvjp(_matmul_16_bit_fwd, _matmul_16_bit_bwd)


def _row_major_transpose(a: Array) -> Array:
    """a [M, K] -> a.T [K, M] stored row-major (without the constraint XLA folds a transpose into the consumer's
    operand layout, which is what its bf16 kernels refuse)."""
    return with_layout_constraint(a.T, Layout(major_to_minor=(0, 1)))
