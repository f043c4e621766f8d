"""Continuous batching (ppojax.rl.continuous): S slots decode a batch's sequences, refilled from the waiting
prompts in order, inside one compiled loop.

- each sequence gets exactly the padded sampler's tokens for the same key (greedy, categorical, top-k/top-p,
  stop tokens, any number of slots), in the prompts' order, and its log-probs to float rounding;
- the decode steps the loop runs are those of a plain Python simulation of the slot schedule, and the share of
  busy row-steps (``sampling/slot_occupancy``) that simulation's count, for the padded sampler too;
- a second call with other prompts and another key does not recompile;
- the pieces: the model's per-row cache index (``write_slots``), per-row sampling keys (``sample_rows``);
- ``rollout_slots`` in a whole train_step equals the padded sampler's step; the config refuses bad values;
- sharded over a mesh of 8 virtual CPU devices, the slots give the one-device tokens.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ppojax.models.kv_cache import write_slots
from ppojax.rl.continuous import generate_continuous, generate_continuous_jit
from ppojax.rl.forward import sequence_inputs
from ppojax.rl.sampler import generate_jit, init_model_cache, process_logits, row_keys, sample_rows
from tests.tiny_setup import tiny_policy

PAD, R, B, P = 0, 9, 7, 5
PROMPTS = np.random.default_rng(0).integers(2, 16, size=(B, P)).astype(np.int32)
for _i in range(B):
    PROMPTS[_i, :_i % 4] = PAD  # left padding of 0 to 3 tokens
KEY = jax.random.key(3)


@pytest.fixture(scope="module")
def policy():
    return nnx.split(tiny_policy(0))


def lengths_of(responses, stop_token_id):
    """Each response's length: through its first stop token, else R."""
    hits = responses == stop_token_id
    return np.where(hits.any(1), hits.argmax(1) + 1, responses.shape[1])


def simulated_steps(lengths, slots):
    """The decode steps of the slot schedule, simulated in Python: free slots take the waiting prompts in
    order (a prefill samples token 0), each step gives every busy slot one more token."""
    return simulated_schedule(lengths, slots)[0]


def simulated_schedule(lengths, slots):
    """simulated_steps' schedule -> (decode steps, busy slot-steps: a slot holding an unfinished sequence)."""
    remaining, waiting, steps, busy = [0] * slots, list(lengths), 0, 0

    def refill():
        for s in range(slots):
            while remaining[s] == 0 and waiting:
                remaining[s] = waiting.pop(0) - 1  # tokens still to decode after the prefill's
    refill()
    while any(remaining):
        steps += 1
        busy += sum(r > 0 for r in remaining)
        remaining = [max(r - 1, 0) for r in remaining]
        refill()
    return steps, busy


# --------------------------------------------------------------------------------------------------- pieces
def test_write_slots_writes_each_row_at_its_own_slot():
    stack = jnp.zeros((2, 3, 6, 1), jnp.float32)  # [L, B, T, K]
    new = jnp.arange(1, 7, dtype=jnp.float32).reshape(1, 3, 2, 1)  # [1, B, S=2, K]
    got = np.asarray(write_slots(stack, new, jnp.int32(1), jnp.array([0, 3, 4])))
    expected = np.zeros((2, 3, 6, 1), np.float32)
    for b, start in enumerate([0, 3, 4]):
        expected[1, b, start:start + 2, 0] = [2 * b + 1, 2 * b + 2]
    np.testing.assert_array_equal(got, expected)
    same = write_slots(stack, new, jnp.int32(1), jnp.int32(2))  # one index: all rows at slot 2
    np.testing.assert_array_equal(np.asarray(same), np.asarray(write_slots(stack, new, jnp.int32(1),
                                                                           jnp.array([2, 2, 2]))))
    mask = write_slots(jnp.zeros((3, 6), bool), jnp.ones((3, 1), bool), None, jnp.array([5, 0, 2]))
    np.testing.assert_array_equal(np.asarray(mask).nonzero(), ([0, 1, 2], [5, 0, 2]))


