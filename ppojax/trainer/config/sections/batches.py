"""The batches section: the update's batch sizes, how a batch is split and laid out in memory, and the PPO
epochs over it.

Batch sizes (global, over all devices and hosts):
    batch_size        prompts per rollout = one PPO update
                      (default: per_device_train_batch_size * gradient_accumulation_steps
                                * num_mini_batches * data-parallel world size, as TRL)
    mini_batch_size   batch_size / num_mini_batches: one optimizer step each
    micro_batch_size  mini_batch_size / gradient_accumulation_steps: one forward/backward each

Derived sizes are computed by ``PPOConfig.derived``, never stored twice.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ppojax.trainer.config.fields import MAY_CHANGE, MUST_MATCH, at_least, one_of, setting


@dataclass
class BatchSettings:
    """The update's batch sizes, splits and memory layout."""

    per_device_train_batch_size: int = setting(8, static=True, on_resume=MUST_MATCH, rule=at_least(1))
    """TRL's micro-batch per data-parallel device; ignored when batch_size is set."""
    batch_size: Optional[int] = setting(None, static=True, on_resume=MUST_MATCH, rule=at_least(1))
    """Global episodes (sampled responses) per update: batch_size / num_generations prompts. None derives it
    as TRL does (see the module docstring)."""
    gradient_accumulation_steps: int = setting(1, static=True, on_resume=MUST_MATCH, rule=at_least(1))
    """Micro-batches whose gradients are summed into one optimizer step (splits each mini-batch)."""
    num_mini_batches: int = setting(1, static=True, on_resume=MUST_MATCH, rule=at_least(1))
    """Optimizer steps per PPO epoch: each update's batch is split into this many mini-batches."""
    local_rollout_forward_batch_size: Optional[int] = setting(None, static=True, on_resume=MAY_CHANGE,
                                                              rule=at_least(1))
    """Rows per forward pass in the rollout's reference/value/reward forwards (None: the whole batch); must
    divide the batch."""
    behaviour_logprobs: str = setting("forward", static=True, on_resume=MAY_CHANGE,
                                      rule=one_of("forward", "sampler"))
    """Where the rollout's behaviour log-probs (the PPO ratio's denominator) come from: 'forward' (a policy
    forward over the sampled sequences, the same computation as the loss's, so the first epoch's ratio is 1)
    or 'sampler' (each token's log-prob taken from the decode loop's logits, as TRL does: no policy forward
    in the rollout when the value model is separate or there is none; the two agree to float rounding)."""
    padding_free: bool = setting(False, static=True, on_resume=MAY_CHANGE)
    """Run the rollout's forwards (log-probs, values, a reward model) and the update's forwards and backward on
    packed rows: each sequence's real tokens (prompt and response, no padding) side by side in rows of
    max_prompt_length + response_length slots, attention kept within each sequence, and only as many packed
    micro-batches as the real tokens fill. Losses, gradients and metrics are the padded run's (to float
    rounding); only the time changes (docs/packing.md)."""
    max_tokens_per_micro_batch: Optional[int] = setting(None, static=True, on_resume=MAY_CHANGE, rule=at_least(1))
    """With padding_free: token slots per device per packed micro-batch (a multiple of max_prompt_length +
    response_length; the rows it holds bound the activation memory). None: a padded micro-batch's rows (the
    rollout's forwards: local_rollout_forward_batch_size rows when set)."""
    packed_row_length: Optional[int] = setting(None, static=True, on_resume=MAY_CHANGE, rule=at_least(1))
    """With padding_free: slots per packed row in the update's and the rollout's policy, reference and value
    forwards (None: max_prompt_length + response_length, a padded row). Longer rows let sequences longer than half
    a padded row share one (at a padded row's length they never do); XLA's attention of a row still spans the
    whole row, TPUs' skips the blocks of other sequences (docs/packing.md). A reward model's forward keeps rows of a
    padded row's length."""
    shared_prompt_forward: bool = setting(False, static=True, on_resume=MAY_CHANGE)
    """Run each prompt once for its num_generations samples in the policy's and the reference's forwards (the
    rollout's and the update's): the prompt's keys and values are computed once and every sample's response
    attends to them, so a forward's matmuls cover prompts/num_generations + responses instead of every row's
    prompt and response. Results equal the padded forward's to float rounding; the update's mini-batches then
    hold whole groups (shuffled group by group). Pays when prompts are long against responses (a tool schema, a
    few-shot prompt); needs num_generations >= 2 and the padded rows (not padding_free) (docs/packing.md)."""
    shared_prompt_prefix: bool = setting(False, static=True, on_resume=MAY_CHANGE)
    """Run the tokens every prompt starts with (a system message, a tool's schema: the run finds them in its
    prompts, train and held-out) through the model once for all: the sampler's prefill (the samplers without
    continuous batching, and every agent run's) copies their keys and values into each row, and the policy's and
    the reference's padded forwards in the rollout and the update let every prompt's rest attend to them. Results
    equal the plain forwards' to float rounding. Pays when the shared start is long against each prompt's own
    tokens; not for models with sliding-window attention (docs/packing.md)."""
    logits_chunk_size: Optional[int] = setting(None, static=True, on_resume=MAY_CHANGE, rule=at_least(1))
    """Response positions per float32 logits chunk in log-prob computations (bounds [rows, chunk, vocab]
    memory). None: all positions at once when a micro-batch's logits fit in 256 MB per device, else the
    largest chunk that fits (chunks are recomputed in the backward pass instead of stored)."""
    num_ppo_epochs: int = setting(4, static=True, on_resume=MAY_CHANGE, rule=at_least(1))
    """Passes over each rollout batch per update."""


