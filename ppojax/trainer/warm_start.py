"""A warm start before RL: supervised fine-tuning on a few written episodes (``ppojax.agents.demonstrations``).

What a run cannot sample it cannot reinforce: a small model that never writes a tool call gives GRPO nothing to
reward. A few demonstrations fix that (the "cold start" of ReTool-style tool RL): the policy is trained to give
the demonstrated messages, next-token negative log-likelihood averaged over the trained tokens of a batch, and
the context (prompt, observations) is not trained. The result is saved as a checkpoint and named as the run's
``model_name_or_path``.

Shapes: S streams padded to length T (right padding; ``ids``, ``attention_mask``, ``trained`` i32[S, T]).
"""
from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from ppojax.rl.forward import logprobs_from_hidden

__all__ = ["masked_nll", "pad_streams", "warm_start"]


def pad_streams(streams: Sequence[tuple[list, list]], pad_token_id: int) -> dict:
    """[(ids, trained)] -> {"ids", "attention_mask", "trained"}: i32[S, T], right padded to the longest stream."""
    length = max(len(ids) for ids, _ in streams)
    out = {k: np.zeros((len(streams), length), np.int32) for k in ("ids", "attention_mask", "trained")}
    out["ids"][:] = pad_token_id
    for row, (ids, trained) in enumerate(streams):
        if len(ids) != len(trained):
            raise ValueError(f"stream {row}: {len(ids)} ids but {len(trained)} trained flags")
        out["ids"][row, :len(ids)], out["trained"][row, :len(ids)] = ids, trained
        out["attention_mask"][row, :len(ids)] = 1
    return out


def masked_nll(graphdef, params, ids, attention_mask, trained, *, chunk_size=None) -> jax.Array:
    """Mean negative log-likelihood of the trained tokens (each predicted from the tokens before it) -> f32[]; the
    log-probs as the run's forwards compute them (``logprobs_from_hidden`` at temperature 1, ``chunk_size`` time
    steps of logits at a time)."""
    model = nnx.merge(graphdef, params)
    hidden, _ = model(ids, attention_mask, None, None)
    logprobs, _ = logprobs_from_hidden(model, hidden[:, :-1], ids[:, 1:], 1.0, chunk_size=chunk_size)
    weight = trained[:, 1:].astype(jnp.float32)
    return -(logprobs * weight).sum() / jnp.maximum(weight.sum(), 1.0)


def warm_start(graphdef, params, batch: dict, *, learning_rate: float, batch_size: int, epochs: int,
               seed: int = 0, log=None):
    """Adam (no weight decay, constant ``learning_rate``) over ``batch`` (:func:`pad_streams`) in shuffled
    mini-batches of ``batch_size`` streams (a last partial one dropped), ``epochs`` times -> (params, [loss per
    step]). ``log(step, loss)`` is called after each step where given."""
    streams = batch["ids"].shape[0]
    if not 0 < batch_size <= streams:
        raise ValueError(f"batch_size={batch_size}: expected 1 to the {streams} streams given")
    optimizer = optax.adam(learning_rate)

    @jax.jit
    def step(params, opt_state, ids, attention_mask, trained):
        loss, grads = jax.value_and_grad(masked_nll, argnums=1)(graphdef, params, ids, attention_mask, trained)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    opt_state, losses = optimizer.init(params), []
    rng = np.random.default_rng(seed)
    for _ in range(epochs):
        order = rng.permutation(streams)
        for start in range(0, streams - batch_size + 1, batch_size):
            rows = order[start:start + batch_size]
            params, opt_state, loss = step(params, opt_state, *(jnp.asarray(batch[k][rows])
                                                                 for k in ("ids", "attention_mask", "trained")))
            losses.append(float(loss))
            if log is not None:
                log(len(losses), losses[-1])
    return params, losses
