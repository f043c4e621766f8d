"""The reinforcement-learning program: types, actor-critic forwards, the KV-cache sampler, rewards,
rollout, update, optimizer, and `program`: rollout + update as ONE jitted `train_step`."""
