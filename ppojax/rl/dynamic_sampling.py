"""DAPO's dynamic sampling inside the one compiled step (docs/algorithm.md, "Dynamic sampling").

DAPO (Qiying Yu et al., 2025, arXiv:2503.14476) drops every group whose scores are all equal (its group-relative
advantages are 0: it trains nothing, yet counts in the loss's token means) and samples further prompts until the
batch holds K = batch_size / G informative groups (G = num_generations). Here the rounds are a
``lax.while_loop`` of fixed shapes, so the step stays one program whatever the rounds an update takes:

    prompts: i32[T, Q, P]  (T = max_num_gen_batches rounds of Q = gen_batch_size prompts; the host's next ones)
    while kept < K and round < T:
        sample Q x G responses for prompts[round], score them      # decode + reward only: no other forward
        informative[g] = the group's scores are not all equal (or not all finite: the update's guard skips those;
                         with filter_groups_metric, the values of that reward where it applies), and, with
                         mask_truncated_completions, some response of it ended
        the informative groups fill the batch's next slots, in sampling order; the surplus of the last round
        is dropped (verl's); the first dropped groups are kept aside as spares
    the forwards (behaviour / reference log-probs) run ONCE, on the B rows selected

When the bound stops an update before its batch is full (verl raises), the free slots take the spare groups in
sampling order, left out of the loss (``Experience.trained`` False) and reported (``dynamic_sampling/batch_full``
0); an update that kept no group applies no optimizer step. The host advances its prompts by the rounds used
(``dynamic_sampling/rounds``), so no prompt is skipped and a resumed run takes the same ones.

The selection is pure (:func:`select_groups` on any ``sample_round`` function); :func:`collect` is the
program's rollout with it.
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp

from ppojax.core.masks import contains_stop_token, response_masks, truncate_response
from ppojax.rl import rollout
from ppojax.rl.sampler import occupancy

PREFIX = "dynamic_sampling/"


class Round(NamedTuple):
    """One generation round of Q groups of G rows. rows: a pytree of [Q*G, ...] arrays (what the batch keeps of a
    row); scores: f32[Q*G] the rows' scores; trainable: bool[Q*G] rows the loss could train (None: all); failures:
    i32[] rows the reward source could not score; judged: f32[Q*G] the values groups are judged by when not the
    scores, one reward's (NaN where it does not apply), or None; decode_work: the round's decode loop's (busy,
    computed) f32[] row-steps (``ppojax.rl.sampler.decode_work``), or None."""

    rows: Any
    scores: Any
    trainable: Any
    failures: Any
    judged: Any = None
    decode_work: Any = None


class Selection(NamedTuple):
    """The batch dynamic sampling selected: rows (a pytree of [K*G, ...]: the kept groups in sampling order, then
    spare ones where the batch is not full), trained bool[K*G] (the kept groups' rows), and the counts of the
    update (i32[]): rounds, kept (<= K), dropped (groups with equal scores, or no trainable row), all_truncated
    (groups with no trainable row), failures; sampled_score_sum f32[] / sampled_score_count i32[] over the finite
    scores of every row sampled; decode_busy / decode_computed f32[]: the rounds' decode work summed (0 without
    it)."""

    rows: Any
    trained: Any
    rounds: Any
    kept: Any
    dropped: Any
    all_truncated: Any
    failures: Any
    sampled_score_sum: Any
    sampled_score_count: Any
    decode_busy: Any
    decode_computed: Any


def informative_groups(scores, group_size: int, trainable=None, *, reward_values=False):
    """bool[n] whether each of the n groups of ``group_size`` consecutive rows teaches anything: its scores
    f32[n*G] are not all equal, or some is not finite (kept, so that the update's non-finite guard sees it); and,
    when ``trainable`` bool[n*G] is given, some row of it is trainable. ``reward_values``: ``scores`` are one
    reward's values, NaN where it does not apply: the group's values where it applies are not all equal."""
    grouped = scores.reshape(-1, group_size)
    if reward_values:
        informative = jnp.nanmax(grouped, axis=1) > jnp.nanmin(grouped, axis=1)  # all NaN: NaN > NaN is False
    else:
        spread = jnp.max(grouped, axis=1) > jnp.min(grouped, axis=1)
        informative = spread | jnp.any(~jnp.isfinite(grouped), axis=1)
    if trainable is not None:
        informative = informative & jnp.any(trainable.reshape(-1, group_size), axis=1)
    return informative


def _place(buffer, rows, chosen, count, capacity: int, group_size: int):
    """``buffer`` (a pytree of [capacity, G, ...]) with the ``chosen`` bool[q] groups of ``rows`` ([q*G, ...]) in
    its slots ``count``, ``count + 1``, ... in order (those past ``capacity`` dropped) -> (buffer, new count)."""
    slot = count + jnp.cumsum(chosen) - 1
    slot = jnp.where(chosen & (slot < capacity), slot, capacity)  # capacity: out of range, dropped by the scatter

    def put(buf, x):
        return buf.at[slot].set(x.reshape(-1, group_size, *x.shape[1:]), mode="drop")

    return jax.tree.map(put, buffer, rows), jnp.minimum(count + jnp.sum(chosen), capacity)


def select_groups(sample_round: Callable[[Any], Round], *, groups_wanted: int, group_size: int,
                  max_rounds: int) -> Selection:
    """Sample rounds until ``groups_wanted`` (K) informative groups are kept or ``max_rounds`` rounds ran.

    sample_round(r) -> ``Round`` for round r (an i32[] traced index); every round has the same shapes. Pure:
    one ``lax.while_loop``, traced once."""
    K, G = groups_wanted, group_size
    shapes = jax.eval_shape(sample_round, jnp.zeros((), jnp.int32)).rows
    empty = jax.tree.map(lambda s: jnp.zeros((K, G, *s.shape[1:]), s.dtype), shapes)
    zero = jnp.zeros((), jnp.int32)
    start = dict(round=zero, kept=empty, spare=jax.tree.map(jnp.copy, empty), num_kept=zero, num_spare=zero,
                 dropped=zero, all_truncated=zero, failures=zero, score_sum=jnp.zeros((), jnp.float32),
                 score_count=zero, busy=jnp.zeros((), jnp.float32), computed=jnp.zeros((), jnp.float32))

    def more(carry):
        return (carry["num_kept"] < K) & (carry["round"] < max_rounds)

    def one_round(carry):
        sampled = sample_round(carry["round"])
        if sampled.judged is None:
            informative = informative_groups(sampled.scores, G, sampled.trainable)
        else:
            informative = informative_groups(sampled.judged, G, sampled.trainable, reward_values=True)
        kept, num_kept = _place(carry["kept"], sampled.rows, informative, carry["num_kept"], K, G)
        spare, num_spare = _place(carry["spare"], sampled.rows, ~informative, carry["num_spare"], K, G)
        finite = jnp.isfinite(sampled.scores)
        all_truncated = zero
        if sampled.trainable is not None:
            all_truncated = jnp.sum(~jnp.any(sampled.trainable.reshape(-1, G), axis=1), dtype=jnp.int32)
        return dict(round=carry["round"] + 1, kept=kept, spare=spare, num_kept=num_kept, num_spare=num_spare,
                    dropped=carry["dropped"] + jnp.sum(~informative, dtype=jnp.int32),
                    all_truncated=carry["all_truncated"] + all_truncated,
                    failures=carry["failures"] + jnp.asarray(sampled.failures, jnp.int32),
                    score_sum=carry["score_sum"] + jnp.sum(jnp.where(finite, sampled.scores, 0.0)),
                    score_count=carry["score_count"] + jnp.sum(finite, dtype=jnp.int32),
                    busy=carry["busy"] + (0.0 if sampled.decode_work is None else sampled.decode_work[0]),
                    computed=carry["computed"] + (0.0 if sampled.decode_work is None else sampled.decode_work[1]))

    done = jax.lax.while_loop(more, one_round, start)
    # slot k: the k-th kept group, or (past the kept ones) the (k - kept)-th spare
    slots = jnp.arange(K)
    filled = slots < done["num_kept"]
    source = jnp.where(filled, slots, K + slots - done["num_kept"])
    rows = jax.tree.map(lambda kept, spare: jnp.concatenate([kept, spare])[source].reshape(K * G, *kept.shape[2:]),
                        done["kept"], done["spare"])
    return Selection(rows=rows, trained=jnp.repeat(filled, G), rounds=done["round"], kept=done["num_kept"],
                     dropped=done["dropped"], all_truncated=done["all_truncated"], failures=done["failures"],
                     sampled_score_sum=done["score_sum"], sampled_score_count=done["score_count"],
                     decode_busy=done["busy"], decode_computed=done["computed"])


def selection_metrics(selection: Selection, *, groups_wanted: int, group_size: int, prompts_per_round: int,
                      with_truncation: bool) -> dict:
    """The update's ``dynamic_sampling/*`` metrics: rounds (used), groups_dropped, groups_all_truncated (with
    mask_truncated_completions), filled_fraction (kept groups / K), batch_full (1 or 0), generated_over_trained
    (rows sampled / rows trained: the generation overhead, ``rounds x Q / K`` when full; NaN when nothing was
    kept) and sampled_scores (the mean score of every row sampled: ``objective/scores`` is the kept batch's)."""
    sampled_rows = selection.rounds * prompts_per_round * group_size
    trained_rows = selection.kept * group_size
    out = {
        "rounds": selection.rounds,
        "groups_dropped": selection.dropped,
        "filled_fraction": selection.kept / groups_wanted,
        "batch_full": (selection.kept == groups_wanted).astype(jnp.float32),
        "generated_over_trained": jnp.where(trained_rows > 0, sampled_rows / jnp.maximum(trained_rows, 1), jnp.nan),
        "sampled_scores": selection.sampled_score_sum / selection.sampled_score_count,
    }
    if with_truncation:
        out["groups_all_truncated"] = selection.all_truncated
    return {PREFIX + name: value for name, value in out.items()}


def round_key(key, index):
    """The sampler's key of round ``index`` (i32[]): round 0 samples with ``key`` itself, as an update without
    dynamic sampling does; round r > 0 with ``fold_in(key, r)``."""
    return jax.lax.cond(index == 0, lambda: key, lambda: jax.random.fold_in(key, index))


def collect(program, state, prompts, sample_key):
    """The rollout of ``ppojax.rl.program.collect_experience`` with dynamic sampling.

    prompts: ``Prompts`` with input_ids i32[T, Q, P] and rows i32[T, Q] (T = ``max_rounds``, Q =
    ``prompts_per_round``). -> (Experience of B rows with ``trained``, reward failures i32[], metrics)."""
    settings = program.settings
    sampling, dynamic = settings.sampling, settings.dynamic_sampling
    G, K = sampling.num_generations, settings.batch.batch_size // sampling.num_generations
    P = prompts.input_ids.shape[-1]
    mask_truncated = settings.algorithm.mask_truncated_completions

    def sample_round(index):
        ids = jax.lax.dynamic_index_in_dim(prompts.input_ids, index, keepdims=False)
        rows = jnp.repeat(jax.lax.dynamic_index_in_dim(prompts.rows, index, keepdims=False), G)
        query_responses, sampler_logprobs, work = rollout.sample_measured(program, state, ids,
                                                                          round_key(sample_key, index))
        responses = truncate_response(query_responses[:, P:], sampling.stop_token_id, sampling.pad_token_id)
        rewarded = rollout.reward_scores(program, state, query_responses[:, :P], responses, rows)
        stopped = contains_stop_token(responses, sampling.stop_token_id)
        scores = rollout.penalised_scores(rewarded.scores, stopped,
                                          response_masks(responses, sampling.pad_token_id).last_index, settings)
        kept = dict(query_responses=query_responses, scores=scores, components=rewarded.components)
        if sampler_logprobs is not None:
            kept["sampler_logprobs"] = sampler_logprobs
        trainable = stopped if mask_truncated else None
        judged = None if dynamic.metric is None else rewarded.components[dynamic.metric]
        return Round(kept, scores, trainable, rewarded.failures, judged, work)

    selection = select_groups(sample_round, groups_wanted=K, group_size=G, max_rounds=dynamic.max_rounds)
    rows = selection.rows
    experience = rollout.experience_forwards(program, state, rows["query_responses"], P,
                                             rows.get("sampler_logprobs"))
    experience = experience.replace(scores=rows["scores"], reward_components=rows["components"],
                                    trained=selection.trained)
    metrics = selection_metrics(selection, groups_wanted=K, group_size=G, prompts_per_round=dynamic.prompts_per_round,
                                with_truncation=mask_truncated)
    metrics[rollout.SLOT_OCCUPANCY] = occupancy(selection.decode_busy, selection.decode_computed)  # over the rounds
    return experience, selection.failures, metrics
