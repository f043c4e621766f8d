"""From a config to a finished run: ``config`` (TRL's names, validation), ``build`` (config -> a Run), ``loop``
(train_step + hooks), ``ppo_trainer`` (PPOTrainer), ``legacy`` (TRL <= 0.11's generate()/step()), ``data``,
``plan`` (ahead-of-time compiles), ``warm_start`` (supervised steps on written episodes before RL), ``cli`` (the
``ppojax`` command)."""
