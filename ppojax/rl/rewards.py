"""Python reward sources for the rollout, and the validation of what they return.

A reward function is any callable `f(prompts: list[str], completions: list[str]) -> Sequence[float]` that
returns one finite score per (prompt, completion) pair (docs/algorithm.md, "Rollout", step 7).
The rollout calls it on the host through `call_reward_function`, which turns every way it can go wrong into an error
that names the function and the offending row, before any of it reaches the jitted update.

Built in: `vader_sentiment_reward()`, VADER's compound sentiment score in [-1, 1] (the movie-review demo).

Reward SOURCES (one class per kind) give a rollout's scores inside the compiled PPO program:
`ModelScores` (a reward ScoreModel's forward, nothing leaves the device), `FunctionScores` (a Python function of
the texts, reached through a host callback, the tokenizer's decode on the host), `TracedScores` (a reward written
in JAX on the token ids, traced into the program) and `GivenScores` (the legacy
`step()`: scores computed by the caller). Each has `scores(frozen, queries, responses) -> (scores f32[B],
failures i32[])`; `failures` counts rows whose reward could not be computed (the function raised or returned
something invalid), which the training loop turns back into the function's own error after the step.
"""

from __future__ import annotations

import threading
from typing import Any, Protocol, Sequence, runtime_checkable

import numpy as np

from ppojax.errors import RewardFunctionError

