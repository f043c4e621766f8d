"""Precision policies: the (compute dtype, parameter dtype) pair of a model, by name.

  "float32":  float32 parameters, float32 compute;
  "bfloat16": bfloat16 parameters, bfloat16 compute (half the memory of float32 everywhere);
  "mixed":    float32 parameters (the optimizer's master weights, whose gradients are float32 too), cast to
              bfloat16 inside the forward: every matmul (and the residual stream) runs in bfloat16.
Under every policy the models keep norm statistics, RoPE angles and the attention softmax in float32 and return
float32 logits, values and scores; log-softmax, losses and statistics downstream are float32.

    compute_dtype, param_dtype = precision_dtypes("mixed")
    model = CausalLM(cfg, rngs=rngs, dtype=compute_dtype, param_dtype=param_dtype)
"""

from __future__ import annotations

import jax.numpy as jnp

PRECISIONS = {
    "float32": (jnp.float32, jnp.float32),
    "bfloat16": (jnp.bfloat16, jnp.bfloat16),
    "mixed": (jnp.bfloat16, jnp.float32),
}


def precision_dtypes(name: str):
    """`name` -> `(compute_dtype, param_dtype)`; a clear `ValueError` for an unknown name."""
    if name not in PRECISIONS:
        raise ValueError(f"precision {name!r} is not one of {tuple(PRECISIONS)}: 'float32' (everything float32), "
                         f"'bfloat16' (everything bfloat16), 'mixed' (float32 parameters, bfloat16 matmuls)")
    return PRECISIONS[name]
