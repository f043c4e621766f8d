"""A tiny real PPO setup (Llama policy/ref, Llama value and reward ScoreModels) shared by the sharding tests,
and the subprocesses of the two-process test: ``python tests/sharding_helpers.py worker OUT.npz`` (with
PPOJAX_* set) and ``python tests/sharding_helpers.py single OUT.npz`` (the one-device reference).

Import-time side effects: none (the multi-device tests set XLA_FLAGS before JAX starts).
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

if __name__ == "__main__":  # a subprocess: make `ppojax` importable; a worker starts jax.distributed FIRST
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    if sys.argv[1] == "worker":
        from ppojax.parallel import initialize_distributed

        assert initialize_distributed(), "expected PPOJAX_* variables for a distributed run"

from ppojax import parallel as sh  # noqa: E402
from ppojax.rl import placement  # noqa: E402
from ppojax.rl.actor_critic import ActorCritic  # noqa: E402
from ppojax.models import CausalLM, ModelConfig, ScoreModel, load_pretrained, save_pretrained  # noqa: E402
from ppojax.models import hf_io  # noqa: E402
from ppojax.trainer.config import PPOConfig  # noqa: E402
from ppojax.rl.rewards import ModelScores  # noqa: E402
from ppojax.rl.settings import Hyperparams, StepSettings  # noqa: E402
from ppojax.rl import in_flight_updates  # noqa: E402
from ppojax.rl.program import PPOProgram, make_fill, make_rollout, make_train_step  # noqa: E402
from ppojax.rl.types import Experience  # noqa: E402
from ppojax.rl.optimizer import make_optimizer  # noqa: E402
from ppojax.rl.update import learn  # noqa: E402

PAD, STOP, VOCAB, P, R, B = 0, 2, 128, 6, 8, 16
CFG = ModelConfig(model_type="llama", vocab_size=VOCAB, hidden_size=32, num_layers=2, num_heads=4,
                  num_kv_heads=2, head_dim=8, intermediate_size=64)
CONFIG = PPOConfig(num_ppo_epochs=2, num_mini_batches=2, gradient_accumulation_steps=1, learning_rate=1e-3,
                   batch_size=B, response_length=R, temperature=0.7, stop_token_id=STOP, missing_eos_penalty=1.0)


def settings_of(**changes):
    """(StepSettings, Hyperparams) of CONFIG with ``changes`` (PPOConfig field names)."""
    config = dataclasses.replace(CONFIG, **changes)
    return (StepSettings.from_config(config, pad_token_id=PAD, stop_token_id=STOP, num_updates=4),
            Hyperparams.from_config(config))


SETTINGS, HYPERPARAMS = settings_of()
NUM_MULTIHOST_UPDATES = 2


def build_models(seed=0):
    """-> (ActorCritic, trainable params {"policy", "value"}, frozen {"ref", "reward"} params, graphdefs)."""
    policy_def, policy = nnx.split(CausalLM(CFG, rngs=nnx.Rngs(seed)))
    value_def, value = nnx.split(ScoreModel(CFG, rngs=nnx.Rngs(seed + 1)))
    _, reward = nnx.split(ScoreModel(CFG, rngs=nnx.Rngs(seed + 2)))
    ref = jax.tree.map(lambda x: x + 0.01, policy)  # a slightly different reference: non-zero KL
    ac = ActorCritic(policy_def, value_def, PAD, temperature=0.7)
    return ac, {"policy": policy, "value": value}, {"ref": ref, "reward": reward}, (policy_def, value_def)


def prompts(seed=0):
    """Left-padded prompts i32[B, P] (numpy, identical on every process)."""
    rng = np.random.default_rng(seed)
    q = rng.integers(3, VOCAB, size=(B, P)).astype(np.int32)
    pad = rng.integers(0, 3, size=B)
    q[np.arange(P)[None, :] < pad[:, None]] = PAD
    return q


def rollout(mesh, params, frozen, graphdefs, queries, key):
    """The rollout half of the PPO program on ``mesh`` (``ppojax.rl.program.make_rollout``): the state placed
    by TRAIN_RULES (the policy is re-laid out for generation inside the program), the prompts by rows."""
    policy_def, value_def = graphdefs
    ac = ActorCritic(policy_def, value_def, PAD, temperature=0.7)
    program = PPOProgram(ac, ModelScores(value_def, PAD), SETTINGS, make_optimizer(), mesh)
    state, _ = placement.init_sharded_train_state(params, program.optimizer, mesh, hyperparams=HYPERPARAMS,
                                                  frozen=frozen)
    experience, failures = make_rollout(program)(state, jnp.asarray(queries), key)
    assert int(failures) == 0
    return experience


def lora_rollout_and_update(mesh, experience=None):
    """The PPO program with LoRA (rank 4 on q/v/down_proj) on ``mesh``: the trainable policy params are the
    adapters only, the base weights are frozen and are also the reference (``frozen["ref"]`` None). One rollout,
    then one update on ``experience`` (default: this rollout's; pass the one-device rollout's so that two meshes
    update on the same data). The adapters start non-zero (B += 0.01), so the policy differs from the reference.
    -> (rollout Experience, state after the update, metrics dict)."""
    from ppojax.models.lora import LoraSpec, with_lora  # noqa: PLC0415

    _, params, frozen, (policy_def, value_def) = build_models()
    spec = LoraSpec(4, 8.0, ("q_proj", "v_proj", "down_proj"))
    base_def, lora_def, adapters, base = with_lora(nnx.merge(policy_def, params["policy"]), spec,
                                                   jax.random.key(3))
    adapters = jax.tree.map(lambda x: x + 0.01, adapters)
    ac = ActorCritic(lora_def, value_def, PAD, temperature=0.7, base_graphdef=base_def, lora_scale=spec.scale)
    program = PPOProgram(ac, ModelScores(value_def, PAD), SETTINGS, make_optimizer(), mesh)
    state, shardings = placement.init_sharded_train_state(
        {"policy": adapters, "value": params["value"]}, program.optimizer, mesh, hyperparams=HYPERPARAMS,
        frozen={"base": base, "ref": None, "reward": frozen["reward"]})
    rolled, failures = make_rollout(program)(state, jnp.asarray(prompts()), jax.random.key(0))
    assert int(failures) == 0
    update = jax.jit(lambda s, e, k: learn(program, s, e, k), donate_argnums=(0,),
                     out_shardings=(shardings, sh.replicated(mesh)))
    state, metrics = update(state, sh.shard_batch(rolled if experience is None else experience, mesh),
                            sh.put_replicated(jax.random.key(100), mesh))
    return rolled, state, {k: float(v) for k, v in sh.to_host(metrics).items()}


def run_updates(mesh, ac, params, experience, num_updates, settings=SETTINGS, hyperparams=HYPERPARAMS):
    """``num_updates`` sharded PPO updates (``ppojax.rl.update.learn``) on the same experience.
    -> (state, list of metric dicts)."""
    optimizer = make_optimizer()
    program = PPOProgram(ac, None, settings, optimizer, mesh)
    state, shardings = placement.init_sharded_train_state(params, optimizer, mesh, hyperparams=hyperparams,
                                                         kl_coef=0.05)
    update = jax.jit(lambda s, e, k: learn(program, s, e, k), donate_argnums=(0,),
                     out_shardings=(shardings, sh.replicated(mesh)))
    experience = sh.shard_batch(experience, mesh)
    history = []
    for i in range(num_updates):
        state, metrics = update(state, experience, sh.put_replicated(jax.random.key(100 + i), mesh))
        history.append({k: float(v) for k, v in sh.to_host(metrics).items()})
    assert update._cache_size() == 1  # the state keeps its shardings: no recompilation
    return state, history


ASYNC_ITERATIONS = 3


def asynchronous_run(mesh, in_flight_weight_updates=False):
    """An asynchronous run in one program on ``mesh`` (``max_staleness`` 1, the decoupled objective, the reward
    model scoring inside the program): the fill, then ASYNC_ITERATIONS train steps, each sampling the next batch
    while it learns from the previous one (with ``in_flight_weight_updates``: decoding the second half of the
    previous batch with the new policy, its KV cache in the state). -> (metrics array, params and the queue left in
    flight on the host)."""
    ac, params, frozen, (_, value_def) = build_models()
    settings, hyperparams = settings_of(max_staleness=1, behaviour_logprobs="sampler", use_decoupled_loss=True,
                                        in_flight_weight_updates=in_flight_weight_updates)
    program = PPOProgram(ac, ModelScores(value_def, PAD), settings, make_optimizer(), mesh)
    queue = in_flight_updates.in_flight_shapes(program, params, frozen, P)
    state, shardings = placement.init_sharded_train_state(params, program.optimizer, mesh, hyperparams=hyperparams,
                                                         frozen=frozen, in_flight=queue)
    keys = [jax.random.key(200 + i) for i in range(ASYNC_ITERATIONS + 1)]
    batches = [prompts(seed) for seed in range(ASYNC_ITERATIONS + 1)]
    state, failures = make_fill(program, shardings)(state, jnp.asarray(batches[0])[None], jnp.stack(keys[:1]))
    assert int(sh.to_host(failures)) == 0
    step, history = make_train_step(program, shardings), []
    for batch, key in zip(batches[1:], keys[1:]):
        state, metrics = step(state, jnp.asarray(batch), key)
        history.append({k: float(v) for k, v in sh.to_host(metrics).items()})
    assert step.jitted._cache_size() == 1
    assert [h["offpolicy/staleness_max"] for h in history] == [0] + [1] * (ASYNC_ITERATIONS - 1)  # the fill: v0
    return metrics_array(history), sh.to_host({"params": state.params, "in_flight": state.in_flight})


def worker(out_path):
    """One process of the two-process test: 2 local CPU devices; mesh (data=1, fsdp=2, tensor=2) over the
    4 devices of both processes, so parameters, optimizer state and batch rows are split ACROSS processes.
    Each process builds only ITS rows of the experience and makes global arrays from them."""
    assert jax.process_count() == 2 and jax.device_count() == 4, (jax.process_count(), jax.device_count())
    mesh = sh.make_mesh(data=1, fsdp=2, tensor=2)
    ac, params, _, (policy_def, _) = build_models()
    # the policy enters from a checkpoint, read straight into its shards on both processes' devices
    directory = os.path.join(os.path.dirname(out_path), f"policy-process{jax.process_index()}")
    save_pretrained(nnx.merge(policy_def, params["policy"]), CFG, directory)
    with shard_reads() as reads:
        params["policy"] = nnx.state(load_pretrained(directory, mesh=mesh)[0])
    assert_read_shard_by_shard(params["policy"], reads)
    rows = sh.process_local_rows(B, mesh)
    local = jax.tree.map(lambda x: x[rows], synthetic_experience())
    experience = sh.host_local_batch_to_global(local, mesh)
    assert not experience.logprobs.is_fully_addressable
    state, history = run_updates(mesh, ac, params, experience, num_updates=NUM_MULTIHOST_UPDATES)
    embed = state.params["policy"]["backbone"]["embed"]["embedding"]
    assert not embed.is_fully_addressable and "fsdp" in str(embed.sharding.spec)
    params_host = sh.to_host(state.params)  # every process takes part in the gather
    on_main = sh.to_main_host(state.params)  # an export's gather: the whole tree on the main process only
    if sh.is_main_process():
        jax.tree.map(np.testing.assert_array_equal, on_main, params_host)
    else:
        assert on_main is None
    async_metrics, async_state = asynchronous_run(mesh)  # the batch rows over both processes' devices
    swap_metrics, swap_state = asynchronous_run(mesh, in_flight_weight_updates=True)
    if sh.is_main_process():
        np.savez(out_path, rows=rows, metrics=metrics_array(history), async_metrics=async_metrics,
                 swap_metrics=swap_metrics, **flat_params(params_host),
                 **{"async" + k: v for k, v in flat_params(async_state).items()},
                 **{"swap" + k: v for k, v in flat_params(swap_state).items()})
    jax.distributed.shutdown()


@contextlib.contextmanager
def shard_reads():
    """[(whole shape, read shape)] of every part ``load_pretrained`` reads from a checkpoint within the block."""
    reads, read = [], hf_io.read_shard

    def spy(source, index, dtype):
        part = read(source, index, dtype)
        reads.append((tuple(source.shape), part.shape))
        return part

    hf_io.read_shard = spy
    try:
        yield reads
    finally:
        hf_io.read_shard = read


def assert_read_shard_by_shard(params, reads):
    """Each array of ``params`` was read as its addressable devices' shards, once per distinct shard: never
    whole (unless replicated), and never a shard of another process's devices."""
    leaves = jax.tree.leaves(params)
    distinct = sum(len({tuple((s.start, s.stop) for s in index) for index in
                        leaf.sharding.addressable_devices_indices_map(leaf.shape).values()}) for leaf in leaves)
    assert len(reads) == distinct, (len(reads), distinct)
    shards = {}  # whole shape -> the shard shapes of the arrays of that shape (norms and biases share one)
    for leaf in leaves:
        shards.setdefault(leaf.shape, set()).add(leaf.sharding.shard_shape(leaf.shape))
    for whole, expected in shards.items():
        assert {part for shape, part in reads if shape == whole} == expected, (whole, expected)
    assert any(part != whole for whole, part in reads), "no array was split: the test shows nothing"


