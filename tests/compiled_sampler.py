"""The whole sampler of a small bfloat16 model compiled for one compile-only accelerator (a TPU chip through libtpu,
an H100 through the CUDA plugin), for the tests that read what the target's compiler made of the decode loop."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ppojax.models import CausalLM
from ppojax.rl.sampler import generate


def sampler_hlo(cfg, kernels, device, *, segments: int = 1, slot_alignment: int = 8) -> str:
    """The optimized HLO of `generate` for a CausalLM of `cfg` in bfloat16 with `kernels` on `device`: 8 prompts of
    64 tokens, 128 tokens sampled (a cache of 192 slots), `segments` decode loops."""
    policy = nnx.eval_shape(lambda: CausalLM(cfg, rngs=nnx.Rngs(0), dtype=jnp.bfloat16, param_dtype=jnp.bfloat16,
                                             kernels=kernels))
    graphdef, params = nnx.split(policy)
    chip = NamedSharding(Mesh(np.array([device]), ("chip",)), PartitionSpec())
    placed = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=chip), params)
    prompts = jax.ShapeDtypeStruct((8, 64), jnp.int32, sharding=chip)
    key = jax.eval_shape(lambda: jax.random.key(0))
    key = jax.ShapeDtypeStruct(key.shape, key.dtype, sharding=chip)
    sample = jax.jit(lambda p, q, k: generate(graphdef, p, q, k, response_length=128, pad_token_id=0,
                                              stop_token_id=2, segments=segments, slot_alignment=slot_alignment))
    return sample.lower(placed, prompts, key).compile().as_text()
