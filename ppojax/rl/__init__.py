"""The reinforcement-learning program: types, actor-critic forwards, the KV-cache samplers (padded and
continuous batching), rewards, rollout, update, optimizer, and `program`: rollout + update as ONE jitted
`train_step`."""
