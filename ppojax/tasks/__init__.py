"""Built-in tasks: verifiable rewards (answer checkers, format rewards) and the offline datasets they score.

Plain Python (no JAX): a config names these rewards without a module (its ``BUILTIN_REWARDS``), and the trainer
resolves the names to the functions here before any model loads (``ppojax.trainer.run_rewards``).
"""
