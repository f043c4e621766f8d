"""Python reward sources for the rollout, and the validation of what they return.

A reward function is any callable `f(prompts: list[str], completions: list[str]) -> Sequence[float]` that
returns one finite score per (prompt, completion) pair (docs/algorithm.md, "Rollout", step 7).
The rollout calls it on the host through `call_reward_function`, which turns every way it can go wrong into an error
that names the function and the offending row, before any of it reaches the jitted update.

Built in: `vader_sentiment_reward()`, VADER's compound sentiment score in [-1, 1] (the movie-review demo).

Reward SOURCES give a rollout's scores inside the compiled PPO program; each is a `RewardSource` (the protocol
the program holds: what it computes, whether it can fail, how a failure comes back):
`ModelScores` (a reward ScoreModel's forward, nothing leaves the device), `FunctionScores` (Python functions of
the texts and the dataset's columns, reached through one host callback; ``ppojax.rl.reward_calls`` calls them),
`TracedScores` (a reward written in JAX on the token ids, traced into the program) and `GivenScores` (the legacy
`step()`: scores computed by the caller). `WeightedRewards` combines several (TRL's ``reward_funcs`` with
``reward_weights``).
"""

from __future__ import annotations

import threading
from typing import Any, NamedTuple, Optional, Protocol, Sequence, runtime_checkable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import io_callback
from jax.sharding import PartitionSpec

from ppojax.errors import RewardFunctionError
from ppojax.parallel.rules import batch_partition_spec
from ppojax.rl import forward
from ppojax.rl.packed_rollout import packed_sequence_scores
from ppojax.rl.reward_calls import RewardBatch, RewardCall, call_all, none_to_nan, reward_function_name
from ppojax.rl.types import NO_ROW

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
    "WeightedRewards",
    "RewardOutput",
    "RewardSource",
    "ColumnTable",
    "NO_ROW",
    "PADDING_ROW",
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


def vader_sentiment_reward(*, include_prompt: bool = False) -> RewardFunction:
    """VADER's compound sentiment score in [-1, 1] as the reward (Hutto & Gilbert 2014; `vaderSentiment`).

    By default only the COMPLETION is scored: the prompt is fixed by the dataset, so its sentiment would only
    add per-prompt noise the policy cannot change (a review opening such as "a gorgeous, witty, seductive
    movie" already scores high). `include_prompt=True` scores `prompt + completion`, as TRL's sentiment
    example scores query + response. Examples: "The movie was wonderful and the acting was great." → 0.832,
    "The movie was boring and awful." → -0.649, "The movie was a movie." → 0.0. About 0.1 ms a text.
    """
    try:
        from vaderSentiment.vaderSentiment import SentimentIntensityAnalyzer  # noqa: PLC0415 - optional (demo extra)
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
                 allow_nonfinite: bool = False, allow_none: bool = False,
                 returned_nan_as_inf: bool = False) -> np.ndarray:
    """Validate what a reward function returned → float32[n].

    Errors (RewardFunctionError): not a 1-D sequence of numbers; a length other than `n` (naming both);
    any NaN/inf, before or after the cast to float32 (naming the prompt index, its value and, when `prompts`
    is given, the prompt text), unless `allow_nonfinite` (PPOConfig ``on_nonfinite_reward='skip'``: the
    NaN/inf goes through, and the update's non-finite guard skips that update's optimizer steps).
    `allow_none`: None entries (the reward does not apply to that row) come back as NaN; with
    `returned_nan_as_inf` a NaN the function itself returned comes back as +inf, so that summing rewards cannot
    mistake it for "does not apply".
    """
    missing = np.zeros(0, bool)
    if allow_none:
        scores, missing = none_to_nan(scores)
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
    given = ~missing if missing.size else np.ones(n, bool)
    if allow_nonfinite:
        return np.where(given & np.isnan(out), np.float32(np.inf), out) if returned_nan_as_inf else out
    bad = np.flatnonzero(given & ~np.isfinite(out))
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
PADDING_ROW = -2  # a row that only fills the batch to its compiled shape: not scored


