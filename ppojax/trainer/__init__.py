"""From a config to a finished run: ``config`` (TRL's names, validation), ``build`` (config -> a Run), ``loop``
(train_step + hooks), ``ppo_trainer`` (PPOTrainer), ``legacy`` (TRL <= 0.11's generate()/step()), ``data``,
``plan`` (ahead-of-time compiles), ``cli`` (the ``ppojax`` command)."""
