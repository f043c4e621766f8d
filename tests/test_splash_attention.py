"""TPUs' attention for forwards without a KV cache, JAX's splash kernel (`ppojax.backends.tpu.splash_attention`), run
in Pallas's interpreter on the CPU: equal to XLA's attention (`xla_attention`) and the float64 formula at every real
query, gradients included, on left padding, a hole, two packed sequences in a row, GQA and a sliding window; inside
a model (`TpuKernels`) the forwards and gradients XLA's attention gives, also under a sweep's vmap, and XLA's
attention wherever the kernel does not fit. Its compile for a TPU chip is tests/test_tpu_compile.py's, its run per
shard of a mesh tests/test_sharding.py's."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ppojax.backends.tpu.kernels import TpuKernels
from ppojax.backends.tpu.splash_attention import blocks_computed, fits, splash_attention
from ppojax.models import XLA, CausalLM, ModelConfig
from ppojax.models.attention import xla_attention
from tests.test_attention import reference_attention

B, S, H, K, HD = 2, 256, 4, 2, 32


def case(dtype, window=None, seed=0):
    """(q, k, v, segments, mask, real): row 0 left padded by 37 with a hole at 100, row 1 two packed sequences
    (0-149, 150-255); `mask` the model's bool[B, S, S], `real` bool[B, S] the real tokens."""
    rng = np.random.default_rng(seed)
    q, k, v = (jnp.asarray(rng.normal(size=(B, S, n, HD)), dtype) for n in (H, K, K))
    real = np.ones((B, S), bool)
    real[0, :37] = False
    real[0, 100] = False
    seq = np.zeros((B, S), np.int32)
    seq[1, 150:] = 1
    mask = np.tril(np.ones((S, S), bool))[None] & real[:, None, :] & (seq[:, :, None] == seq[:, None, :])
    if window is not None:
        mask &= ~np.tril(np.ones((S, S), bool), -window)[None]
    return q, k, v, jnp.asarray(np.where(real, seq, -1)), jnp.asarray(mask), real


def run_splash(q, k, v, segments, window=None):
    return splash_attention(q, k, v, segments, scale=HD ** -0.5, block=fits(q.shape, k.shape), window=window,
                            interpret=True)


@pytest.mark.parametrize("window", [None, 20])
@pytest.mark.parametrize("dtype,atol", [(jnp.float32, 1e-5), (jnp.bfloat16, 3e-2)])
def test_the_kernel_equals_xla_attention_and_the_formula(window, dtype, atol):
    q, k, v, segments, mask, real = case(dtype, window)
    got = jax.jit(run_splash, static_argnums=4)(q, k, v, segments, window)
    assert got.shape == q.shape and got.dtype == q.dtype
    want = xla_attention(q, k, v, mask, scale=HD ** -0.5)
    np.testing.assert_allclose(np.asarray(got, np.float32)[real], np.asarray(want, np.float32)[real], atol=atol)
    formula = reference_attention(*(np.asarray(x, np.float32) for x in (q, k, v)), np.asarray(mask), HD ** -0.5)
    np.testing.assert_allclose(np.asarray(got, np.float32)[real], formula[real], atol=atol)
    # the packed row's second sequence does not see its first: unpacked, its outputs differ
    one_sequence = segments.at[1].set(0)
    unpacked = np.asarray(jax.jit(run_splash, static_argnums=4)(q, k, v, one_sequence, window), np.float32)
    assert not np.allclose(unpacked[1, 150:], np.asarray(got, np.float32)[1, 150:], atol=10 * atol)


def test_its_gradients_equal_xla_attentions():
    """Gradients of q, k and v of a loss over the real queries, within 1e-5 of XLA's (values of order 10)."""
    q, k, v, segments, mask, real = case(jnp.float32)
    weights = jnp.asarray(np.random.default_rng(1).normal(size=(B, S, H, HD)), jnp.float32) * real[:, :, None, None]

    def loss(attend):
        return lambda q, k, v: jnp.sum(attend(q, k, v) * weights)

    got = jax.jit(jax.grad(loss(lambda q, k, v: run_splash(q, k, v, segments)), argnums=(0, 1, 2)))(q, k, v)
    want = jax.grad(loss(lambda q, k, v: xla_attention(q, k, v, mask, scale=HD ** -0.5)), argnums=(0, 1, 2))(q, k, v)
    for name, a, b in zip("qkv", got, want):
        assert float(jnp.max(jnp.abs(b))) > 1, name
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, err_msg=name)