class RewardOutput(NamedTuple):
    """What a reward source gives for B rows.

    scores: f32[B] (the weighted sum of the components); failures: i32[] rows that could not be scored;
    components: {reward name: f32[B]} each reward's own values (NaN where it does not apply).
    """

    scores: Any
    failures: Any
    components: dict


class ColumnTable:
    """The dataset's columns for the run's prompt table, row by row: what a Python reward receives as keyword
    arguments. columns: {name: N values}, row i of each belonging to prompt i of the prompt table."""

    def __init__(self, columns: dict):
        lengths = {len(v) for v in columns.values()}
        if len(lengths) > 1:
            raise ValueError(f"columns of different lengths: { {k: len(v) for k, v in columns.items()} }")
        self.columns = {name: list(values) for name, values in columns.items()}

    @property
    def names(self) -> list:
        return list(self.columns)

    def rows(self, indices: Sequence[int]) -> dict:
        """{name: values of the given rows}, or {} when any row is unknown (``NO_ROW``)."""
        indices = [int(i) for i in indices]
        if any(i < 0 for i in indices):
            return {}
        return {name: [values[i] for i in indices] for name, values in self.columns.items()}


def weighted_total(components, weights):
    """components f32[F, B] (NaN: does not apply), weights f32[F] -> f32[B]: sum over the components that apply
    (TRL's ``nansum``); NaN where none does. One component with weight 1 gives its values unchanged."""
    applies = ~jnp.isnan(components)
    total = jnp.sum(jnp.where(applies, weights[:, None] * components, 0.0), axis=0)
    return jnp.where(jnp.any(applies, axis=0), total, jnp.nan)


class RewardSource:
    """What a compiled PPO program scores its rollouts with (``PPOProgram.reward``): the protocol every source
    implements.

    - ``names``: its components (one per reward it sums), in order; each is logged as ``rewards/<name>/mean``.
    - ``components(frozen, queries, responses, rows, packed_rows)`` -> (f32[F, B] one row per name, NaN where that
      reward does not apply; failures i32[]): traced inside the program. queries i32[B, P], responses i32[B, R]
      (truncated after the stop token); frozen: the state's frozen models (a reward model reads ``"reward"``);
      rows i32[B]: the rows' places in the run's prompt table (``ColumnTable``; ``NO_ROW`` where unknown,
      ``PADDING_ROW`` for batch padding, not scored), through which Python rewards receive the dataset's columns;
      packed_rows: with ``padding_free``, the rows of a packed forward micro-batch (a source that runs a model
      may pack; the others ignore it).
    - ``scores(...)`` -> ``RewardOutput``: the components and their weighted sum (``weights``: all 1 here).
    - ``may_fail``: whether ``failures`` can be non-zero (rows whose reward could not be computed: a Python
      function raised or returned something invalid). A program skips the update of an iteration with failures,
      and the host then calls ``raise_pending()``, which re-raises the kept error (the function's own) once.
    """

    names: Sequence[str] = ()
    may_fail: bool = False

    @property
    def weights(self) -> tuple:
        return (1.0,) * len(self.names)

    def components(self, frozen, queries, responses, rows=None, packed_rows=None):
        raise NotImplementedError

    def scores(self, frozen, queries, responses, rows=None, packed_rows=None) -> RewardOutput:
        values, failures = self.components(frozen, queries, responses, rows, packed_rows)
        total = weighted_total(values, jnp.asarray(self.weights, jnp.float32))
        return RewardOutput(total, failures, dict(zip(self.names, values)))

    def raise_pending(self) -> None:
        """Re-raise the first error kept by a failed call (and forget them all); nothing for a source that cannot
        fail."""


