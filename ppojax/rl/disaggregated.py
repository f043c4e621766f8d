"""Asynchronous RL on disjoint devices: the rollout on one sub-mesh, the update on another, the two running at
once (docs/async.md, "Two layouts").

    weights_t          = rollout_weights(state_t, frozen)         # the policy moved to the rollout devices
    fresh_t, failures, sampling_metrics = sample(weights_t, prompts_t, sample_key)  # rollout devices: sample, score
    state_t+1, metrics = update(state_t, fresh_t-1, update_key)   # training devices: learn the oldest batch

The update of iteration t learns from the batch of ``max_staleness`` (k >= 1) iterations earlier: k - 1 batches
wait in the state's ``in_flight`` queue and one more, the previous iteration's ``fresh``, travels between the
two programs (the *transit* batch). Neither program of an iteration reads the other's output, so JAX's
asynchronous dispatch runs them at the same time on their own devices; the next iteration's rollout waits only
for this update's weights. The numbers are those of the single program of ``ppojax.rl.program`` with the same
``max_staleness`` (``pipelined_iteration``): the same batches, sampled by the same policy versions, learned in
the same order.

Moving the weights is ``jax.device_put`` of the policy's parameters onto the rollout mesh's shardings: one
device-to-device copy of the policy per iteration (no host round trip), dispatched asynchronously.
:func:`full_queue` / :func:`split_queue` convert between this layout and the single program's (k batches in the
state), which is what a checkpoint stores.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any, Optional

import jax
import jax.numpy as jnp
from flax import struct

from ppojax import parallel
from ppojax.rl import pipeline
from ppojax.rl.program import PPOProgram, iteration_keys, jit_donating_state, learn_unless_reward_failed
from ppojax.rl.types import Prompts, as_prompts
from ppojax.rl.utilisation import IterationClock


@struct.dataclass
class RolloutWeights:
    """What the sampler and the reward source read, on the rollout devices: the policy's parameters
    (``{"policy": ...}``), the frozen models (``{"ref": None, "reward": ...}``; under LoRA also ``"base"``) and
    the policy version (``update_count``, i32[])."""

    params: Any
    frozen: Any
    update_count: jax.Array


@dataclasses.dataclass(frozen=True, eq=False)
class DisaggregatedProgram:
    """The two programs of a disaggregated run. program: the update's ``PPOProgram`` (on the training mesh, with
    ``settings.asynchronous.max_staleness`` >= 1); rollout_mesh: the devices that sample (disjoint from the
    program's). The rollout's program is the same but for its mesh (its settings keep the training mesh's
    data-parallel size, which only the update's batch layout reads)."""

    program: PPOProgram
    rollout_mesh: Any

    def __post_init__(self):
        asynchronous = self.program.settings.asynchronous
        if asynchronous is None or asynchronous.max_staleness < 1:
            raise ValueError("a disaggregated run overlaps the rollout with the update of an older batch: it needs "
                             "max_staleness >= 1 (the program's settings.asynchronous).")
        shared = set(self.rollout_mesh.devices.flat) & set(self.program.mesh.devices.flat)
        if shared:
            names = ", ".join(sorted(map(str, shared))[:3])
            raise ValueError(f"the rollout and training meshes share {len(shared)} device(s) ({names}...); give "
                             "each its own devices.")

    @property
    def rollout(self) -> PPOProgram:
        """The rollout's program: the same models, reward and settings on the rollout mesh."""
        return dataclasses.replace(self.program, mesh=self.rollout_mesh)

    @property
    def queue_length(self) -> int:
        """The batches the state's ``in_flight`` holds: max_staleness - 1 (the last one is in transit)."""
        return self.program.settings.asynchronous.max_staleness - 1


def rollout_frozen(program: DisaggregatedProgram, state):
    """The frozen models the rollout reads (the reward model; under LoRA the base weights), moved to the rollout
    devices once for the run; the reference is not moved (the rollout does not read it)."""
    frozen = {name: (None if name == "ref" else value) for name, value in (state.frozen or {}).items()}
    return jax.device_put(frozen, {name: None if value is None else
                                   parallel.param_shardings(value, program.rollout_mesh)
                                   for name, value in frozen.items()})


def rollout_weights(program: DisaggregatedProgram, state, frozen) -> RolloutWeights:
    """The state's policy and version moved to the rollout devices (``jax.device_put``: device to device,
    dispatched asynchronously; the update's own copy is untouched), with ``frozen`` (:func:`rollout_frozen`)."""
    mesh = program.rollout_mesh
    params = {"policy": state.params["policy"]}
    shardings = (parallel.param_shardings(params, mesh, parallel.GENERATE_RULES), parallel.replicated(mesh))
    params, version = jax.device_put((params, state.update_count), shardings)
    return RolloutWeights(params=params, frozen=frozen, update_count=version)


def make_sample(program: DisaggregatedProgram):
    """``sample(weights, prompts, key) -> (SampledBatch on the training devices, failures i32[], the sampling's
    metrics on the rollout devices)``: the rollout
    program (:func:`ppojax.rl.pipeline.sampled_batch` on the rollout mesh; key: the iteration's key, as
    ``train_step`` takes it), its batch then moved to the training mesh, rows over its batch axes."""
    rollout = program.rollout
    jitted = jax.jit(lambda weights, prompts, key: pipeline.sampled_batch(rollout, weights, prompts,
                                                                          iteration_keys(key)[0]))

    def sample(weights: RolloutWeights, prompts, key):
        prompts = as_prompts(prompts)
        prompts = Prompts(*parallel.shard_batch(tuple(prompts), program.rollout_mesh))
        fresh, failures, metrics = jitted(weights, prompts, parallel.put_replicated(key, program.rollout_mesh))
        return _to_training_mesh(program, fresh), failures, metrics

    sample.jitted = jitted
    return sample


def make_update(program: DisaggregatedProgram, state_shardings=None):
    """``update(state, transit, key, failures) -> (state, metrics)`` on the training mesh, the state donated: the
    transit batch joins the state's queue, the oldest batch leaves it and is learned from
    (``pipelined_iteration``'s second half). failures: the reward failures of the rollout that sampled ``transit``
    (an update on a batch whose reward failed applies no optimizer step). state_shardings: the state's in the
    single program's layout (``init_sharded_train_state``'s), or None."""
    train = program.program
    if state_shardings is not None and program.queue_length == 0:  # the whole queue is the transit batch
        state_shardings = state_shardings.replace(in_flight=None)

    def update(state, transit, key, failures):
        oldest, in_flight = pipeline.advance(state.in_flight, transit)
        experience = pipeline.experience_of(train, state, oldest)
        return learn_unless_reward_failed(train, state.replace(in_flight=in_flight), experience,
                                          iteration_keys(key)[1], failures)

    jitted = jit_donating_state(train, update, state_shardings)

    def call(state, transit, key, failures):
        return jitted(state, transit, parallel.put_replicated(key, train.mesh),
                      parallel.put_replicated(failures, train.mesh))

    call.jitted = jitted
    return call


def _to_training_mesh(program: DisaggregatedProgram, batch):
    """A rollout's batch with its rows over the training mesh's batch axes (a device-to-device copy)."""
    return jax.device_put(batch, jax.tree.map(lambda _: parallel.batch_sharding(program.program.mesh), batch))


def split_queue(program: DisaggregatedProgram, state):
    """A state whose ``in_flight`` holds max_staleness batches (the single program's layout, a checkpoint's)
    -> (the state with the first k - 1 of them, the last one: the transit batch)."""
    k = program.queue_length + 1
    queue = state.in_flight
    mesh = program.program.mesh
    # placed as the programs place them (a slice keeps a sharding of another kind: the update would compile twice)
    transit = jax.device_put(jax.tree.map(lambda q: q[k - 1], queue),
                             jax.tree.map(lambda _: parallel.batch_sharding(mesh), queue))
    rest = None
    if k > 1:
        rows = jax.sharding.NamedSharding(mesh, parallel.batch_partition_spec(mesh, axis=1))
        rest = jax.device_put(jax.tree.map(lambda q: q[:k - 1], queue), jax.tree.map(lambda _: rows, queue))
    return state.replace(in_flight=rest), transit


def full_queue(state, transit):
    """:func:`split_queue`'s inverse: the transit batch appended to the state's queue (what a checkpoint of a
    disaggregated run stores, so that either layout resumes from it)."""
    if state.in_flight is None:
        return state.replace(in_flight=jax.tree.map(lambda x: x[None], transit))
    return state.replace(in_flight=jax.tree.map(lambda q, x: jnp.concatenate([q, x[None]]), state.in_flight,
                                                transit))


class DisaggregatedStep:
    """``step(state, prompts, key) -> (state, metrics)`` of a disaggregated run, as ``train_step`` is called: one
    iteration's rollout and update dispatched together (neither waits for the other), the batch sampled now kept
    in transit for the next update. The state given first is in the single program's layout (``in_flight`` of
    max_staleness batches: after ``make_fill``, or restored); the states returned hold the first k - 1 of them
    (:func:`split_queue`); :meth:`full_state` is the single program's layout again (what a checkpoint stores), and
    :meth:`settle` returns to it. state_shardings: ``init_sharded_train_state``'s, or None."""

    def __init__(self, program: DisaggregatedProgram, state_shardings=None):
        self.program = program
        self.sample = make_sample(program)
        self.update = make_update(program, state_shardings)
        self.jitted = self.update.jitted  # the update's jit object (compile counts), as train_step's ``.jitted``
        self.transit = self.failures = self.frozen = None
        self.clock = IterationClock()

    def __call__(self, state, prompts, key):
        dispatched = time.perf_counter()
        if self.transit is None:  # the single program's layout: the last batch of the queue goes in transit
            state, self.transit = split_queue(self.program, state)
            self.failures = jnp.zeros((), jnp.int32)
        weights = rollout_weights(self.program, state, self.rollout_frozen(state))  # before the update donates it
        fresh, fresh_failures, sampling_metrics = self.sample(weights, prompts, key)
        state, metrics = self.update(state, self.transit, key, self.failures)
        metrics = {**metrics, **sampling_metrics}  # the row of iteration t: its update's and its rollout's
        self.clock.watch(dispatched, fresh_failures, metrics)
        self.transit, self.failures = fresh, fresh_failures
        return state, metrics

    def host_timings(self, metrics: dict) -> dict[str, float]:
        """The utilisation metrics (``time/rollout_s``, ``time/update_s``, the idle fractions of both device
        sets: ``ppojax.rl.utilisation``) of the iteration that returned ``metrics``, once they are on the host."""
        return self.clock.report(metrics)

    def rollout_frozen(self, state):
        """The frozen models on the rollout devices (:func:`rollout_frozen`), moved at the first call: they never
        change during a run. What the reward source reads wherever it runs on the rollout mesh (evaluation)."""
        if self.frozen is None:
            self.frozen = rollout_frozen(self.program, state)
        return self.frozen

    def fill(self, state, prompts, keys):
        """``ppojax.rl.program.make_fill``'s, sampled by the rollout program: the first max_staleness batches, by
        the state's policy, into its ``in_flight`` queue. prompts: ``Prompts`` i32[k, B / G, P]; keys: [k] the
        iterations' keys. -> (state, reward failures i32[])."""
        weights = rollout_weights(self.program, state, self.rollout_frozen(state))
        prompts = as_prompts(prompts)
        sampled = [self.sample(weights, Prompts(prompts.input_ids[i], prompts.rows[i]), keys[i])
                   for i in range(prompts.input_ids.shape[0])]
        mesh = self.program.program.mesh
        rows = jax.sharding.NamedSharding(mesh, parallel.batch_partition_spec(mesh, axis=1))
        queue = jax.tree.map(lambda *batches: jnp.stack(batches), *[batch for batch, _, _ in sampled])
        queue = jax.device_put(queue, jax.tree.map(lambda _: rows, queue))
        failures = sum(int(parallel.to_host(failed)) for _, failed, _ in sampled)
        return state.replace(in_flight=queue), jnp.int32(failures)

    def full_state(self, state):
        """``state`` (as returned by the step) with the batch in transit appended to its queue."""
        return state if self.transit is None else full_queue(state, self.transit)

    def settle(self, state):
        """:meth:`full_state`, the step then starting afresh from it (the next call splits it again)."""
        state = self.full_state(state)
        self.transit = self.failures = None
        self.clock.reset()
        return state


def run_disaggregated(program: DisaggregatedProgram, state, prompts, keys, *, state_shardings=None,
                      step: Optional[DisaggregatedStep] = None) -> tuple[Any, list]:
    """Iterations of a disaggregated run from a state in the single program's layout: prompts, a sequence of
    ``Prompts`` (one per iteration); keys, the iterations' keys. -> (the state in the single program's layout,
    each iteration's metrics (device arrays))."""
    step = step or DisaggregatedStep(program, state_shardings)
    history = []
    for batch_prompts, key in zip(prompts, keys):
        state, metrics = step(state, batch_prompts, key)
        history.append(metrics)
    return step.settle(state), history
