"""ppojax: PPO for language models (RLHF) as pure, jitted JAX/Flax functions, with TRL's semantics."""
from ppojax.backends import skip_absent_tpu
from ppojax.trainer.config import PPOConfig

# libtpu installed (the tpu extra) on a host without TPU chips: keep JAX from starting it (and printing its
# initialisation errors) in any program that imports ppojax before its first JAX operation
skip_absent_tpu()

__all__ = ["PPOConfig", "PPOTrainer"]
__version__ = "0.1.0"


def __getattr__(name):  # PPOTrainer pulls in the models; import it only when asked for
    if name == "PPOTrainer":
        from ppojax.trainer.ppo_trainer import PPOTrainer  # noqa: PLC0415 - `import ppojax` loads no JAX; PPOTrainer on first use
        return PPOTrainer
    raise AttributeError(f"module 'ppojax' has no attribute {name!r}")
