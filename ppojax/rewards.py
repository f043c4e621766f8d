"""Python reward sources for the rollout, and the validation of what they return.

A reward function is any callable `f(prompts: list[str], completions: list[str]) -> Sequence[float]` that
returns one finite score per (prompt, completion) pair (SPEC "Rollout" step 7). The rollout calls it on the
host through `call_reward_function`, which turns every way it can go wrong into an error that names the
function and the offending row, before any of it reaches the jitted update.

Built in: `vader_sentiment_reward()`, VADER's compound sentiment score in [-1, 1] (the movie-review demo).
"""

from __future__ import annotations

from typing import Protocol, Sequence, runtime_checkable

import numpy as np

__all__ = [
    "RewardFunction",
    "RewardFunctionError",
    "vader_sentiment_reward",
    "call_reward_function",
    "check_scores",
    "reward_function_name",
]


@runtime_checkable
class RewardFunction(Protocol):
    """`f(prompts, completions) -> Sequence[float]`: one score per pair, higher is better.

    prompts:     list[str], B prompt texts (decoded from the left-padded prompt tokens, special tokens skipped).
    completions: list[str], B completion texts (the response truncated after the stop token, special tokens
                 skipped).
    returns:     B finite numbers (list, tuple, numpy or jax array).
    """

    def __call__(self, prompts: list[str], completions: list[str]) -> Sequence[float]: ...


class RewardFunctionError(ValueError):
    """A reward function raised, or returned something other than B finite numbers."""


def reward_function_name(fn) -> str:
    """A readable name for error messages: `module.qualname`, or the repr for other callables."""
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None)
    if name is None:  # a callable object, or a functools.partial
        inner = getattr(fn, "func", None)
        if inner is not None:
            return f"partial({reward_function_name(inner)})"
        return type(fn).__qualname__ + " instance"
    module = getattr(fn, "__module__", None)
    return f"{module}.{name}" if module and module not in ("__main__", "builtins") else name


def vader_sentiment_reward(*, include_prompt: bool = False) -> RewardFunction:
    """VADER's compound sentiment score in [-1, 1] as the reward (Hutto & Gilbert 2014; `vaderSentiment`).

    By default only the COMPLETION is scored: the prompt is fixed by the dataset, so its sentiment would only
    add per-prompt noise the policy cannot change (a review opening such as "a gorgeous, witty, seductive
    movie" already scores high). `include_prompt=True` scores `prompt + completion`, as TRL's sentiment
    example scores query + response. Examples: "The movie was wonderful and the acting was great." → 0.832,
    "The movie was boring and awful." → -0.649, "The movie was a movie." → 0.0. About 0.1 ms a text.
    """
    try:
        from vaderSentiment.vaderSentiment import SentimentIntensityAnalyzer
    except ImportError as err:
        raise ImportError(
            "vader_sentiment_reward needs the vaderSentiment package: `pip install vaderSentiment==3.3.2`"
        ) from err
    analyzer = SentimentIntensityAnalyzer()

    def vader_sentiment(prompts: list[str], completions: list[str]) -> list[float]:
        texts = [p + c for p, c in zip(prompts, completions)] if include_prompt else completions
        return [float(analyzer.polarity_scores(t)["compound"]) for t in texts]

    vader_sentiment.__qualname__ = f"vader_sentiment_reward(include_prompt={include_prompt})"
    return vader_sentiment


def check_scores(scores, n: int, *, name: str = "reward function", prompts: Sequence[str] | None = None,
                 allow_nonfinite: bool = False) -> np.ndarray:
    """Validate what a reward function returned → float32[n].

    Errors (RewardFunctionError): not a 1-D sequence of numbers; a length other than `n` (naming both);
    any NaN/inf, before or after the cast to float32 (naming the prompt index, its value and, when `prompts`
    is given, the prompt text), unless `allow_nonfinite` (PPOConfig ``on_nonfinite_reward='skip'``: the
    NaN/inf goes through, and the update's non-finite guard skips that update's optimizer steps).
    """
    try:
        if scores is None or isinstance(scores, (str, bytes, int, float)):
            raise TypeError("not a sequence")
        values = np.asarray(scores, dtype=np.float64)
    except (TypeError, ValueError) as err:
        raise RewardFunctionError(
            f"{name} returned {type(scores).__name__} {_preview(scores)}, which is not a sequence of numbers; "
            f"it must return {n} floats, one per (prompt, completion)."
        ) from err
    if values.ndim == 2 and values.shape[1:] == (1,):
        values = values[:, 0]
    if values.ndim != 1:
        raise RewardFunctionError(
            f"{name} returned an array of shape {values.shape}; expected shape ({n},): one float per "
            "(prompt, completion)."
        )
    if values.shape[0] != n:
        raise RewardFunctionError(
            f"{name} returned {values.shape[0]} scores for {n} prompts; expected {n}, one per (prompt, completion)."
        )
    with np.errstate(over="ignore", invalid="ignore"):
        out = values.astype(np.float32)
    if allow_nonfinite:
        return out
    bad = np.flatnonzero(~np.isfinite(out))
    if bad.size:
        i = int(bad[0])
        where = f"prompt index {i}" + (f" ({prompts[i]!r})" if prompts is not None else "")
        extra = f" (and {bad.size - 1} more)" if bad.size > 1 else ""
        overflow = " (overflows float32)" if np.isfinite(values[i]) else ""
        raise RewardFunctionError(
            f"{name} returned {float(values[i])!r}{overflow} for {where}{extra}; scores must be finite numbers."
        )
    return out


def call_reward_function(fn, prompts: Sequence[str], completions: Sequence[str], *,
                         allow_nonfinite: bool = False) -> np.ndarray:
    """Call `fn(prompts, completions)` and validate the result → float32[B] (B = len(prompts)).

    An exception inside `fn` becomes a RewardFunctionError naming the function and chained to the original
    (`raise ... from`, so its traceback is kept); the result goes through `check_scores` (`allow_nonfinite`:
    NaN/inf scores are returned instead of raising).
    """
    if len(prompts) != len(completions):
        raise ValueError(f"{len(prompts)} prompts but {len(completions)} completions; they must pair up")
    name = f"reward function {reward_function_name(fn)}"
    try:
        scores = fn(list(prompts), list(completions))
    except Exception as err:  # noqa: BLE001 - re-raised with context
        raise RewardFunctionError(f"{name} raised {type(err).__name__}: {err}") from err
    return check_scores(scores, len(prompts), name=name, prompts=prompts, allow_nonfinite=allow_nonfinite)


def _preview(value, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
