"""The optimizer section: AdamW, its learning-rate schedule and gradient clipping."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ppojax.trainer.config.fields import MAY_CHANGE, above, at_least, between, one_of, setting


@dataclass
class OptimizerSettings:
    """AdamW and its schedule (policy and value model alike, unless the critic has a learning rate of its own)."""

    learning_rate: float = setting(3e-6, static=False, on_resume=MAY_CHANGE, rule=at_least(0))
    """Peak learning rate of AdamW (policy and value model); a traced value of the state (``Hyperparams``)."""
    critic_learning_rate: Optional[float] = setting(None, static=True, on_resume=MAY_CHANGE, rule=at_least(0))
    """The critic's own peak learning rate (the value head, or the separate value model's trainable weights;
    OpenRLHF's critic_learning_rate, verl's critic.optim.lr), on the same schedule; None: learning_rate, as TRL.
    A linear value head reads hidden states whose entries add up to hundreds in absolute value, so an Adam step
    at a LoRA-sized learning_rate moves its values by about as much as the rewards' whole range; 0 freezes the
    critic."""
    lr_scheduler_type: str = setting("linear", static=True, on_resume=MAY_CHANGE, rule=one_of("linear", "constant"))
    """'linear' (to 0 over the updates, as TRL) or 'constant'."""
    warmup_steps: int = setting(0, static=True, on_resume=MAY_CHANGE, rule=at_least(0))
    """Updates of linear learning-rate warmup (the schedule steps once per update, as TRL's PPO)."""
    max_grad_norm: Optional[float] = setting(None, static=True, on_resume=MAY_CHANGE, rule=above(0))
    """Clip the global gradient norm (None: off, as TRL's PPO)."""
    adam_beta1: float = setting(0.9, static=True, on_resume=MAY_CHANGE, rule=between(0, 1, open_high=True))
    """AdamW's first-moment decay."""
    adam_beta2: float = setting(0.999, static=True, on_resume=MAY_CHANGE, rule=between(0, 1, open_high=True))
    """AdamW's second-moment decay."""
    adam_epsilon: float = setting(1e-8, static=True, on_resume=MAY_CHANGE, rule=above(0))
    """AdamW's epsilon (added to the second-moment root)."""
    weight_decay: float = setting(0.0, static=True, on_resume=MAY_CHANGE, rule=at_least(0))
    """AdamW's decoupled weight decay."""
    optimizer_implementation: str = setting("auto", static=True, on_resume=MAY_CHANGE, rule=one_of("auto", "optax"))
    """How AdamW's step runs: 'auto' (in one pass over each parameter, reading the parameter, its gradient and
    moments once and writing them in place, through a handler ppojax builds with the system's g++ (Linux x86-64),
    for float32 parameters on a single CPU device; optax's elsewhere) or 'optax' (optax's transformations, which
    XLA:CPU runs as three passes). The same arithmetic; XLA fuses some multiply-adds, so the two agree to a few
    units in the last place."""