def single_process_reference(out_path):
    """The same updates as :func:`worker` in one process on one device."""
    ac, params, _, _ = build_models()
    one = sh.make_mesh(devices=jax.devices()[:1])
    state, history = run_updates(one, ac, params, synthetic_experience(), num_updates=NUM_MULTIHOST_UPDATES)
    async_metrics, async_state = asynchronous_run(one)
    swap_metrics, swap_state = asynchronous_run(one, in_flight_weight_updates=True)
    np.savez(out_path, metrics=metrics_array(history), async_metrics=async_metrics, swap_metrics=swap_metrics,
             **flat_params(sh.to_host(state.params)), **{"async" + k: v for k, v in flat_params(async_state).items()},
             **{"swap" + k: v for k, v in flat_params(swap_state).items()})


def metrics_array(history):
    return np.array([[h[k] for k in sorted(h)] for h in history])


def flat_params(tree):
    return {"param" + jax.tree_util.keystr(path): np.asarray(leaf)
            for path, leaf in jax.tree_util.tree_leaves_with_path(tree)}


def synthetic_experience(seed=0):
    """A deterministic numpy ``Experience`` (no model run): random tokens with stop tokens, log-probs near
    the tiny model's (~ -log V), values and scores; masks as the rollout makes them (docs/algorithm.md, "Rollout")."""
    rng = np.random.default_rng(seed)
    queries = prompts(seed)
    raw = rng.integers(3, VOCAB, size=(B, R)).astype(np.int32)
    stop_at = rng.integers(1, 2 * R, size=B)  # past R: no stop token
    for row, t in enumerate(stop_at):
        if t < R:
            raw[row, t] = STOP
    contains_stop = stop_at < R
    t = np.arange(R)[None, :]
    responses = np.where(t > np.where(contains_stop, stop_at, R)[:, None], PAD, raw).astype(np.int32)
    last_index = np.where(contains_stop, stop_at, R - 1).astype(np.int32)
    padding_mask = t > last_index[:, None]
    padding_mask_p1 = t > last_index[:, None] + 1
    logprobs = (-np.log(VOCAB) + 0.3 * rng.normal(size=(B, R))).astype(np.float32)
    ref_logprobs = (logprobs + 0.1 * rng.normal(size=(B, R))).astype(np.float32)
    return Experience(
        queries=queries, query_responses=np.concatenate([queries, raw], 1), responses=responses,
        logprobs=np.where(padding_mask, 1.0, logprobs).astype(np.float32),
        ref_logprobs=np.where(padding_mask, 1.0, ref_logprobs).astype(np.float32),
        values=np.where(padding_mask_p1, 0.0, 0.1 * rng.normal(size=(B, R))).astype(np.float32),
        scores=rng.normal(size=B).astype(np.float32), last_index=last_index, padding_mask=padding_mask,
        padding_mask_p1=padding_mask_p1, contains_stop=contains_stop)


if __name__ == "__main__":
    if sys.argv[1] == "worker":
        worker(sys.argv[2])
    else:
        single_process_reference(sys.argv[2])