def test_a_per_row_index_decodes_each_row_from_its_own_position(policy):
    """Two rows prefilled separately (each one-row cache at index P), stacked with index [P, P], then one
    decode step with row 1 a token further: each row's logits are those of its own one-row cache."""
    graphdef, params = policy
    model = nnx.merge(graphdef, params)

    def prefilled(row):
        cache = init_model_cache(model, 1, P + R, jnp.float32)
        _, cache = model(*sequence_inputs(jnp.asarray(PROMPTS[row:row + 1]), PAD), cache=cache)
        return cache

    def decode(cache, token, position):
        hidden, cache = model(token[:, None], jnp.ones_like(token, bool)[:, None], position[:, None], cache=cache)
        return model.logits(hidden)[:, 0], cache

    positions = (PROMPTS != PAD).sum(1)
    c0, c1 = prefilled(0), prefilled(3)
    _, c1 = decode(c1, jnp.array([5]), jnp.array([positions[3]]))  # row 1 one token ahead
    both = jax.tree.map(lambda a, b: jnp.concatenate([a, b], axis=1 if a.ndim == 5 else 0),
                        c0.replace(index=c0.index[None]), c1.replace(index=c1.index[None]))
    assert both.index.tolist() == [P, P + 1]
    tokens, pos = jnp.array([7, 9]), jnp.array([positions[0], positions[3] + 1])
    logits, both = decode(both, tokens, pos)
    alone0, _ = decode(c0, tokens[:1], pos[:1])
    alone1, _ = decode(c1, tokens[1:], pos[1:])
    np.testing.assert_allclose(np.asarray(logits), np.concatenate([alone0, alone1]), rtol=1e-6, atol=1e-6)
    assert both.index.tolist() == [P + 1, P + 2]


@pytest.mark.parametrize("top_k", [0, 5])
def test_sample_rows_draws_jax_random_categorical_row_by_row(top_k):
    logits = jax.random.normal(jax.random.key(4), (6, 16)) * 3.0
    keys = row_keys(jax.random.key(5), jnp.arange(6), jnp.arange(6)[::-1])
    weights = process_logits(logits, temperature=0.7, top_k=top_k)
    ours = sample_rows(logits, keys, temperature=0.7, top_k=top_k)
    theirs = jax.vmap(jax.random.categorical)(keys, weights)
    np.testing.assert_array_equal(np.asarray(ours), np.asarray(theirs))
    # the key of row b's token t: fold_in(fold_in(key, t), b)
    expected = jax.random.fold_in(jax.random.fold_in(jax.random.key(5), 2), 3)
    assert jnp.array_equal(jax.random.key_data(keys[2]), jax.random.key_data(expected))


# ------------------------------------------------------------------------------- the padded sampler's tokens
OPTIONS = {
    "greedy": dict(greedy=True),
    "categorical": dict(temperature=1.0),
    "categorical_stop": dict(temperature=1.0, stop_token_id=1),
    "top_k_top_p_stop": dict(temperature=1.3, top_k=5, top_p=0.9, stop_token_id=2),
}


@pytest.mark.parametrize("name,slots", [*((name, 3) for name in OPTIONS), ("greedy", 1), ("categorical_stop", 1),
                                        ("top_k_top_p_stop", 2), ("categorical_stop", B)])
def test_each_sequence_gets_the_padded_samplers_tokens(policy, name, slots):
    graphdef, params = policy
    kwargs = dict(response_length=R, pad_token_id=PAD, return_logprobs=True, **OPTIONS[name])
    padded, padded_logprobs = generate_jit(graphdef, params, jnp.asarray(PROMPTS), KEY, **kwargs)
    (ours, logprobs), steps = generate_continuous_jit(graphdef, params, jnp.asarray(PROMPTS), KEY, slots=slots,
                                                      return_steps=True, **kwargs)
    padded, ours = np.asarray(padded), np.asarray(ours)
    np.testing.assert_array_equal(ours, padded)
    stop = OPTIONS[name].get("stop_token_id")
    lengths = lengths_of(padded, stop) if stop is not None else np.full(B, R)
    if stop is not None:
        assert len(set(lengths.tolist())) > 2 and lengths.min() < R - 2, \
            "test precondition: the stop token makes the lengths vary"
    valid = np.arange(R)[None, :] < lengths[:, None]
    np.testing.assert_allclose(np.asarray(logprobs)[valid], np.asarray(padded_logprobs)[valid], rtol=0, atol=1e-5)
    assert int(steps) == simulated_steps(lengths.tolist(), slots)


