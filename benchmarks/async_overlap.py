"""Iterations per second of a disaggregated run (``ppojax.rl.disaggregated``: the rollout on some devices, the
update on the others, both at once) against the same work run one phase after the other on the same two device
sets, and against the synchronous single program on all devices.

Random Llama weights (``--hidden``, ``--layers``), a reward model of the same shape, ``--rows`` rows of
``--prompt-length`` prompt and ``--response-length`` response tokens. Forms, each timed over ``--iterations``
iterations after one warm-up iteration (the compiles):

- ``sequential``: the two programs of the disaggregated run, each waited for before the next is dispatched;
- ``overlapped``: the same two programs, dispatched together (the disaggregated run);
- ``one_program``: the synchronous program (``max_staleness`` 0) on all the devices;
- ``one_program_staleness_1`` / ``one_program_in_flight_1``: the asynchronous program on all the devices at
  ``max_staleness`` 1, whole batches / in-flight weight updates (each batch decoded in two chunks by two policies).

Needs several devices: on a CPU host ``XLA_FLAGS=--xla_force_host_platform_device_count=8`` (set here when
absent). Prints and writes (``--json``) the seconds per iteration, the ratios, the overlapped run's utilisation
metrics (each program's seconds and each device set's idle fraction per iteration), the host and the commit.

    python -m benchmarks.async_overlap --rollout-devices 4 --iterations 5 --json out.json
"""
from __future__ import annotations

import os

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from benchmarks.common import machine_info, source_commit  # noqa: E402
from ppojax import parallel  # noqa: E402
from ppojax.io.strict_json import write_json  # noqa: E402
from ppojax.models import CausalLM, ModelConfig, ScoreModel  # noqa: E402
from ppojax.rl import disaggregated, in_flight_updates, placement  # noqa: E402
from ppojax.rl.actor_critic import ActorCritic  # noqa: E402
from ppojax.rl.optimizer import make_optimizer  # noqa: E402
from ppojax.rl.program import PPOProgram, make_fill, make_train_step  # noqa: E402
from ppojax.rl.rollout import SLOT_OCCUPANCY  # noqa: E402
from ppojax.rl.rewards import ModelScores  # noqa: E402
from ppojax.rl.settings import AsyncSettings, Hyperparams, StepSettings  # noqa: E402
from ppojax.rl.types import Prompts  # noqa: E402
from ppojax.trainer.config import PPOConfig  # noqa: E402


def build(args, mesh, max_staleness, in_flight=False):
    cfg = ModelConfig.from_hf(dict(model_type="llama", vocab_size=args.vocab, hidden_size=args.hidden,
                                   num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=4,
                                   intermediate_size=4 * args.hidden, max_position_embeddings=1024,
                                   rms_norm_eps=1e-6, rope_theta=1e4, tie_word_embeddings=False,
                                   bos_token_id=1, eos_token_id=1, pad_token_id=0))
    config = PPOConfig(batch_size=args.rows, response_length=args.response_length,
                       max_prompt_length=args.prompt_length, num_ppo_epochs=1, num_mini_batches=1,
                       learning_rate=1e-5, temperature=1.0, behaviour_logprobs="sampler")
    settings = StepSettings.from_config(config, pad_token_id=0, stop_token_id=None, num_updates=100,
                                        data_parallel_size=parallel.data_parallel_size(mesh))
    asynchronous = AsyncSettings(max_staleness, in_flight_weight_updates=in_flight) if max_staleness else None
    settings = dataclasses.replace(settings, asynchronous=asynchronous)
    policy_def, policy = nnx.split(CausalLM(cfg, rngs=nnx.Rngs(0)))
    value_def, value = nnx.split(ScoreModel(cfg, rngs=nnx.Rngs(1)))
    _, reward = nnx.split(ScoreModel(cfg, rngs=nnx.Rngs(2)))
    program = PPOProgram(ActorCritic(policy_def, value_def, 0, 1.0), ModelScores(value_def, 0), settings,
                         make_optimizer(), mesh)
    params, frozen = {"policy": policy, "value": value}, {"ref": jax.tree.map(jnp.copy, policy), "reward": reward}
    in_flight = in_flight_updates.in_flight_shapes(program, params, frozen, args.prompt_length)
    state, shardings = placement.init_sharded_train_state(params, program.optimizer, mesh,
                                                          hyperparams=Hyperparams.from_config(config),
                                                          frozen=frozen, in_flight=in_flight)
    return program, state, shardings


def prompts_for(args, n):
    ids = np.random.default_rng(0).integers(2, args.vocab, size=(n, args.rows, args.prompt_length)).astype(np.int32)
    return [Prompts(ids[i], np.full((args.rows,), -1, np.int32)) for i in range(n)]


