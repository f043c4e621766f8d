"""The Pallas decode-attention kernels, TPUs' (`ppojax.backends.tpu`, Mosaic) and NVIDIA GPUs'
(`ppojax.backends.gpu.decode_attention`, Triton), run in Pallas's interpreter on the CPU: each equals XLA's attention
(`xla_attention`) and the float64 formula, on left padding, holes in a row, a row with no valid key, GQA, several
blocks (and splits) and a chosen layer of the stacked cache; inside a model's sampler each samples the tokens XLA's
attention samples. Their compiles for a TPU chip and for H100s are tests/test_tpu_compile.py's and
tests/test_gpu_compile.py's."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import functools

from ppojax.backends.gpu import decode_attention as gpu_decode
from ppojax.backends.gpu.kernels import GpuKernels
from ppojax.backends.tpu.decode_attention import block_slots, cache_layout, decode_attention, fits, merged_slots
from ppojax.backends.tpu.kernels import TpuKernels
from ppojax.models import XLA, CausalLM, ModelConfig, init_cache
from ppojax.models.attention import xla_attention
from ppojax.rl.sampler import generate
from tests.test_attention import reference_attention


def cache_case(dtype, rows=3, layers=2, slots=512, kv_heads=2, group=3, head_dim=16, seed=0):
    """(q [B, H, hd], keys, values [L, B, T, K, hd], mask bool[B, T]): row 0 sees no key, row 1 is left padded with
    holes (a sampled pad inside its response), row 2 sees the slots written so far."""
    rng = np.random.default_rng(seed)
    heads = kv_heads * group
    q = rng.normal(size=(rows, heads, head_dim))
    keys = rng.normal(size=(layers, rows, slots, kv_heads, head_dim))
    values = rng.normal(size=(layers, rows, slots, kv_heads, head_dim))
    mask = np.zeros((rows, slots), bool)
    mask[1, 40:300] = True
    mask[1, [77, 190, 191]] = False
    mask[2, :301] = True
    return tuple(jnp.asarray(x, dtype) for x in (q, keys, values)) + (jnp.asarray(mask),)


def merged_decode_attention(q, keys, values, *args, **options):
    """The TPU's kernel over the cache stored with a slot's key heads side by side, [L, B, T, K * hd]."""
    keys, values = (x.reshape(*x.shape[:3], -1) for x in (keys, values))
    return decode_attention(q, keys, values, *args, bt=128, interpret=True, **options)


KERNELS = {  # the first 384 of 512 slots: the TPU's in 3 blocks of 128 (its 4 layouts), the GPU's in splits
    **{f"tpu-{layout}": functools.partial(decode_attention, bt=128, layout=layout, interpret=True)
       for layout in ("slots_minor", "rows_major", "heads_major")},
    "tpu-merged": merged_decode_attention,
    "gpu": functools.partial(gpu_decode.decode_attention, interpret=True),
}


@pytest.mark.parametrize("backend", list(KERNELS))
@pytest.mark.parametrize("dtype,atol", [(jnp.float32, 1e-5), (jnp.bfloat16, 2e-2)])
def test_the_kernel_equals_xla_attention_and_the_formula(backend, dtype, atol):
    """float32 within 1e-5; bfloat16 within its rounding (the unnormalised probabilities are rounded to bfloat16
    before the product with the values, as XLA's rounds the normalised ones)."""
    q, keys, values, mask = cache_case(dtype)
    layer, slots_read = 1, 384
    got = jax.jit(lambda *a: KERNELS[backend](*a, scale=0.25, slots_read=slots_read))(
        q, keys, values, jnp.int32(layer), mask[:, :slots_read])
    assert got.shape == q.shape and got.dtype == q.dtype
    k, v = keys[layer, :, :slots_read], values[layer, :, :slots_read]
    want = xla_attention(q[:, None], k, v, mask[:, None, :slots_read], scale=0.25)[:, 0]
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), atol=atol)
    assert not np.allclose(np.asarray(got[1:], np.float32), np.asarray(want[0], np.float32))  # rows differ
    as64 = [np.asarray(x, np.float32) for x in (q[:, None], k, v)]
    formula = reference_attention(*as64, np.asarray(mask[:, None, :slots_read]), 0.25)[:, 0]
    np.testing.assert_allclose(np.asarray(got[1:], np.float32), formula[1:], atol=atol)  # row 0 sees no key