def decode_rollout_text(tokenizer, queries, responses, pad_token_id, *, with_ids: bool = False):
    """Prompt and completion strings for a reward function (host side).

    queries: int[B, P], responses: int[B, R] TRUNCATED. Pad ids are dropped, and the completion stops at
    its first pad; special tokens (the stop token included) are skipped. -> (prompts, completions), and the
    completions' token ids (stop token and padding removed) with ``with_ids``.
    """
    queries, responses = np.asarray(queries), np.asarray(responses)
    prompt_ids = [[int(t) for t in row if t != pad_token_id] for row in queries]
    completion_ids = []
    for row in responses:
        pads = np.flatnonzero(row == pad_token_id)
        completion_ids.append([int(t) for t in row[:pads[0] if pads.size else len(row)]])
    prompts = list(tokenizer.batch_decode(prompt_ids, skip_special_tokens=True))
    completions = list(tokenizer.batch_decode(completion_ids, skip_special_tokens=True))
    if not with_ids:
        return prompts, completions
    special = set(getattr(tokenizer, "all_special_ids", None) or ())
    return prompts, completions, [[t for t in ids if t not in special] for ids in completion_ids]


class ModelScores(RewardSource):
    """Scores from a reward ScoreModel (TRL's ``get_reward``): its head at the last non-pad token of the
    prompt + TRUNCATED response. The parameters are ``frozen["reward"]`` of the train state.

    graphdef: the ScoreModel's graphdef; forward_batch_size: rows per forward (None = all at once);
    name: the reward's name in metrics.
    """

    def __init__(self, graphdef, pad_token_id: int, forward_batch_size=None, name: str = "reward_model"):
        self.graphdef, self.pad_token_id, self.forward_batch_size = graphdef, pad_token_id, forward_batch_size
        self.names = [name]

    def components(self, frozen, queries, responses, rows=None, packed_rows=None):
        """queries i32[B, P], responses i32[B, R] (truncated) -> (f32[1, B], failures i32[] = 0)."""
        tokens = jnp.concatenate([queries, responses], axis=1)
        P = queries.shape[1]
        if packed_rows is not None:
            scores = packed_sequence_scores(lambda: nnx.merge(self.graphdef, frozen["reward"]), tokens, P,
                                            self.pad_token_id, rows_per_micro=packed_rows)
            return scores[None].astype(jnp.float32), jnp.zeros((), jnp.int32)
        scores = forward.map_batch(
            lambda t: forward.sequence_scores(nnx.merge(self.graphdef, frozen["reward"]), t, self.pad_token_id,
                                              prompt_length=P),
            self.forward_batch_size, tokens)
        return scores[None].astype(jnp.float32), jnp.zeros((), jnp.int32)


class TracedScores(RewardSource):
    """A reward written in JAX: ``fn(queries i32[B, P], responses i32[B, R]) -> f32[B]``, traced into the
    program like a reward model (nothing leaves the device), so whole runs can be ``lax.scan``-ed and
    ``jax.vmap``-ed. ``responses`` are truncated (pad after the stop token)."""

    def __init__(self, fn, name: Optional[str] = None):
        self.fn = fn
        self.names = [name or getattr(fn, "__name__", None) or reward_function_name(fn)]

    def components(self, frozen, queries, responses, rows=None, packed_rows=None):
        return jnp.asarray(self.fn(queries, responses), jnp.float32)[None], jnp.zeros((), jnp.int32)


class GivenScores(RewardSource):
    """The caller's scores (legacy ``step(queries, responses, scores)``): ``scores`` f32[B], traced."""

    names = ["given"]

    def __init__(self, scores):
        self.given = scores

    def components(self, frozen, queries, responses, rows=None, packed_rows=None):
        return jnp.asarray(self.given, jnp.float32)[None], jnp.zeros((), jnp.int32)