def packed_rows(length=512, starts=((0,), (0, 300), (0, 128, 256, 384))):
    """(q, k, v, segments, mask, real) of rows of `length` tokens packed with sequences starting at `starts` (one row
    each), the last 20 tokens of each row empty (-1)."""
    rng = np.random.default_rng(7)
    rows = len(starts)
    q, k, v = (jnp.asarray(rng.normal(size=(rows, length, n, HD)), jnp.float32) for n in (H, K, K))
    seq = np.zeros((rows, length), np.int32)
    for row, row_starts in enumerate(starts):
        for i, start in enumerate(row_starts):
            seq[row, start:] = i
    real = np.ones((rows, length), bool)
    real[:, -20:] = False
    mask = np.tril(np.ones((length, length), bool))[None] & real[:, None, :] & (seq[:, :, None] == seq[:, None, :])
    return q, k, v, jnp.asarray(np.where(real, seq, -1)), jnp.asarray(mask), real


def test_rows_packed_longer_skip_the_blocks_of_other_sequences():
    """`skip_other_sequences` (TpuKernels' choice for rows packed longer than a padded row): rows of 512 tokens in
    blocks of 128 holding one, two (0-299, 300-491) and four sequences: values and gradients of q, k and v within
    1e-5 of XLA's attention at the real queries, through TpuKernels; of the 10 block pairs the causal kernel
    computes per row, 10, 8 and 4 (a plain count of the pairs where a query sees a key of its own sequence)."""
    q, k, v, segments, mask, real = packed_rows()
    weights = jnp.asarray(np.random.default_rng(1).normal(size=q.shape), jnp.float32) * real[:, :, None, None]
    skipping = TpuKernels(interpret=True, skip_other_sequences=True)

    def attend(q, k, v):
        return splash_attention(q, k, v, segments, scale=HD ** -0.5, block=128, skip_other_sequences=True,
                                interpret=True)

    got = jax.jit(attend)(q, k, v)

    def reference(q, k, v):
        return xla_attention(q, k, v, mask, scale=HD ** -0.5)

    want = jax.jit(reference)(q, k, v)  # compiled whole (eagerly each operation would compile on its own)
    np.testing.assert_allclose(np.asarray(got)[real], np.asarray(want)[real], atol=1e-5)
    through_kernels = jax.jit(lambda q, k, v: skipping.attention(q, k, v, mask, scale=HD ** -0.5,
                                                                 segments=segments))(q, k, v)
    np.testing.assert_allclose(np.asarray(through_kernels)[real], np.asarray(want)[real], atol=1e-5)

    def loss(attention):
        return lambda q, k, v: jnp.sum(attention(q, k, v) * weights)

    got_grads = jax.jit(jax.grad(loss(attend), argnums=(0, 1, 2)))(q, k, v)
    want_grads = jax.jit(jax.grad(loss(reference), argnums=(0, 1, 2)))(q, k, v)
    for name, a, b in zip("qkv", got_grads, want_grads):
        assert float(jnp.max(jnp.abs(b))) > 1, name
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, err_msg=name)

    seen = np.asarray(mask).reshape(3, 4, 128, 4, 128).any(axis=(2, 4))
    seen |= np.eye(4, dtype=bool)  # the empty tail's queries see each other (segment -1)
    assert [int(n) for n in seen.sum(axis=(1, 2))] == [10, 8, 4]
    np.testing.assert_array_equal(blocks_computed(segments, 128), [10, 8, 4])


def test_the_calls_it_takes():
    """Rows of a multiple of 128 tokens, queries over keys of the same length, the largest block that divides."""
    assert fits((2, 1024, 8, 64), (2, 1024, 2, 64)) == 512
    assert fits((2, 384, 8, 64), (2, 384, 2, 64)) == 128
    assert fits((2, 768, 8, 64), (2, 768, 8, 64)) == 256
    assert fits((2, 200, 8, 64), (2, 200, 2, 64)) is None  # no block divides: XLA's
    assert fits((2, 1, 8, 64), (2, 512, 2, 64)) is None  # a query over a cache: XLA's or the decode kernel


CONFIG = dict(model_type="llama", vocab_size=64, hidden_size=96, intermediate_size=96, num_hidden_layers=2,
              num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0,
              eos_token_id=1)


def model_inputs(rows=3, length=128):
    """(ids, attention_mask, positions, segment_ids, real): row 0 left padded with a hole, row 2 two packed
    sequences (positions restart at the second), the others whole."""
    rng = np.random.default_rng(4)
    ids = rng.integers(2, 64, (rows, length)).astype(np.int32)
    mask = np.ones((rows, length), bool)
    mask[0, :20] = False
    mask[0, 70] = False
    segments = np.zeros((rows, length), np.int32)
    segments[2, 90:] = 1
    positions = np.cumsum(mask, axis=1) - mask
    positions[2, 90:] = np.arange(length - 90)
    return tuple(jnp.asarray(x) for x in (ids, mask, positions, segments)) + (mask,)