def test_the_blocks_a_call_takes():
    """Blocks of a multiple of 128 slots that divide the read (at most 1 MiB of keys), the whole cache where it is
    read whole and small; nothing else (XLA's attention then). The cache read as the TPU compiler lays it out."""
    assert [cache_layout(k, hd) for k, hd in ((8, 64), (3, 32), (8, 128), (2, 256), (3, 128), (1, 128))] == \
        ["slots_minor"] * 2 + ["rows_major"] * 2 + ["heads_major"] * 2
    assert cache_layout(8, 192) is None and fits((8, 1, 16, 192), (8, 1536, 8, 192), jnp.bfloat16, 1536) is None
    # key heads side by side where they fill whole lanes (hd below 128): a cache [B, T, K * hd] per layer
    assert [merged_slots(k, hd) for k, hd in ((8, 64), (2, 64), (4, 32), (3, 32), (8, 128), (1, 64))] == \
        [True, True, True, False, False, False]
    assert TpuKernels().slot_shape(8, 64) == (512,) and TpuKernels().slot_shape(3, 32) == (3, 32)
    assert fits((8, 1, 32, 64), (8, 1536, 512), jnp.bfloat16, 1536) == 768
    assert fits((8, 1, 32, 32), (8, 1536, 96), jnp.bfloat16, 1536) is None  # 3 heads of 32: not whole lanes
    assert block_slots(1536, 1536, 8, 64, jnp.bfloat16) == 768
    assert block_slots(384, 1536, 8, 64, jnp.bfloat16) == 384
    assert block_slots(640, 1536, 8, 64, jnp.bfloat16) == 640
    assert block_slots(12, 12, 4, 8, jnp.bfloat16) == 12
    assert block_slots(96, 192, 4, 8, jnp.bfloat16) is None
    assert fits((8, 1, 32, 64), (8, 1536, 8, 64), jnp.bfloat16, 1536) == 768
    assert fits((8, 4, 32, 64), (8, 1536, 8, 64), jnp.bfloat16, 1536) is None  # a prefill: XLA's
    # the GPU's: one query per row, up to 16 query heads per key head, hd a power of two, whole 64-slot blocks
    assert gpu_decode.fits((8, 1, 32, 64), (8, 1536, 8, 64), jnp.bfloat16, 1536)
    assert not gpu_decode.fits((8, 2, 32, 64), (8, 1536, 8, 64), jnp.bfloat16, 1536)
    assert not gpu_decode.fits((8, 1, 32, 96), (8, 1536, 8, 96), jnp.bfloat16, 1536)
    assert not gpu_decode.fits((8, 1, 32, 64), (8, 1536, 8, 64), jnp.bfloat16, 1000)
    assert not gpu_decode.fits((8, 1, 64, 64), (8, 1536, 2, 64), jnp.bfloat16, 1536)
    assert gpu_decode.splits_for(8, 8, 1536) == 8 and gpu_decode.splits_for(128, 8, 1536) == 1


@pytest.mark.parametrize("backend", ["tpu", "tpu-merged", "gpu"])
def test_a_model_samples_with_the_kernel_as_with_xla_attention(backend):
    """A float32 llama (GQA, 2 layers) sampling 112 tokens after left-padded prompts of 16 with a backend's kernels
    (interpreted; the GPU's with attention_implementation 'pallas') draws the tokens XLA's attention draws, with
    their log-probs within 1e-5; the kernel is the program's decode attention. tpu-merged: 2 key heads of 64, which
    the TPU's kernels store side by side (a cache [L, B, T, 128])."""
    head_dim = 64 if backend == "tpu-merged" else 16
    cfg = ModelConfig.from_hf(dict(model_type="llama", vocab_size=64, hidden_size=96, intermediate_size=96,
                                   num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=2,
                                   head_dim=head_dim, max_position_embeddings=256, pad_token_id=0, eos_token_id=1))
    prompts = np.asarray(np.random.default_rng(3).integers(2, 64, (3, 16)), np.int32)
    prompts[1, :5] = 0
    prompts[2, :12] = 0
    results = {}
    pallas = GpuKernels("pallas", (9, 0), interpret=True) if backend == "gpu" else TpuKernels(interpret=True)
    stored = init_cache(cfg, 3, 128, jnp.float32, pallas).keys.shape
    assert stored == ((2, 3, 128, 128) if backend == "tpu-merged" else (2, 3, 128, 2, head_dim))
    for name, kernels in (("xla", XLA), ("pallas", pallas)):
        graphdef, params = nnx.split(CausalLM(cfg, rngs=nnx.Rngs(0), kernels=kernels))
        sample = jax.jit(lambda p, q, k: generate(graphdef, p, q, k, response_length=112, pad_token_id=0,
                                                  return_logprobs=True))
        if name == "pallas":
            assert "pallas_call" in str(jax.make_jaxpr(sample)(params, prompts, jax.random.key(0)))
        results[name] = sample(params, prompts, jax.random.key(0))
    np.testing.assert_array_equal(results["pallas"][0], results["xla"][0])
    np.testing.assert_allclose(results["pallas"][1], results["xla"][1], atol=1e-5)


def _pallas_outputs(jaxpr):
    """The output shapes of every pallas_call in a jaxpr and the jaxprs inside it."""
    shapes = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            shapes.append(tuple(eqn.outvars[0].aval.shape))
        for param in eqn.params.values():
            inner = getattr(param, "jaxpr", param)
            if hasattr(inner, "eqns"):
                shapes += _pallas_outputs(inner)
    return shapes


@pytest.mark.parametrize("backend", ["tpu-slots_minor", "gpu"])
def test_a_sweep_of_models_runs_one_kernel_over_them(backend):
    """Under vmap (a sweep over seeds or learning rates: one model per element, each its own cache and here its own
    layer) the kernel equals XLA's attention per model, and ONE kernel call covers both models (their caches
    stacked into its leading axis), not a loop that slices each model's cache out."""
    caches = [cache_case(jnp.float32, seed=seed) for seed in (0, 1)]
    q, keys, values, mask = (jnp.stack(parts) for parts in zip(*caches))
    layers, slots_read = jnp.asarray([1, 0], jnp.int32), 384
    fn = jax.vmap(lambda *a: KERNELS[backend](*a, scale=0.25, slots_read=slots_read))
    got = jax.jit(fn)(q, keys, values, layers, mask[:, :, :slots_read])
    want = jax.vmap(lambda q, k, v, layer, m: xla_attention(q[:, None], k[layer, :, :slots_read],
                                                            v[layer, :, :slots_read], m[:, None, :slots_read],
                                                            scale=0.25)[:, 0])(q, keys, values, layers, mask)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5)
    outputs = _pallas_outputs(jax.make_jaxpr(fn)(q, keys, values, layers, mask[:, :, :slots_read]).jaxpr)
    models_axis = 0 if backend.startswith("tpu") else 1  # the GPU's partial results lead with the splits
    assert len(outputs) == 1 and outputs[0][models_axis] == 2, outputs
