"""``StepSettings``: the static description the compiled PPO programs are traced from.

It is the config's static fields (``PPOConfig.static_settings()``: every field whose value shapes a
program, read as attributes: ``settings.gamma``, ``settings.response_length``) plus the few values the build
derives from the models, the tokenizer and the mesh (token ids, the number of updates, batch sizes, logits
chunk sizes). Hashable, so it is a ``jax.jit`` static argument: equal settings reuse a compiled program.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional

from ppojax.rl import forward


@dataclass(frozen=True)
class StepSettings:
    """config: the config's static view; the other fields are derived (see the module docstring).

    batch_size / mini_batch_size / micro_batch_size: global rows per rollout / optimizer step / forward-
    backward (``PPOConfig.derived``). update_logits_chunk / rollout_logits_chunk: response positions per
    float32 logits chunk in the loss and in the rollout forwards (None = all at once).
    """

    config: Any
    num_updates: int
    pad_token_id: int
    stop_token_id: Optional[int]
    eos_token_id: Optional[int]
    batch_size: int
    mini_batch_size: int
    micro_batch_size: int
    update_logits_chunk: Optional[int] = None
    rollout_logits_chunk: Optional[int] = None

    def __getattr__(self, name):
        # Only reached when the dataclass has no such field: read the config's static field.
        if name == "config":
            raise AttributeError(name)
        return getattr(self.config, name)

    @property
    def steps_per_update(self) -> int:
        """Optimizer steps of one PPO iteration."""
        return self.num_ppo_epochs * self.num_mini_batches

    def replace(self, **changes) -> "StepSettings":
        """New settings with derived fields and/or config fields changed (e.g. ``temperature=0.01``)."""
        own = {f.name for f in dataclasses.fields(self)}
        config_changes = {k: v for k, v in changes.items() if k not in own}
        derived = {k: v for k, v in changes.items() if k in own}
        if config_changes:
            derived["config"] = dataclasses.replace(self.config, **config_changes)
        return dataclasses.replace(self, **derived)

    @classmethod
    def from_config(cls, config, *, pad_token_id: int, num_updates: int = 1, stop_token_id: Optional[int] = None,
                    eos_token_id: Optional[int] = None, data_parallel_size: int = 1,
                    vocab_size: Optional[int] = None) -> "StepSettings":
        """Settings for ``config`` (a PPOConfig). ``vocab_size`` sizes the logits chunks when the config's
        ``logits_chunk_size`` is None (see :func:`ppojax.rl.forward.auto_chunk_size`)."""
        sizes = config.derived(data_parallel_size)
        update_chunk = rollout_chunk = config.logits_chunk_size
        if update_chunk is None and vocab_size is not None:
            micro_rows = -(-sizes.micro_batch_size // data_parallel_size)
            forward_rows = -(-(config.local_rollout_forward_batch_size or sizes.batch_size) // data_parallel_size)
            update_chunk = forward.auto_chunk_size(micro_rows, config.response_length, vocab_size)
            rollout_chunk = forward.auto_chunk_size(forward_rows, config.response_length, vocab_size)
        return cls(config=config.static_settings(), num_updates=num_updates, pad_token_id=pad_token_id,
                   stop_token_id=stop_token_id, eos_token_id=eos_token_id, batch_size=sizes.batch_size,
                   mini_batch_size=sizes.mini_batch_size, micro_batch_size=sizes.micro_batch_size,
                   update_logits_chunk=update_chunk, rollout_logits_chunk=rollout_chunk)
