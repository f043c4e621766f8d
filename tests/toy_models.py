"""Tiny stand-in models with ppojax's model contract, for fast tests of the update machinery.

``model(input_ids, attention_mask, position_ids, cache=None) -> (hidden f32[B,S,D], cache)`` and
``model.logits(hidden) -> f32[..., V]``; the score model returns f32[B, S]. Hidden states mix each token
with a causal running mean of the live tokens before it, so they depend on context as an LM's do.
"""
import jax.numpy as jnp
from flax import nnx


class ToyBackbone(nnx.Module):
    def __init__(self, vocab, dim, rngs):
        self.embed = nnx.Embed(vocab, dim, rngs=rngs)
        self.mix = nnx.Linear(2 * dim, dim, rngs=rngs)

    def __call__(self, input_ids, attention_mask, position_ids):
        x = self.embed(input_ids) * attention_mask[..., None]
        counts = jnp.maximum(jnp.cumsum(attention_mask, axis=1), 1)[..., None]
        context = jnp.cumsum(x, axis=1) / counts
        pos = jnp.sin(position_ids[..., None] * 0.1)
        return jnp.tanh(self.mix(jnp.concatenate([x, context], -1)) + pos)


class ToyLM(nnx.Module):
    def __init__(self, vocab=16, dim=8, *, rngs):
        self.backbone = ToyBackbone(vocab, dim, rngs)
        self.head = nnx.Linear(dim, vocab, rngs=rngs)

    def __call__(self, input_ids, attention_mask, position_ids, cache=None):
        return self.backbone(input_ids, attention_mask, position_ids), cache

    def logits(self, hidden):
        return self.head(hidden).astype(jnp.float32)


class ToyScore(nnx.Module):
    def __init__(self, vocab=16, dim=8, *, rngs):
        self.backbone = ToyBackbone(vocab, dim, rngs)
        self.score = nnx.Linear(dim, 1, use_bias=False, rngs=rngs)

    def __call__(self, input_ids, attention_mask, position_ids):
        return self.score(self.backbone(input_ids, attention_mask, position_ids))[..., 0].astype(jnp.float32)


class ToyLMWithValueHead(ToyLM):
    def __init__(self, vocab=16, dim=8, *, rngs):
        super().__init__(vocab, dim, rngs=rngs)
        self.v_head = nnx.Linear(dim, 1, rngs=rngs)

    def value(self, hidden):
        return self.v_head(hidden)[..., 0].astype(jnp.float32)
