"""Attention against the plain formula, recomputed here in float64 numpy: XLA's grouped query rows
(`ppojax.models.attention.xla_attention`, the models' default `Kernels.attention`) on GQA, left padding, sliding
windows, KV-cache decode and rows with no valid key; the backend's choice of attention, made when a run is built
(`ppojax.backends.kernels_for`); on an NVIDIA GPU, also cuDNN's fused kernel (`GpuKernels`) against the same
reference (skipped elsewhere)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ppojax import backends
from ppojax.backends.gpu.kernels import GpuKernels, compute_capability
from ppojax.models import XLA, CausalLM, ModelConfig
from ppojax.models.attention import xla_attention

ON_CUDA = compute_capability(jax.devices()[0]) is not None
CUDNN = GpuKernels("cudnn", compute_capability(jax.devices()[0]) or (9, 0))


def attention(q, k, v, mask, *, scale, is_causal=False, window=None):
    """The models' default attention, XLA's (the hints are implied by the mask)."""
    return XLA.attention(q, k, v, mask, scale=scale, is_causal=is_causal, window=window)
FULL_FLOAT32 = jax.default_matmul_precision("highest")  # GPUs default to TF32 for float32 matmuls


def reference_attention(q, k, v, mask, scale):
    """The pre-jax.nn formula in float64: scores = q.k * scale, masked with a finite -1e30, softmax, @ v.

    q [B, S, H, hd], k/v [B, T, K, hd], mask bool[B, S, T] -> [B, S, H, hd]."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    b, s, h, hd = q.shape
    kv = k.shape[2]
    qg = q.reshape(b, s, kv, h // kv, hd)
    scores = np.einsum("bskgd,btkd->bkgst", qg, k) * scale
    scores = np.where(np.asarray(mask)[:, None, None], scores, -1e30)
    scores = scores - scores.max(-1, keepdims=True)
    probs = np.exp(scores)
    probs /= probs.sum(-1, keepdims=True)
    return np.einsum("bkgst,btkd->bskgd", probs, v).reshape(b, s, h, hd)


def left_padded_mask(lengths, seq_len):
    """bool[B, S]: the last `lengths[b]` slots of row b are real tokens."""
    return np.arange(seq_len)[None, :] >= (seq_len - np.asarray(lengths))[:, None]


def full_forward_mask(key_mask, window=None):
    """bool[B, S, S]: causal, pad keys masked, optionally keys within `window` slots of the query."""
    s = key_mask.shape[1]
    q_slot, k_slot = np.arange(s)[:, None], np.arange(s)[None, :]
    allowed = k_slot <= q_slot
    if window is not None:
        allowed &= k_slot > q_slot - window
    return key_mask[:, None, :] & allowed[None]


def qkv(b, s, t, h, kv, hd, seed=0, dtype=np.float32):
    rng = np.random.default_rng(seed)
    return (rng.normal(size=(b, s, h, hd)).astype(dtype), rng.normal(size=(b, t, kv, hd)).astype(dtype),
            rng.normal(size=(b, t, kv, hd)).astype(dtype))


def live_rows(mask):
    """bool[B, S]: queries that see at least one key (the rows whose output means something)."""
    return np.asarray(mask).any(-1)


@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (6, 1), (4, 4)])
@pytest.mark.parametrize("window", [None, 3])
def test_full_forward_matches_reference(heads, kv_heads, window):
    # rows: full, left padded, and one with no real token at all (every query row fully masked)
    key_mask = left_padded_mask([8, 5, 0], 8)
    mask = full_forward_mask(key_mask, window)
    q, k, v = qkv(3, 8, 8, heads, kv_heads, 16)
    scale = 16 ** -0.5
    ref = reference_attention(q, k, v, mask, scale)
    fn = jax.jit(lambda q, k, v, m: attention(q, k, v, m, scale=scale, is_causal=True, window=window))
    with FULL_FLOAT32:
        out = np.asarray(fn(q, k, v, mask))
    assert out.shape == q.shape and out.dtype == np.float32
    assert np.isfinite(out).all()  # left-pad queries and the all-pad row see no key: finite, never NaN
    live = live_rows(mask)
    assert (~live).sum() >= 8 + 3  # the test does cover fully masked rows
    np.testing.assert_allclose(out[live], ref[live], atol=2e-6)
    # the hints change nothing: the mask alone gives the same result
    with FULL_FLOAT32:
        bare = jax.jit(lambda q, k, v, m: xla_attention(q, k, v, m, scale=scale))(q, k, v, mask)
    np.testing.assert_allclose(np.asarray(bare)[live], ref[live], atol=2e-6)


