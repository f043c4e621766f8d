"""`ppojax.models.attention.attention` (XLA: grouped query rows; cuDNN: jax.nn.dot_product_attention) against the
plain formula, recomputed here in float64 numpy: GQA, left padding, sliding windows, KV-cache decode, rows with no valid key.
On an NVIDIA GPU, also cuDNN's fused kernel against the same reference (skipped elsewhere)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ppojax.models import CausalLM, ModelConfig
from ppojax.models.attention import attention, check_attention_implementation, resolve_implementation

ON_CUDA = jax.devices()[0].platform == "gpu" and bool(getattr(jax.devices()[0], "compute_capability", None))
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
    fn = jax.jit(lambda q, k, v, m: attention(q, k, v, m, scale=scale, implementation="xla", is_causal=True,
                                              window=window))
    with FULL_FLOAT32:
        out = np.asarray(fn(q, k, v, mask))
    assert out.shape == q.shape and out.dtype == np.float32
    assert np.isfinite(out).all()  # left-pad queries and the all-pad row see no key: finite, never NaN
    live = live_rows(mask)
    assert (~live).sum() >= 8 + 3  # the test does cover fully masked rows
    np.testing.assert_allclose(out[live], ref[live], atol=2e-6)
    # the hints change nothing: the mask alone gives the same result
    with FULL_FLOAT32:
        bare = jax.jit(lambda q, k, v, m: attention(q, k, v, m, scale=scale, implementation="xla"))(q, k, v, mask)
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


def test_implementation_choice_and_errors():
    cfg = ModelConfig.from_hf(dict(model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=48,
                                   num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1))
    with pytest.raises(ValueError, match=r"attention_implementation='flash' is not one of \('auto', 'xla', 'cudnn'\)"):
        CausalLM(cfg, rngs=nnx.Rngs(0), attention_implementation="flash")
    with pytest.raises(ValueError, match="'cudnn' needs a bfloat16 or float16 compute dtype, got float32"):
        CausalLM(cfg, rngs=nnx.Rngs(0), attention_implementation="cudnn")
    with pytest.raises(ValueError, match="head_dim a multiple of 8 and <= 256 .* got 12"):
        check_attention_implementation("cudnn", jnp.bfloat16, 12)
    # "auto" never picks cuDNN for what it cannot run
    assert resolve_implementation("auto", jnp.float32, 64, 8, 8) == "xla"
    assert resolve_implementation("auto", jnp.bfloat16, 12, 8, 8) == "xla"
    assert resolve_implementation("auto", jnp.bfloat16, 64, 7, 7) == "xla"
    assert resolve_implementation("auto", jnp.bfloat16, 64, 1, 64) == "xla"  # decode
    assert resolve_implementation("xla", jnp.bfloat16, 64, 8, 8) == "xla"
    if not ON_CUDA:
        assert resolve_implementation("auto", jnp.bfloat16, 64, 8, 8) == "xla"
        model = CausalLM(cfg, rngs=nnx.Rngs(0), dtype=jnp.bfloat16, attention_implementation="cudnn")
        with pytest.raises(ValueError, match="'cudnn' needs an NVIDIA GPU, but the device traced for is 'cpu'"):
            model(jnp.ones((1, 4), jnp.int32), jnp.ones((1, 4), bool))
    # "auto" and "xla" are the same program off cuDNN
    ids, mask = jnp.ones((2, 6), jnp.int32), jnp.asarray(left_padded_mask([6, 3], 6))
    auto = CausalLM(cfg, rngs=nnx.Rngs(0))(ids, mask)[0]
    xla = CausalLM(cfg, rngs=nnx.Rngs(0), attention_implementation="xla")(ids, mask)[0]
    np.testing.assert_array_equal(auto, xla)


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
    fn = jax.jit(lambda q, k, v, m: attention(q, k, v, m, scale=0.125, implementation="cudnn", is_causal=True,
                                              window=window))
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
    dfn = jax.jit(lambda q, k, v, m: attention(q, k, v, m, scale=0.125, implementation="cudnn"))
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
        graphdef, params = nnx.split(CausalLM(cfg, rngs=nnx.Rngs(0), dtype=jnp.bfloat16, remat="dots",
                                              attention_implementation=impl))
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
