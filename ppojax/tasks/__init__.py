"""Built-in tasks: verifiable rewards (answer checkers, format rewards) and the offline datasets they score.

Plain Python (no JAX): the trainer resolves reward names here (``BUILTIN_REWARDS``) before any model loads.
"""