def test_cache_decode_matches_reference():
    # one query per row against 12 cache slots: a left-padded prompt of 6 slots, 3 generated, 3 still empty
    b, t, written = 3, 12, 9
    key_mask = np.zeros((b, t), bool)
    key_mask[:, :6] = left_padded_mask([6, 2, 0], 6)
    key_mask[:, 6:written] = True
    key_mask[1, 7] = False  # a row that finished: its later tokens are not real
    q, k, v = qkv(b, 1, t, 4, 2, 16, seed=1)
    q_slot = written - 1
    for window in (None, 4):
        mask = key_mask[:, None, :] & (np.arange(t) <= q_slot)[None, None]
        if window is not None:
            mask &= (np.arange(t) > q_slot - window)[None, None]
        ref = reference_attention(q, k, v, mask, 0.25)
        with FULL_FLOAT32:
            out = np.asarray(jax.jit(lambda q, k, v, m: attention(q, k, v, m, scale=0.25))(q, k, v, mask))
        np.testing.assert_allclose(out, ref, atol=2e-6)


class _FakeGpu:
    """A device as `kernels_for` reads one: an NVIDIA GPU of this compute capability."""

    platform = "gpu"

    def __init__(self, capability: str):
        self.compute_capability = capability


def test_the_attention_is_chosen_when_the_run_is_built_and_errors_name_the_fix():
    cfg = ModelConfig.from_hf(dict(model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=48,
                                   num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1))
    f32, bf16 = CausalLM(cfg, rngs=nnx.Rngs(0)), CausalLM(cfg, rngs=nnx.Rngs(0), dtype=jnp.bfloat16)
    hopper, ampere = [_FakeGpu("9.0")], [_FakeGpu("8.0")]
    with pytest.raises(ValueError, match=r"'flash' is not one of \('auto', 'xla', 'cudnn', 'pallas'\)"):
        backends.kernels_for([f32], attention_implementation="flash", devices=hopper)
    with pytest.raises(ValueError, match="'cudnn' needs a bfloat16 or float16 compute dtype, got float32"):
        backends.kernels_for([f32], attention_implementation="cudnn", devices=hopper)
    cfg12 = ModelConfig.from_hf(dict(model_type="llama", vocab_size=64, hidden_size=24, intermediate_size=48,
                                     num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1))
    with pytest.raises(ValueError, match="head_dim a multiple of 8 and <= 256 .* got 12"):
        backends.kernels_for([CausalLM(cfg12, rngs=nnx.Rngs(0), dtype=jnp.bfloat16)],
                             attention_implementation="cudnn", devices=hopper)
    with pytest.raises(ValueError, match="'cudnn' needs an NVIDIA GPU, but the run's devices are 'cpu'"):
        backends.kernels_for([bf16], attention_implementation="cudnn", devices=jax.devices("cpu"))
    with pytest.raises(ValueError, match="'pallas' needs a TPU or an NVIDIA GPU, but the run's devices are 'cpu'"):
        backends.kernels_for([bf16], attention_implementation="pallas", devices=jax.devices("cpu"))
    assert backends.kernels_for([bf16], attention_implementation="pallas", devices=hopper) == \
        GpuKernels("pallas", (9, 0))
    # on a GPU: cuDNN's kernels, told the device's capability; "xla" keeps XLA's; elsewhere XLA's
    assert backends.kernels_for([bf16], devices=hopper) == GpuKernels("auto", (9, 0))
    assert backends.kernels_for([bf16], attention_implementation="xla", devices=hopper) is XLA
    assert backends.kernels_for([bf16], devices=jax.devices("cpu"), cpu_backend=False) is XLA
    # "auto" never picks cuDNN for what it cannot run
    auto, old = GpuKernels("auto", (9, 0)), backends.kernels_for([bf16], devices=ampere)
    assert old == GpuKernels("auto", (8, 0))
    assert not auto.takes_cudnn(jnp.float32, 64, 8, 8)
    assert not auto.takes_cudnn(jnp.bfloat16, 12, 8, 8)
    assert not auto.takes_cudnn(jnp.bfloat16, 64, 7, 7)
    assert not auto.takes_cudnn(jnp.bfloat16, 64, 1, 64)  # decode
    assert auto.takes_cudnn(jnp.bfloat16, 256, 8, 8) and not old.takes_cudnn(jnp.bfloat16, 256, 8, 8)
    assert not GpuKernels("auto", (7, 5)).takes_cudnn(jnp.bfloat16, 64, 8, 8)
    assert auto.takes_cudnn(jnp.bfloat16, 64, 8, 8) and CUDNN.takes_cudnn(jnp.bfloat16, 64, 1, 64)
    # a call cuDNN does not take is XLA's, exactly
    ids, mask = jnp.ones((2, 6), jnp.int32), jnp.asarray(left_padded_mask([6, 3], 6))
    on_gpu_kernels = CausalLM(cfg, rngs=nnx.Rngs(0), kernels=auto)(ids, mask)[0]  # float32: never cuDNN
    xla = CausalLM(cfg, rngs=nnx.Rngs(0))(ids, mask)[0]
    np.testing.assert_array_equal(on_gpu_kernels, xla)