def test_the_outputs_follow_the_prompts_order(policy):
    """Greedy tokens do not depend on the key: permuted prompts give the permuted outputs, though the
    sequences end in another order (their lengths differ)."""
    graphdef, params = policy
    kwargs = dict(response_length=R, pad_token_id=PAD, greedy=True, stop_token_id=7, slots=2)
    out = np.asarray(generate_continuous_jit(graphdef, params, jnp.asarray(PROMPTS), KEY, **kwargs))
    assert len(set(lengths_of(out, 7).tolist())) > 1, "test precondition: the lengths differ"
    perm = np.array([4, 6, 0, 2, 1, 5, 3])
    permuted = np.asarray(generate_continuous_jit(graphdef, params, jnp.asarray(PROMPTS[perm]), KEY, **kwargs))
    np.testing.assert_array_equal(permuted, out[perm])


def test_decode_steps_follow_the_sum_of_the_lengths(policy):
    """With long-tailed lengths the slots run about sum(lengths) / S steps, the padded loop max(lengths) - 1
    steps of all B rows."""
    graphdef, params = policy
    kwargs = dict(response_length=R, pad_token_id=PAD, temperature=1.0, stop_token_id=1)
    padded = np.asarray(generate_jit(graphdef, params, jnp.asarray(PROMPTS), KEY, **kwargs))
    lengths = lengths_of(padded, 1)
    for slots in (1, 2, 4):
        _, steps = generate_continuous_jit(graphdef, params, jnp.asarray(PROMPTS), KEY, slots=slots,
                                           return_steps=True, **kwargs)
        assert int(steps) == simulated_steps(lengths.tolist(), slots)
        assert int(steps) * slots >= (lengths - 1).sum()
    _, one_slot = generate_continuous_jit(graphdef, params, jnp.asarray(PROMPTS), KEY, slots=1, return_steps=True,
                                          **kwargs)
    assert int(one_slot) == (lengths - 1).sum()


def test_the_occupancy_is_the_share_of_busy_row_steps(policy):
    """occupancy of decode_work (the ``sampling/slot_occupancy`` metric) against Python counts: the padded loop computes
    all B rows at each of its steps until the longest row is done; the slots stay busy while prompts wait."""
    from ppojax.rl.sampler import decode_work, occupancy

    def decode_occupancy(*args):
        return occupancy(*decode_work(*args))

    graphdef, params = policy
    kwargs = dict(response_length=R, pad_token_id=PAD, temperature=1.0, stop_token_id=1)
    padded = np.asarray(generate_jit(graphdef, params, jnp.asarray(PROMPTS), KEY, **kwargs))
    lengths = lengths_of(padded, 1)
    assert lengths.min() < lengths.max() - 1, "test precondition: long and short responses"
    busy = sum(int((lengths > t).sum()) for t in range(1, lengths.max()))  # rows still sampling at step t
    want = busy / (B * (lengths.max() - 1))
    np.testing.assert_allclose(float(decode_occupancy(jnp.asarray(padded), 1, B)), want, rtol=1e-6)
    for slots in (1, 2, 4):
        out, steps = generate_continuous_jit(graphdef, params, jnp.asarray(PROMPTS), KEY, slots=slots,
                                             return_steps=True, **kwargs)
        simulated, busy = simulated_schedule(lengths_of(np.asarray(out), 1).tolist(), slots)
        got = float(decode_occupancy(out, 1, slots, steps))
        np.testing.assert_allclose(got, busy / (simulated * slots), rtol=1e-6)
        assert slots > 1 or got == 1.0  # one slot is never idle
    assert want < 1  # the short rows wasted some of the padded loop's row-steps
    # without a stop token every row samples R tokens; every row stopped at its first token ran no step at all
    np.testing.assert_allclose(float(decode_occupancy(jnp.asarray(padded), None, B)), 1.0)
    np.testing.assert_allclose(float(decode_occupancy(jnp.ones((B, R), jnp.int32), 1, B)), 1.0)