def timed(step, state, prompts, keys):
    """(seconds per iteration after the first (the compiles), each iteration's metrics)."""
    state, metrics = step(state, prompts[0], keys[0])
    history = [metrics]
    jax.block_until_ready((state, metrics))
    start = time.perf_counter()
    for batch, key in zip(prompts[1:], keys[1:]):
        state, metrics = step(state, batch, key)
        history.append(metrics)
    jax.block_until_ready((state, metrics))
    return (time.perf_counter() - start) / (len(prompts) - 1), history


def mean_utilisation(step, history) -> dict:
    """The overlapped step's host-measured utilisation metrics (``ppojax.rl.utilisation``) and its decode loop's
    occupancy (``sampling/slot_occupancy``), averaged over the iterations after the first."""
    rows = [{**step.host_timings(metrics), SLOT_OCCUPANCY: float(metrics[SLOT_OCCUPANCY])} for metrics in history][1:]
    return {name.split("/")[-1]: sum(row[name] for row in rows) / len(rows) for name in rows[0]}


class Sequential(disaggregated.DisaggregatedStep):
    """The disaggregated step with each program waited for before the next is dispatched."""

    def __call__(self, state, prompts, key):
        if self.transit is None:
            self.frozen = disaggregated.rollout_frozen(self.program, state)
            state, self.transit = disaggregated.split_queue(self.program, state)
            self.failures = jnp.zeros((), jnp.int32)
        weights = disaggregated.rollout_weights(self.program, state, self.frozen)
        fresh, fresh_failures, sampling_metrics = jax.block_until_ready(self.sample(weights, prompts, key))
        state, metrics = jax.block_until_ready(self.update(state, self.transit, key, self.failures))
        self.transit, self.failures = fresh, fresh_failures
        return state, {**metrics, **sampling_metrics}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rollout-devices", type=int, default=4)
    parser.add_argument("--iterations", type=int, default=5)
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--prompt-length", type=int, default=32)
    parser.add_argument("--response-length", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    devices = jax.devices()
    n = args.iterations + 1
    keys = [jax.random.key(i) for i in range(n)]
    fill_prompts = prompts_for(args, 1)[0]
    fill_prompts = Prompts(fill_prompts.input_ids[None], fill_prompts.rows[None])
    seconds = {}
    train_mesh = parallel.make_mesh(devices=devices[args.rollout_devices:])
    rollout_mesh = parallel.make_mesh(devices=devices[:args.rollout_devices])
    for form, step_class in (("sequential", Sequential), ("overlapped", disaggregated.DisaggregatedStep)):
        program, state, shardings = build(args, train_mesh, 1)
        split = disaggregated.DisaggregatedProgram(program, rollout_mesh)
        step = step_class(split, shardings)
        state, _ = step.fill(state, fill_prompts, jnp.stack(keys[:1]))
        seconds[form], history = timed(step, state, prompts_for(args, n), keys)
        print(f"{form}: {seconds[form]:.3f} s per iteration", flush=True)
    utilisation = mean_utilisation(step, history)  # the overlapped step's
    print("overlapped, per iteration: " + ", ".join(f"{name} {value:.3f}" for name, value in utilisation.items()))
    program, state, shardings = build(args, parallel.make_mesh(devices=devices), 0)
    seconds["one_program"], _ = timed(make_train_step(program, shardings), state, prompts_for(args, n), keys)
    print(f"one_program: {seconds['one_program']:.3f} s per iteration", flush=True)
    for form, in_flight in (("one_program_staleness_1", False), ("one_program_in_flight_1", True)):
        program, state, shardings = build(args, parallel.make_mesh(devices=devices), 1, in_flight)
        state, _ = make_fill(program, shardings)(state, fill_prompts, jnp.stack(keys[:1]))
        seconds[form], _ = timed(make_train_step(program, shardings), state, prompts_for(args, n), keys)
        print(f"{form}: {seconds[form]:.3f} s per iteration", flush=True)
    report = dict(vars(args), devices=len(devices), seconds_per_iteration=seconds, overlapped_utilisation=utilisation,
                  overlapped_vs_sequential=seconds["sequential"] / seconds["overlapped"],
                  overlapped_vs_one_program=seconds["one_program"] / seconds["overlapped"],
                  machine=machine_info(), commit=source_commit())
    print(f"overlapped: {report['overlapped_vs_sequential']:.2f}x the sequential rate, "
          f"{report['overlapped_vs_one_program']:.2f}x the one program's")
    if args.json:
        write_json(args.json, report, indent=1)
    return report


if __name__ == "__main__":
    main()
