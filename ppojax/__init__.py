"""ppojax: PPO for language models (RLHF) as pure, jitted JAX/Flax functions, with TRL's semantics."""
from ppojax.trainer.config import PPOConfig

__all__ = ["PPOConfig", "PPOTrainer"]
__version__ = "0.1.0"


def __getattr__(name):  # PPOTrainer pulls in the models; import it only when asked for
    if name == "PPOTrainer":
        from ppojax.trainer.ppo_trainer import PPOTrainer
        return PPOTrainer
    raise AttributeError(f"module 'ppojax' has no attribute {name!r}")