class FunctionScores(RewardSource):
    """Python reward functions inside the compiled program (TRL's ``reward_funcs`` that are callables).

    ``components()`` reaches the host through ONE ``jax.pure_callback`` for all the functions: the tokenizer
    decodes the prompt and completion ids there, the rows' dataset columns come from ``table``, and
    ``ppojax.rl.reward_calls.call_all`` runs the functions at the same time. On a mesh the callback runs once per
    device on that device's rows (``shard_map``), so every process scores its own rows, as TRL's processes do.
    A failure (a function raised, returned the wrong number of values or, unless ``allow_nonfinite``, a
    NaN/inf; or, when ``sole``, every function returned None for a row) never raises inside the program: those
    rows get NaN (so no optimizer step of the iteration is applied), ``failures`` counts them, and the error is
    kept; :meth:`raise_pending` re-raises it after the step.

    functions: a callable or a list of them (or ``RewardCall``s); table: a ``ColumnTable`` or None;
    sole: no other reward source is summed with these (a row none of them scores has no reward at all);
    mesh: the device mesh of the program (None: one device). Host-side use: :meth:`host_components`.
    """

    may_fail = True

    def __init__(self, functions, tokenizer, pad_token_id: int, *, allow_nonfinite: bool = False, mesh=None,
                 table: Optional[ColumnTable] = None, sole: bool = True):
        functions = list(functions) if isinstance(functions, (list, tuple)) else [functions]
        self.calls = [f if isinstance(f, RewardCall) else RewardCall.of(f) for f in functions]
        self.names = [call.name for call in self.calls]
        self._qualified = [call.qualified for call in self.calls]
        self.tokenizer, self.pad_token_id = tokenizer, pad_token_id
        self.allow_nonfinite, self.mesh, self.table, self.sole = allow_nonfinite, mesh, table, sole
        self._errors: list[BaseException] = []
        self._lock = threading.Lock()

    @property
    def fn(self):
        """The function, when there is one (None for several); assignable (it keeps the compiled program's name)."""
        return self.calls[0].fn if len(self.calls) == 1 else None

    @fn.setter
    def fn(self, fn):
        if len(self.calls) != 1:
            raise ValueError(f"this reward has {len(self.calls)} functions ({', '.join(self.names)}); replace one "
                             "by building the run with the new list")
        self.calls = [RewardCall.of(fn, self.names[0])]
        self._qualified = [self.calls[0].qualified]

    @property
    def name(self) -> str:
        return "reward function" + ("s " if len(self.names) > 1 else " ") + ", ".join(self._qualified)

    def batch(self, queries, responses, rows=None) -> RewardBatch:
        """The texts, ids and dataset columns of the rows (host side)."""
        prompts, completions, ids = decode_rollout_text(self.tokenizer, queries, responses, self.pad_token_id,
                                                        with_ids=True)
        columns = {} if self.table is None or rows is None else self.table.rows(rows)
        return RewardBatch(prompts, completions, ids, columns)

    def host_components(self, queries, responses, rows=None) -> np.ndarray:
        """Host side: call every function on the rows that are not ``PADDING_ROW`` -> float32[F, B] (NaN where a
        function returned None, 0 on padding rows). Raises ``RewardFunctionError``."""
        queries, responses = np.asarray(queries), np.asarray(responses)
        live = np.ones(len(queries), bool) if rows is None else np.asarray(rows) != PADDING_ROW
        out = np.zeros((len(self.calls), len(queries)), np.float32)
        if not live.any():
            return out
        kept_rows = None if rows is None else np.asarray(rows)[live]
        batch = self.batch(queries[live], responses[live], kept_rows)
        for call in self.calls:
            call.check_arguments(batch.columns)
        alone = self.sole and len(self.calls) == 1  # its values are the scores, NaN included
        applies = np.zeros((len(self.calls), len(batch)), bool)
        for i, (call, values) in enumerate(zip(self.calls, call_all(self.calls, batch))):
            out[i, live] = check_scores(values, len(batch), name=f"reward function {call.qualified}",
                                        prompts=batch.prompts, allow_nonfinite=self.allow_nonfinite,
                                        allow_none=True, returned_nan_as_inf=not alone)
            missing = none_to_nan(values)[1]
            applies[i] = ~missing if missing.size == len(batch) else True
        if self.sole:
            self._check_some_apply(applies, batch)
        return out

    def _check_some_apply(self, applies: np.ndarray, batch: RewardBatch) -> None:
        """applies: bool[F, B] whether function f returned a value (not None) for row b."""
        unscored = np.flatnonzero(~np.any(applies, axis=0))
        if unscored.size:
            i = int(unscored[0])
            raise RewardFunctionError(
                f"{self.name} returned None for row {i} (prompt {batch.prompts[i]!r:.80}"
                + (f" and {unscored.size - 1} more rows" if unscored.size > 1 else "")
                + "): no reward applies to it. Return a number for every row from at least one reward function.")

    def _callback(self, queries, responses, rows):
        try:
            return self.host_components(queries, responses, rows), np.zeros(len(queries), np.int32)
        except Exception as err:  # noqa: BLE001 - kept and re-raised by raise_pending() after the step
            with self._lock:
                self._errors.append(err)
            return (np.full((len(self.calls), len(queries)), np.nan, np.float32),
                    np.ones(len(queries), np.int32))

    def components(self, frozen, queries, responses, rows=None, packed_rows=None):
        """queries i32[B, P], responses i32[B, R] (truncated), rows i32[B] or None -> (f32[F, B], failures i32[]).

        Through ``jax.experimental.io_callback``: the functions are user code with effects (they may log, count,
        call a service), so the call is never assumed pure (never deduplicated, dropped or repeated). Unordered:
        a step makes one call per device, whose order does not matter."""
        if rows is None:
            rows = jnp.full(queries.shape[:1], NO_ROW, jnp.int32)
        F = len(self.calls)

        def call(q, r, k):
            shapes = (jax.ShapeDtypeStruct((F,) + q.shape[:1], jnp.float32),
                      jax.ShapeDtypeStruct(q.shape[:1], jnp.int32))
            return io_callback(self._callback, shapes, q, r, k, ordered=False)

        if self.mesh is not None and self.mesh.size > 1:
            rows_spec = batch_partition_spec(self.mesh)
            columns_spec = PartitionSpec(None, *rows_spec)
            call = jax.shard_map(call, mesh=self.mesh, in_specs=(rows_spec, rows_spec, rows_spec),
                                 out_specs=(columns_spec, rows_spec))
        values, failed = call(queries, responses, rows)
        return values, jnp.sum(failed)

    def raise_pending(self) -> None:
        with self._lock:
            errors, self._errors = self._errors, []
        if errors:
            raise errors[0]