__all__ = [
    "RewardFunction",
    "RewardFunctionError",
    "vader_sentiment_reward",
    "call_reward_function",
    "check_scores",
    "reward_function_name",
    "decode_rollout_text",
    "ModelScores",
    "FunctionScores",
    "TracedScores",
    "GivenScores",
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
    text = _first_text(scores)
    if text is not None:
        i, value = text
        raise RewardFunctionError(
            f"{name} returned text, {_preview(value)} for prompt index {i} ({type(scores).__name__} "
            f"{_preview(scores)}); scores must be numbers, not strings: return float(...) of each, {n} per call."
        )
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


def _first_text(scores):
    """(index, value) of the first string that reads as a number among ``scores`` (a sequence, or a sequence of
    1-element rows), or None. numpy would read "0.25" as 0.25: a reward function that returns numbers as text has a
    bug, which is said, not hidden."""
    if isinstance(scores, (str, bytes)) or scores is None:
        return None  # not a sequence: said as such by the checks that follow
    if hasattr(scores, "dtype"):  # an array: text only in numpy's string and object arrays
        if np.dtype(scores.dtype).kind not in "OSU":
            return None
        scores = np.asarray(scores).reshape(-1).tolist()
    try:
        rows = list(scores)
    except TypeError:
        return None
    for i, row in enumerate(rows):
        for value in (row if isinstance(row, (list, tuple)) else (row,)):
            if isinstance(value, (str, bytes)) and _reads_as_a_number(value):
                return i, value
    return None  # text that is no number: "not a sequence of numbers", said by the checks that follow


def _reads_as_a_number(text) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


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


# ------------------------------------------------------------------------------------------ reward sources


def decode_rollout_text(tokenizer, queries, responses, pad_token_id):
    """Prompt and completion strings for a reward function (host side).

    queries: int[B, P], responses: int[B, R] TRUNCATED. Pad ids are dropped, and the completion stops at
    its first pad; special tokens (the stop token included) are skipped. -> (prompts, completions).
    """
    queries, responses = np.asarray(queries), np.asarray(responses)
    prompt_ids = [[int(t) for t in row if t != pad_token_id] for row in queries]
    completion_ids = []
    for row in responses:
        pads = np.flatnonzero(row == pad_token_id)
        completion_ids.append([int(t) for t in row[:pads[0] if pads.size else len(row)]])
    prompts = tokenizer.batch_decode(prompt_ids, skip_special_tokens=True)
    completions = tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
    return list(prompts), list(completions)


class ModelScores:
    """Scores from a reward ScoreModel (TRL's ``get_reward``): its head at the last non-pad token of the
    prompt + TRUNCATED response. The parameters are ``frozen["reward"]`` of the train state.

    graphdef: the ScoreModel's graphdef; forward_batch_size: rows per forward (None = all at once).
    """

    in_program = True

    def __init__(self, graphdef, pad_token_id: int, forward_batch_size=None):
        self.graphdef, self.pad_token_id, self.forward_batch_size = graphdef, pad_token_id, forward_batch_size

    def scores(self, frozen, queries, responses):
        """queries i32[B, P], responses i32[B, R] (truncated) -> (scores f32[B], failures i32[] = 0)."""
        import jax.numpy as jnp
        from flax import nnx

        from ppojax.rl import forward

        tokens = jnp.concatenate([queries, responses], axis=1)
        P = queries.shape[1]
        scores = forward.map_batch(
            lambda t: forward.sequence_scores(nnx.merge(self.graphdef, frozen["reward"]), t, self.pad_token_id,
                                              prompt_length=P),
            self.forward_batch_size, tokens)
        return scores, jnp.zeros((), jnp.int32)


class TracedScores:
    """A reward written in JAX: ``fn(queries i32[B, P], responses i32[B, R]) -> f32[B]``, traced into the
    program like a reward model (nothing leaves the device), so whole runs can be ``lax.scan``-ed and
    ``jax.vmap``-ed. ``responses`` are truncated (pad after the stop token)."""

    in_program = True

    def __init__(self, fn):
        self.fn = fn

    def scores(self, frozen, queries, responses):
        import jax.numpy as jnp

        return jnp.asarray(self.fn(queries, responses), jnp.float32), jnp.zeros((), jnp.int32)


class GivenScores:
    """The caller's scores (legacy ``step(queries, responses, scores)``): ``scores`` f32[B], traced."""

    in_program = True

    def __init__(self, scores):
        self.given = scores

    def scores(self, frozen, queries, responses):
        import jax.numpy as jnp

        return jnp.asarray(self.given, jnp.float32), jnp.zeros((), jnp.int32)


class FunctionScores:
    """A Python reward function ``fn(prompts, completions) -> floats`` inside the compiled program.

    ``scores()`` reaches the host through ``jax.pure_callback``: the tokenizer decodes the prompt and
    completion ids there, :func:`call_reward_function` calls and validates ``fn``. On a mesh the callback runs
    once per device on that device's rows (``shard_map``), so every process scores its own rows, as TRL's
    processes do. A failure (``fn`` raised, returned the wrong number of scores or, unless
    ``allow_nonfinite``, a NaN/inf) never raises inside the program: those rows get NaN (so the update's
    non-finite guard skips every optimizer step of the iteration), ``failures`` counts them, and the error is
    kept; :meth:`raise_pending` re-raises it after the step.

    mesh: the device mesh of the program (None: one device). Host-side use: :meth:`host_scores`.
    """

    in_program = True
    may_fail = True  # the program skips its update when failures > 0

    def __init__(self, fn, tokenizer, pad_token_id: int, *, allow_nonfinite: bool = False, mesh=None):
        self.fn, self.tokenizer, self.pad_token_id = fn, tokenizer, pad_token_id
        self.allow_nonfinite, self.mesh = allow_nonfinite, mesh
        self._errors: list[BaseException] = []
        self._lock = threading.Lock()

    @property
    def name(self) -> str:
        return f"reward function {reward_function_name(self.fn)}"

    def host_scores(self, queries, responses) -> np.ndarray:
        """Host side: decode, call ``fn``, validate -> float32[B]. Raises ``RewardFunctionError``."""
        prompts, completions = decode_rollout_text(self.tokenizer, queries, responses, self.pad_token_id)
        return call_reward_function(self.fn, prompts, completions, allow_nonfinite=self.allow_nonfinite)

    def _callback(self, queries, responses):
        try:
            return self.host_scores(queries, responses), np.zeros(len(queries), np.int32)
        except Exception as err:  # noqa: BLE001 - kept and re-raised by raise_pending() after the step
            with self._lock:
                self._errors.append(err)
            return np.full(len(queries), np.nan, np.float32), np.ones(len(queries), np.int32)

    def scores(self, frozen, queries, responses):
        """queries i32[B, P], responses i32[B, R] (truncated) -> (scores f32[B], failures i32[])."""
        import jax
        import jax.numpy as jnp

        def call(q, r):
            shapes = (jax.ShapeDtypeStruct(q.shape[:1], jnp.float32), jax.ShapeDtypeStruct(q.shape[:1], jnp.int32))
            return jax.pure_callback(self._callback, shapes, q, r, vmap_method="sequential")

        if self.mesh is not None and self.mesh.size > 1:
            from ppojax.parallel.sharding import batch_partition_spec

            rows = batch_partition_spec(self.mesh)
            call = jax.shard_map(call, mesh=self.mesh, in_specs=(rows, rows), out_specs=(rows, rows))
        scores, failed = call(queries, responses)
        return scores, jnp.sum(failed)

    def raise_pending(self) -> None:
        """Re-raise the first kept failure (and forget them all); a no-op when there is none."""
        with self._lock:
            errors, self._errors = self._errors, []
        if errors:
            raise errors[0]
