"""PPOConfig's fields, one module per concern, each section a dataclass whose fields are declared with
``setting(...)`` (ppojax.trainer.config.fields) and described by the docstring under each.
``ppojax.trainer.config.schema.SECTIONS`` combines the sections in the order ``ppojax train --help`` lists them.

    models.py     the policy, reward models and functions, the value model, precision, kernels; LoRA adapters
    data.py       prompts: datasets, prompt column and length, held-out prompts
    run.py        where a run writes, its seed and length; logging, samples, checkpoints, resuming, exports
    batches.py    batch sizes, how a batch is split and laid out, PPO epochs per update
    optimizer.py  AdamW, its learning-rate schedule and gradient clipping
    objective.py  the policy and value losses, advantage estimators, KL penalties, score shaping
    offpolicy.py  off-policy corrections: behaviour importance weights, off-policy sequence masking
    asynchronous.py  asynchronous RL: how many updates the rollout may run ahead of the update
    sampling.py   the rollout's sampling: response length, temperature, stop tokens, decode loop
    agents.py     tools and environments for multi-turn episodes, and the sizes of their turns
    mesh.py       the device mesh

Adding a field: declare it in the section of its concern (its docstring is its ``--help`` text and its row in
docs/configuration.md: regenerate that file). A check that involves other fields goes to
``ppojax.trainer.config.checks``; the names TRL or verl give it, when they differ, to
``ppojax.trainer.config.names``. A new concern is a new module here with its section, added to ``SECTIONS`` where
its fields should be listed.
"""