class WeightedRewards(RewardSource):
    """Several reward sources as one (TRL's ``reward_funcs`` + ``reward_weights``): the score is the weighted
    sum of every component that applies to a row.

    parts: reward sources whose ``names`` together are the components, in order; weights: one per component
    (None: all 1)."""

    def __init__(self, parts: Sequence[RewardSource], weights: Optional[Sequence[float]] = None):
        self.parts = list(parts)
        self.names = [name for part in self.parts for name in part.names]
        if len(set(self.names)) != len(self.names):
            raise ValueError(f"reward names must differ, got {self.names}")
        self._weights = tuple(float(w) for w in (weights if weights is not None else [1.0] * len(self.names)))
        if len(self._weights) != len(self.names):
            raise ValueError(f"{len(self._weights)} reward weights for {len(self.names)} rewards {self.names}")
        self.may_fail = any(part.may_fail for part in self.parts)

    @property
    def weights(self) -> tuple:
        return self._weights

    def raise_pending(self) -> None:
        for part in self.parts:
            part.raise_pending()

    def components(self, frozen, queries, responses, rows=None, packed_rows=None):
        values, failures = zip(*(part.components(frozen, queries, responses, rows, packed_rows)
                                  for part in self.parts))
        return jnp.concatenate(values, axis=0), sum(failures)