def test_no_recompilation_for_other_prompts_and_keys(policy):
    graphdef, params = policy
    traces = []

    def run(params, prompts, key):
        traces.append(1)
        return generate_continuous(graphdef, params, prompts, key, slots=3, response_length=R, pad_token_id=PAD,
                                   temperature=1.0, stop_token_id=1, return_steps=True)

    run_jit = jax.jit(run)
    first, _ = run_jit(params, jnp.asarray(PROMPTS), KEY)
    other_prompts = np.where(PROMPTS == PAD, PAD, (PROMPTS + 3) % 14 + 2).astype(np.int32)
    second, _ = run_jit(params, jnp.asarray(other_prompts), jax.random.key(11))
    assert not np.array_equal(np.asarray(first), np.asarray(second))
    assert len(traces) == 1 and run_jit._cache_size() == 1


# ------------------------------------------------------------------------------------------ in the program
def test_a_train_step_with_rollout_slots_equals_the_padded_one(monkeypatch):
    """Two PPO iterations of the tiny program (stop token: responses of several lengths): the same metrics and
    parameters with 5 slots as with the padded sampler, and the slots' sampler really ran; the occupancy of each
    sampler's decode loop is in the metrics (its own)."""
    import dataclasses

    from ppojax.rl import rollout
    from ppojax.rl.program import PPOProgram, make_train_steps
    from ppojax.trainer.loop import step_key
    from tests.test_train_step import init_state, prompt_blocks, tiny_program

    calls = []
    original = rollout.generate_continuous
    monkeypatch.setattr(rollout, "generate_continuous", lambda *a, **k: calls.append(k["slots"]) or original(*a, **k))
    padded = tiny_program(num_updates=2)
    settings = padded.settings
    sampling = dataclasses.replace(settings.sampling, rollout_slots=5)
    slotted = PPOProgram(padded.actor_critic, padded.reward, dataclasses.replace(settings, sampling=sampling),
                         padded.optimizer)
    prompts, keys = prompt_blocks(2), jnp.stack([step_key(0, i) for i in range(2)])
    runs = [make_train_steps(program)(init_state(program, 0), prompts, keys) for program in (padded, slotted)]
    assert calls == [5]
    (state_a, metrics_a), (state_b, metrics_b) = runs
    assert (np.asarray(metrics_a["val/num_eos_tokens"]) > 0).all(), "test precondition: some responses stop early"
    occupancy = [np.asarray(metrics.pop(rollout.SLOT_OCCUPANCY)) for metrics in (metrics_a, metrics_b)]
    assert all(((0 < o) & (o <= 1)).all() for o in occupancy) and not np.array_equal(*occupancy), occupancy
    for name, value in metrics_a.items():
        np.testing.assert_allclose(value, metrics_b[name], rtol=1e-6, atol=1e-6, err_msg=name)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6), state_a.params,
                 state_b.params)


def test_rollout_slots_in_the_config():
    from ppojax.errors import ConfigError
    from ppojax.rl.settings import StepSettings
    from ppojax.trainer.config import PPOConfig

    config = PPOConfig(batch_size=8, rollout_slots=3)
    assert StepSettings.from_config(config, pad_token_id=0).sampling.rollout_slots == 3
    assert StepSettings.from_config(PPOConfig(batch_size=8), pad_token_id=0).sampling.rollout_slots == 0
    with pytest.raises(ConfigError, match=r"rollout_slots=9 is more than the 8 rows.*at most 8"):
        PPOConfig(batch_size=8, rollout_slots=9)
    with pytest.raises(ConfigError, match=r"rollout_slots=-1.*>= 0"):
        PPOConfig(rollout_slots=-1)
    # a batch that grows with the mesh is checked when the mesh is known
    grows = PPOConfig(per_device_train_batch_size=4, rollout_slots=8)
    assert grows.derived(2).batch_size == 8
    with pytest.raises(ConfigError, match="rollout_slots=8"):
        grows.derived(1)


