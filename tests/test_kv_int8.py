"""The 8-bit KV cache (ppojax.models.kv_int8, ``kv_cache_dtype: int8``) against independent references:

- the packing: a NumPy transcription of symmetric absmax quantization per group of channels of a token's head
  (codes round(x / s), s = max|x| / 127, read back as codes * s, each element within s / 2), and the scales' bytes;
- sampling with it: every sampler (padded, continuous batching, multi-turn episodes) with an int8 cache gives
  log-probs within a small drift of a plain float32 forward over the sampled tokens, with cache arrays of hd codes and
  the groups' scales per token and head;
- a run's rollout uses it when the config says so, and ``ppojax plan`` counts its bytes.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ppojax.models import init_cache, kv_int8
from ppojax.rl.continuous import generate_continuous
from ppojax.rl.forward import response_logprobs
from ppojax.rl.sampler import generate
from tests.tiny_setup import tiny_policy

PAD, P, R = 0, 5, 10
PROMPTS = np.random.default_rng(0).integers(2, 16, size=(6, P)).astype(np.int32)
PROMPTS[1, :2] = PAD
DRIFT = 2e-3  # the tiny model's largest log-prob change from 8-bit keys and values


def test_quantize_is_absmax_per_group_of_channels():
    """Groups of kv_int8.GROUP channels, each with its own scale; an outlier only coarsens its own group."""
    g = kv_int8.GROUP
    x = np.random.default_rng(1).normal(size=(2, 3, 4, 4 * g)).astype(np.float32) * np.array([1, 10, 0.01, 0])[:, None]
    x[0, 0, 0, 0] = 500.0  # an outlier channel
    stored = np.asarray(kv_int8.quantize(jnp.asarray(x)))
    assert stored.dtype == np.int8 and stored.shape == (2, 3, 4, 4 * g + 4 * 4)
    assert stored.shape[-1] == kv_int8.stored_width(4 * g)
    groups = x.reshape(2, 3, 4, 4, g)
    scale = np.abs(groups).max(-1, keepdims=True) / 127
    stored_scale = stored[..., 4 * g:].copy().view(np.float32).reshape(2, 3, 4, 4, 1)
    np.testing.assert_allclose(stored_scale, scale, rtol=1e-6, atol=0)  # XLA may divide as a reciprocal product
    codes = np.where(stored_scale > 0, np.round(groups / np.where(stored_scale > 0, stored_scale, 1)), 0)
    np.testing.assert_array_equal(stored[..., :4 * g], codes.reshape(2, 3, 4, 4 * g))
    back = np.asarray(kv_int8.dequantize(jnp.asarray(stored), jnp.float32, 4 * g)).reshape(2, 3, 4, 4, g)
    assert np.all(np.abs(back - groups) <= scale / 2 + 1e-7)
    assert np.all(back[..., 3, :, :] == 0)  # an all-zero vector stays zero
    # the outlier's group is coarse, the head's other groups are not
    assert stored_scale[0, 0, 0, 0] > 3.0 and np.all(stored_scale[0, 0, 0, 1:] < 0.05)


@pytest.fixture(scope="module")
def policy():
    return nnx.split(tiny_policy(0))


def _drift(policy, responses, logprobs, prompts=PROMPTS):
    """The largest |sampler log-prob - float32 forward log-prob| over the sampled (non-pad) tokens."""
    graphdef, params = policy
    forward = response_logprobs(nnx.merge(graphdef, params), jnp.concatenate([jnp.asarray(prompts), responses], 1),
                                P, PAD, 1.0)[0]
    real = np.asarray(responses) != PAD
    return float(np.max(np.abs(np.asarray(logprobs) - np.asarray(forward))[real]))


@pytest.mark.parametrize("sampler", ["padded", "continuous"])
def test_samplers_with_an_int8_cache_stay_within_the_drift_of_a_float32_forward(policy, sampler):
    graphdef, params = policy
    kwargs = dict(response_length=R, pad_token_id=PAD, temperature=1.0, return_logprobs=True)
    decode = generate if sampler == "padded" else lambda *a, **k: generate_continuous(*a, slots=3, **k)
    run = jax.jit(lambda p, x, k, dtype=None: decode(graphdef, p, x, k, cache_dtype=dtype, **kwargs),
                  static_argnames="dtype")
    exact = _drift(policy, *run(params, jnp.asarray(PROMPTS), jax.random.key(2)))
    int8 = _drift(policy, *run(params, jnp.asarray(PROMPTS), jax.random.key(2), dtype="int8"))
    assert exact < 1e-5 < int8 < DRIFT, (exact, int8)


def test_episodes_with_an_int8_cache_stay_within_the_drift(policy):
    from tests.test_episodes import PROMPTS as EP_PROMPTS, SHAPE, scripted_host
    from ppojax.rl.episodes import generate_episodes

    graphdef, params = policy
    played = jax.jit(lambda p, x, k: generate_episodes(
        graphdef, p, x, k, shape=SHAPE, host_turn=scripted_host, pad_token_id=PAD, stop_token_id=8,
        temperature=1.0, cache_dtype="int8", slots=5))(params, jnp.asarray(EP_PROMPTS), jax.random.key(3))
    forward = response_logprobs(nnx.merge(graphdef, params), jnp.concatenate(
        [jnp.asarray(EP_PROMPTS), played.stream], 1), EP_PROMPTS.shape[1], PAD, 1.0)[0]
    model = (np.asarray(played.stream) != PAD) & ~np.asarray(played.environment_mask)
    assert model.sum() > 40 and int(jnp.max(played.turns)) > 1
    drift = np.abs(np.asarray(played.logprobs) - np.asarray(forward))[model]
    assert 1e-5 < drift.max() < DRIFT, drift.max()


def test_an_int8_cache_holds_its_codes_and_scales(policy):
    cfg = nnx.merge(*policy).cfg
    small = init_cache(cfg, 4, 32, jnp.int8)
    exact = init_cache(cfg, 4, 32, jnp.bfloat16)
    width = kv_int8.stored_width(cfg.head_dim)
    assert small.keys.dtype == jnp.int8 and small.keys.shape[-1] == width > cfg.head_dim
    assert small.keys.nbytes / exact.keys.nbytes == width / (2 * cfg.head_dim)


def test_a_run_samples_with_the_int8_cache_it_is_given():
    from ppojax.rl.settings import StepSettings
    from ppojax.trainer.config import PPOConfig

    config = PPOConfig.from_dict(dict(kv_cache_dtype="int8", batch_size=4, response_length=4))
    settings = StepSettings.from_config(config, pad_token_id=0, stop_token_id=None, eos_token_id=None, num_updates=1)
    assert settings.sampling.kv_cache_dtype == "int8"
    auto = StepSettings.from_config(PPOConfig.from_dict(dict(batch_size=4, response_length=4)), pad_token_id=0,
                                   stop_token_id=None, eos_token_id=None, num_updates=1)
    assert auto.sampling.kv_cache_dtype is None
