"""KL-coefficient controllers and legacy score processing as pure ``state -> state`` functions."""
import jax.numpy as jnp
from flax import struct


# ---- KL controllers (docs/algorithm.md, "KL controllers": fixed, or adaptive after Ziegler et al. 2019) ----

def fixed_kl_update(kl_coef, current_kl, n_steps):
    """The fixed controller: the coefficient never moves."""
    del current_kl, n_steps
    return kl_coef


def adaptive_kl_update(kl_coef, current_kl, n_steps, target, horizon):
    """kl_coef * (1 + clip(kl / target - 1, -0.2, 0.2) * n_steps / horizon).

    current_kl: mean per-sequence KL of the update; n_steps: prompts in the update.
    """
    proportional_error = jnp.clip(current_kl / target - 1.0, -0.2, 0.2)
    return kl_coef * (1.0 + proportional_error * n_steps / horizon)


# ---- Running moments for legacy score scaling / normalisation ----

@struct.dataclass
class RunningMoments:
    """Running mean/std of all scores seen (Chan et al. parallel update). Starts at mean 0, std 1."""

    mean: jnp.ndarray
    std: jnp.ndarray
    var: jnp.ndarray
    count: jnp.ndarray

    @classmethod
    def create(cls):
        f32 = lambda v: jnp.asarray(v, jnp.float32)  # noqa: E731
        return cls(mean=f32(0.0), std=f32(1.0), var=f32(1.0), count=f32(1e-24))


def update_running_moments(moments: RunningMoments, scores):
    """Fold a batch of scores f32[B] into the moments. Returns (new moments, batch mean, batch std)."""
    n = jnp.asarray(scores.size, jnp.float32)
    batch_mean = jnp.mean(scores)
    batch_var = jnp.mean(jnp.square(scores - batch_mean))  # biased, as TRL's torch.var_mean(unbiased=False)
    delta = batch_mean - moments.mean
    total = moments.count + n
    old_sum = moments.var * moments.count + jnp.square(delta) * moments.count * n / total
    new_var = (old_sum + batch_var * n) / total
    new = RunningMoments(
        mean=moments.mean + delta * n / total,
        std=jnp.sqrt(new_var * total / (total - 1.0)),
        var=new_var,
        count=total,
    )
    return new, batch_mean, jnp.sqrt(batch_var * n / (n - 1.0))


def process_scores(scores, moments: RunningMoments, *, use_score_scaling=False, use_score_norm=False,
                   score_clip=None):
    """Legacy score processing: optional running scaling (and normalisation), then clipping.

    scores: f32[B]. Returns (scores, new moments). ``use_score_norm`` only acts with scaling on.
    """
    if use_score_scaling:
        moments, _, _ = update_running_moments(moments, scores)
        scale = moments.std + jnp.finfo(scores.dtype).eps
        scores = (scores - moments.mean) / scale if use_score_norm else scores / scale
    if score_clip is not None:
        scores = jnp.clip(scores, -score_clip, score_clip)
    return scores, moments