SHARDED = """
import jax, jax.numpy as jnp, numpy as np
from ppojax import parallel as sh
from ppojax.rl import placement
from ppojax.rl.continuous import generate_continuous
from ppojax.rl.sampler import generate
import tests.sharding_helpers as H
ac, params, _, _ = H.build_models()
prompts = jnp.asarray(H.prompts()[:8])
kwargs = dict(response_length=6, pad_token_id=H.PAD, temperature=1.0)
unstopped = jax.jit(lambda p, q, k: generate(ac.policy_graphdef, p, q, k, **kwargs))(
    params["policy"], prompts, jax.random.key(0))
stop = int(unstopped[0, 2])  # a token this policy draws: the responses end at different lengths
kwargs["stop_token_id"] = stop
one_device = jax.jit(lambda p, q, k: generate(ac.policy_graphdef, p, q, k, **kwargs))(
    params["policy"], prompts, jax.random.key(0))
mesh = sh.make_mesh(data=2, fsdp=2, tensor=2)
sharded = jax.jit(lambda p, q, k: generate_continuous(ac.policy_graphdef, p, q, k, slots=4, **kwargs,
                  init_cache_fn=placement.make_init_cache_fn(mesh)))(
    sh.shard_params(params["policy"], mesh, sh.GENERATE_RULES), sh.shard_batch(prompts, mesh), jax.random.key(0))
np.testing.assert_array_equal(np.asarray(sharded), np.asarray(one_device))
# each data-parallel shard on its own: 4 shards of 2 rows, 1 slot each, refilled from the shard's own rows
from ppojax.rl.continuous import generate_continuous_per_shard
(tokens, logprobs), steps, slots = jax.jit(lambda p, q, k: generate_continuous_per_shard(
    ac.policy_graphdef, p, q, k, mesh=mesh, slots=4, return_logprobs=True, **kwargs))(
    sh.shard_params(params["policy"], mesh, sh.GENERATE_RULES), sh.shard_batch(prompts, mesh), jax.random.key(0))
np.testing.assert_array_equal(np.asarray(tokens), np.asarray(one_device))
_, want_logprobs = jax.jit(lambda p, q, k: generate(ac.policy_graphdef, p, q, k, return_logprobs=True, **kwargs))(
    params["policy"], prompts, jax.random.key(0))
hits = np.asarray(one_device) == stop
lengths = np.where(hits.any(1), hits.argmax(1) + 1, 6)
sampled = np.arange(6)[None, :] < lengths[:, None]  # after the stop token the log-probs mean nothing
np.testing.assert_allclose(np.asarray(logprobs)[sampled], np.asarray(want_logprobs)[sampled], atol=2e-5, rtol=0)
assert {s.data.shape[0] for s in tokens.addressable_shards} == {2} and slots == 1
print("SHARD-STEPS", [int(x) for x in steps], ";", [int(x) for x in lengths])
print("SHARDED-OK")
"""


@pytest.mark.slow
def test_the_slots_decode_sharded_over_a_mesh():
    """On 8 virtual CPU devices (data 2, fsdp 2, tensor 2: the slot cache split by rows and kv heads), the slots
    give the one-device padded sampler's tokens: one slot cache for the mesh (the refills cross shards: XLA adds the
    communication), and each data-parallel shard with slots of its own refilled from its own rows (what a run on a
    mesh uses), whose steps are each shard's own schedule."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    from tests.xla_test_flags import CHEAP_COMPILES

    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(root),
           "XLA_FLAGS": f"--xla_force_host_platform_device_count=8 {CHEAP_COMPILES}"}
    done = subprocess.run([sys.executable, "-c", SHARDED], cwd=root, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0 and "SHARDED-OK" in done.stdout, done.stderr[-3000:]
    # per shard: the decode steps of its own 2 rows through 1 slot, as the Python schedule plays them
    line = done.stdout.split("SHARD-STEPS")[1].splitlines()[0]
    got, lengths = (json.loads(part) for part in line.split(";"))
    assert got == [simulated_steps(lengths[2 * i:2 * i + 2], 1) for i in range(4)], (got, lengths)
    assert len(set(lengths)) > 1  # the stop token made the lengths differ