def packing_problems(c) -> list[str]:
    """What is wrong with a config's packing settings (padding_free and what sizes its rows), each with its fix."""
    out = []
    for name, what in (("max_tokens_per_micro_batch", "the budget sizes packed micro-batches"),
                       ("packed_row_length", "it sizes packed rows")):
        if getattr(c, name) is not None and not c.padding_free:
            out.append(f"{name}={getattr(c, name)} is set but padding_free is off ({what}); set padding_free: true "
                       f"or remove {name}.")
    row = c.max_prompt_length + c.response_length
    padded_row = (f"max_prompt_length {c.max_prompt_length} + response_length {c.response_length} = {row} slots, "
                  "which a single sequence may fill")
    longer_rows = c.packed_row_length is not None and c.packed_row_length >= row
    if c.padding_free and c.packed_row_length is not None and not longer_rows:
        out.append(f"packed_row_length={c.packed_row_length} is below a padded row ({padded_row}); set it to at "
                   f"least {row}, e.g. {2 * row}, or remove it.")
    packed_row = c.packed_row_length if longer_rows else row
    if c.padding_free and c.max_tokens_per_micro_batch is not None and c.max_tokens_per_micro_batch < packed_row:
        size = f"packed_row_length={packed_row}" if longer_rows else padded_row
        out.append(f"max_tokens_per_micro_batch={c.max_tokens_per_micro_batch} is below one packed row ({size}); "
                   f"set it to at least {packed_row}, e.g. {4 * packed_row}.")
    if c.top_entropy_quantile < 1 and c.padding_free:
        out.append(f"top_entropy_quantile={c.top_entropy_quantile} picks tokens by a micro-batch's entropy "
                   "quantile, and padding_free's packed micro-batches hold other rows than the padded ones; set "
                   "padding_free: false or top_entropy_quantile: 1.0.")
    return out


def shared_prompt_problems(c, micro_batch_size: Optional[int]) -> list[str]:
    """What stops ``shared_prompt_forward`` from running each group's prompt once, each with its fix
    (``micro_batch_size``: the derived one, None where the sizes did not derive)."""
    if not c.shared_prompt_forward:
        return []
    g = c.num_generations
    if g < 2:
        return [f"shared_prompt_forward=True runs each prompt once for its samples, but num_generations={g} "
                "samples each prompt once; set num_generations >= 2 or shared_prompt_forward: false."]
    out = []
    if c.padding_free:
        out.append("shared_prompt_forward=True and padding_free=True: the packed rows run every sequence's prompt "
                   "with it; keep one of them (shared_prompt_forward pays where prompts are long, padding_free "
                   "where responses vary in length).")
    for name, rows in (("micro_batch_size", micro_batch_size),
                       ("local_rollout_forward_batch_size", c.local_rollout_forward_batch_size)):
        if rows is not None and rows % g:
            out.append(f"shared_prompt_forward=True needs whole groups in every forward, but {name}={rows} is not "
                       f"a multiple of num_generations={g}; make it one (e.g. {max(g, rows - rows % g)}) or set "
                       "shared_prompt_forward: false.")
    return out
