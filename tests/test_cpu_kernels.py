"""The CPU's kernels (ppojax/backends/cpu/kernels.py), chosen for a run's models on CPU devices: 16-bit products
with float32 accumulation in XLA:CPU's bf16 kernels (forward and backward), and their agreement with the plain
products the models' default (XLA's) kernels compute. The in-place float32 GEMMs: tests/test_stacked_matmul.py;
16-bit slot storage: tests/test_slot_storage.py."""
import re

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ppojax.backends.cpu import kernels as cpu_kernels
from ppojax.models import apply_causal_lm
from ppojax.models.precision import precision_dtypes

from .test_model_policies import LLAMA, all_jaxprs, tiny_llama, token_logprob_loss

CPU = cpu_kernels.CpuKernels()


def test_cpu_16_bit_projections_ask_for_float32_products():
    """XLA:CPU runs a bf16 x bf16 -> bf16 dot as a float32 dot (it converts the operands first) but hands a
    bf16 x bf16 -> f32 dot to its bf16 kernels: on the CPU every forward projection of
    the 16-bit policies asks for a float32 product and rounds it; the rounded product equals the plain bf16
    dot's (both accumulate in float32) to one bfloat16 rounding (the kernels sum in different orders: on an Intel
    AMX host one element in 960 rounded the other way)."""
    ids, mask = jnp.ones((2, 8), jnp.int32), jnp.ones((2, 8), bool)
    for precision in ("mixed", "bfloat16"):
        compute, param = precision_dtypes(precision)
        _, model = tiny_llama(dtype=compute, param_dtype=param, remat="none", kernels=CPU)
        graphdef, params = nnx.split(model)
        jaxpr = jax.make_jaxpr(lambda p: apply_causal_lm(graphdef, p, ids, mask)[0])(params)
        weight_dots = [eqn for body in all_jaxprs(jaxpr) for eqn in body.eqns
                       if eqn.primitive.name == "dot_general" and any(LLAMA["hidden_size"] in v.aval.shape
                                                             for v in eqn.invars)]
        assert len(weight_dots) >= 8, precision  # q k v o up gate down (the scanned body) + logits
        assert {tuple(v.aval.dtype for v in eqn.invars) for eqn in weight_dots} == {(jnp.dtype(compute),) * 2}
        assert {eqn.params["preferred_element_type"] for eqn in weight_dots} == {jnp.dtype(jnp.float32)}, precision
    x = jax.random.normal(jax.random.key(0), (24, 64)).astype(jnp.bfloat16)
    w = jax.random.normal(jax.random.key(1), (64, 40)).astype(jnp.bfloat16)
    got = jax.jit(CPU.matmul)(x, w)
    assert got.dtype == jnp.bfloat16
    plain = np.asarray(jax.jit(jnp.dot)(x, w), np.float32)
    ulp = np.asarray(np.spacing(np.abs(plain).astype(np.float32)), np.float32) * 2.0 ** 16  # bf16: 16 fewer bits
    assert np.all(np.abs(np.asarray(got, np.float32) - plain) <= ulp)
    assert np.mean(np.asarray(got, np.float32) == plain) > 0.99


def compiled_dots(hlo: str) -> list[dict]:
    """Every dot of a compiled program (``compiled.as_text()``): its operand types, contracting dims, whether it
    has batch dims, and the op_name it came from."""
    types, found = {}, []
    for line in hlo.splitlines():
        m = re.match(r"\s*(?:ROOT )?(%\S+) = (\w+\[[^\]]*\])", line)
        if m:
            types[m.group(1)] = m.group(2)
        if m and " dot(" in line:
            operands = re.search(r" dot\(([^)]*)\)", line).group(1).split(", ")
            found.append({"operands": [types.get(o, "?") for o in operands], "batch": "batch_dims" in line,
                          "contracting": re.findall(r"(lhs|rhs)_contracting_dims=\{(\d+)\}", line),
                          "op_name": (re.search(r'op_name="([^"]*)"', line) or [None, ""])[1]})
    return found


def test_cpu_16_bit_backward_products_run_in_bf16_kernels():
    """XLA:CPU's bf16 kernels take a dot only with row-major operands contracted lhs-minor / rhs-major; autodiff's
    backward products of a projection (g @ w.T, x.T @ g) are not, and XLA ran them as float32 dots. In the compiled
    `mixed` gradient every product of the layer scan, forward and backward, multiplies bf16 operands in that
    canonical form (`kernels._matmul_16_bit`)."""
    compute, param = precision_dtypes("mixed")
    graphdef, params = nnx.split(tiny_llama(dtype=compute, param_dtype=param, remat="dots", kernels=CPU)[1])
    ids, mask = jnp.ones((3, 12), jnp.int32), jnp.ones((3, 12), bool)
    grad = jax.jit(jax.grad(lambda p: token_logprob_loss(graphdef, p, ids, mask)))
    # as a user's process compiles it: XLA:CPU takes bf16 dots to its multi-threaded kernels only (the suite's
    # flags run one thread: tests/xla_test_flags.py)
    compiled = grad.lower(params).compile(compiler_options={"xla_cpu_multi_thread_eigen": True})
    dots = [d for d in compiled_dots(compiled.as_text())
            if not d["batch"] and "while/body" in d["op_name"]]  # the layer scan's 2-D products (not attention's)
    backward = [d for d in dots if "transpose(" in d["op_name"]]
    assert len(backward) >= 2 * 7 and len(dots) - len(backward) >= 7, dots  # dx and dw of q k v o up gate down
    for d in dots:
        assert all(t.startswith("bf16[") for t in d["operands"]), d
        assert d["contracting"] == [("lhs", "1"), ("rhs", "0")], d


def test_cpu_16_bit_matmul_gradient_is_autodiffs():
    """The custom VJP's products equal autodiff's of the same float32-accumulated bf16 product (rounded to bf16)."""
    x = jax.random.normal(jax.random.key(0), (24, 64)).astype(jnp.bfloat16)
    w = jax.random.normal(jax.random.key(1), (64, 40)).astype(jnp.bfloat16)
    g = jax.random.normal(jax.random.key(2), (24, 40)).astype(jnp.bfloat16)
    plain = lambda x, w: jnp.dot(x, w, preferred_element_type=jnp.float32).astype(x.dtype)  # noqa: E731
    want = jax.jit(lambda x, w, g: jax.vjp(plain, x, w)[1](g))(x, w, g)
    got = jax.jit(lambda x, w, g: jax.vjp(cpu_kernels._matmul_16_bit, x, w)[1](g))(x, w, g)
    for a, b in zip(got, want, strict=True):
        assert a.dtype == jnp.bfloat16
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=2 ** -7, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(cpu_kernels._matmul_16_bit(x, w), np.float32),
                                  np.asarray(plain(x, w), np.float32))