@pytest.mark.skipif(not ON_CUDA, reason="cuDNN's fused attention needs an NVIDIA GPU")
@pytest.mark.parametrize("window", [None, 3])
def test_cudnn_matches_reference(window):
    """bfloat16 inputs; tolerance: the output is an average of bfloat16 values (|v| <~ 3) with probabilities
    rounded to bfloat16 (relative 2^-8), so errors of a few 1e-2 are bfloat16 rounding, not a wrong mask."""
    key_mask = left_padded_mask([64, 40, 0, 17], 64)
    mask = full_forward_mask(key_mask, window)
    q, k, v = qkv(4, 64, 64, 8, 2, 64, seed=2)
    q16, k16, v16 = (jnp.asarray(a, jnp.bfloat16) for a in (q, k, v))
    ref = reference_attention(np.asarray(q16, np.float32), np.asarray(k16, np.float32), np.asarray(v16, np.float32),
                              mask, 0.125)
    fn = jax.jit(lambda q, k, v, m: CUDNN.attention(q, k, v, m, scale=0.125, is_causal=True, window=window))
    assert "__cudnn$fmha" in fn.lower(q16, k16, v16, mask).compile().as_text()
    out = np.asarray(fn(q16, k16, v16, mask), np.float32)
    assert np.isfinite(out).all()
    live = live_rows(mask)
    np.testing.assert_allclose(out[live], ref[live], atol=3e-2)
    # decode: one query against 64 slots, 50 written
    qd = q16[:, :1]
    dmask = (key_mask & (np.arange(64) < 50))[:, None, :]
    dref = reference_attention(np.asarray(qd, np.float32), np.asarray(k16, np.float32), np.asarray(v16, np.float32),
                               dmask, 0.125)
    dfn = jax.jit(lambda q, k, v, m: CUDNN.attention(q, k, v, m, scale=0.125))
    dout = np.asarray(dfn(qd, k16, v16, dmask), np.float32)
    assert np.isfinite(dout).all()
    np.testing.assert_allclose(dout[live_rows(dmask)], dref[live_rows(dmask)], atol=3e-2)


@pytest.mark.skipif(not ON_CUDA, reason="cuDNN's fused attention needs an NVIDIA GPU")
def test_cudnn_model_matches_xla_model():
    """A bfloat16 llama (GQA, left padding) under remat 'dots': 'auto' takes cuDNN for the forward, and its logits
    and gradient match the XLA attention's within bfloat16 rounding (the two kernels round differently)."""
    cfg = ModelConfig.from_hf(dict(model_type="llama", vocab_size=128, hidden_size=128, intermediate_size=256,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2))
    ids = jnp.asarray(np.random.default_rng(0).integers(0, 128, (3, 16)), jnp.int32)
    mask = jnp.asarray(left_padded_mask([16, 9, 4], 16))

    def loss(graphdef, params):
        model = nnx.merge(graphdef, params)
        logits = model.logits(model(ids, mask)[0])
        return jnp.sum(jnp.where(mask[..., None], jax.nn.log_softmax(logits), 0.0) ** 2) / 1e4, logits

    results = {}
    for impl in ("auto", "xla"):
        kernels = backends.kernels_for([], attention_implementation=impl)
        graphdef, params = nnx.split(CausalLM(cfg, rngs=nnx.Rngs(0), dtype=jnp.bfloat16, remat="dots",
                                              kernels=kernels))
        fn = jax.jit(jax.value_and_grad(loss, argnums=1, has_aux=True), static_argnums=0)
        hlo = fn.lower(graphdef, params).compile().as_text()
        assert ("__cudnn$fmhaScaleBiasSoftmaxBackward" in hlo) == (impl == "auto")
        assert ("__cudnn$fmha" in hlo) == (impl == "auto")
        (_, logits), grads = fn(graphdef, params)
        results[impl] = (np.asarray(logits), np.concatenate([np.ravel(np.asarray(g, np.float32))
                                                             for g in jax.tree.leaves(grads)]))
    (la, ga), (lx, gx) = results["auto"], results["xla"]
    assert np.isfinite(la).all() and np.isfinite(ga).all()
    live = np.asarray(mask)
    assert np.abs(la - lx)[live].max() < 0.05 * np.abs(lx[live]).max()
    assert ga @ gx / (np.linalg.norm(ga) * np.linalg.norm(gx)) > 0.99