def loss_and_grads(graphdef, params, inputs):
    """((loss, hidden [B, S, D]), gradients) of the sum of squares of a model's hidden states at the real tokens,
    and the program's jaxpr as text."""
    ids, mask, positions, segments, real = inputs

    def loss(p):
        hidden, _ = nnx.merge(graphdef, p)(ids, mask, positions, segment_ids=segments)
        return jnp.sum(jnp.where(jnp.asarray(real)[..., None], hidden, 0) ** 2), hidden

    program = jax.jit(jax.value_and_grad(loss, has_aux=True))
    return program(params), str(jax.make_jaxpr(program)(params))


def assert_equal_forwards(got, want, real):
    """Hidden states at the real tokens within 1e-5, the loss within 1e-5 relative, gradients within 5e-5 of the
    largest (float32 through two layers)."""
    (got_loss, got_hidden), got_grads = got
    (want_loss, want_hidden), want_grads = want
    np.testing.assert_allclose(np.asarray(got_hidden)[real], np.asarray(want_hidden)[real], atol=1e-5)
    np.testing.assert_allclose(float(got_loss), float(want_loss), rtol=1e-5)
    for a, b in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=5e-5 * float(jnp.max(jnp.abs(b))))


def hidden_and_grads(kernels, extra=None, remat="none"):
    cfg = ModelConfig.from_hf({**CONFIG, **(extra or {})})
    graphdef, params = nnx.split(CausalLM(cfg, rngs=nnx.Rngs(0), kernels=kernels, remat=remat))
    return loss_and_grads(graphdef, params, model_inputs())


@pytest.mark.parametrize("extra,remat", [(None, "none"), ({"model_type": "mistral", "sliding_window": 48}, "dots")])
def test_a_model_computes_with_the_kernel_as_with_xla_attention(extra, remat):
    """A llama (GQA, 2 layers; the second case all layers sliding, `remat: dots`) on left padding with a hole and
    a packed row: the hidden states, loss and gradients of XLA's attention (`assert_equal_forwards`); the kernel is
    the forward's attention."""
    got, splash_program = hidden_and_grads(TpuKernels(interpret=True), extra, remat)
    want, xla_program = hidden_and_grads(XLA, extra, remat)
    assert "pallas_call" in splash_program and "pallas_call" not in xla_program
    assert_equal_forwards(got, want, model_inputs()[-1])


def test_mixed_sliding_layers_and_other_lengths_take_xla_attention():
    """Where the kernel cannot say the mask (some layers slide, others not) or the row fits no block, TPUs' kernels
    compute XLA's attention: no Pallas call in the program."""
    mixed = {"model_type": "mistral", "sliding_window": 48, "head_dim": 16,
             "layer_types": ["sliding_attention", "full_attention"]}
    assert "pallas_call" not in hidden_and_grads(TpuKernels(interpret=True), mixed)[1]
    cfg = ModelConfig.from_hf(CONFIG)
    model = CausalLM(cfg, rngs=nnx.Rngs(0), kernels=TpuKernels(interpret=True))
    ids = jnp.ones((2, 96), jnp.int32)
    assert "pallas_call" not in str(jax.make_jaxpr(lambda i: model(i, i > 0)[0])(ids))


def test_a_sweep_of_models_runs_the_kernel_per_model():
    """Under vmap (one model per element of a seed or learning-rate sweep) each model's forward equals its own
    with XLA's attention."""
    cfg = ModelConfig.from_hf(CONFIG)
    ids, mask, _, segments, real = model_inputs()
    outputs = {}
    for name, kernels in (("xla", XLA), ("splash", TpuKernels(interpret=True))):
        graphdef, _ = nnx.split(CausalLM(cfg, rngs=nnx.Rngs(0), kernels=kernels))
        stacked = jax.tree.map(lambda *x: jnp.stack(x), *(nnx.split(CausalLM(cfg, rngs=nnx.Rngs(seed)))[1]
                                                          for seed in (0, 1)))
        forward = jax.vmap(lambda p: nnx.merge(graphdef, p)(ids, mask, None, segment_ids=segments)[0])
        outputs[name] = jax.jit(forward)(stacked)
    assert not np.allclose(np.asarray(outputs["xla"][0]), np.asarray(outputs["xla"][1]), atol=1e-3)
    np.testing.assert_allclose(np.asarray(outputs["splash"])[:, real], np.asarray(outputs["xla"])[:, real],
                               atol=1e-5)
