"""The trainer in three parts: ``build`` (config -> a Run), ``loop`` (train_step + hooks), ``legacy``
(TRL <= 0.11's generate()/step())."""
