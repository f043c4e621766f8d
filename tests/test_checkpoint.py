"""Checkpoints: bit-exact round trip, keep-last-K, crash safety (leftovers and a real SIGKILL mid-save),
config compatibility and structure-mismatch messages."""
from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from ppojax import checkpoint as ckpt
from ppojax.config import PPOConfig
from ppojax.data import PromptBatches
from ppojax.ppo.controllers import RunningMoments
from ppojax.types import init_train_state
from ppojax.update import make_optimizer

REPO = Path(__file__).resolve().parents[1]


def bits(x) -> tuple:
    """dtype, shape and raw bytes: equal iff bit-for-bit equal (typed keys compared by their key data)."""
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        return ("key", str(jax.random.key_impl(x))) + bits(jax.random.key_data(x))
    a = np.asarray(x)
    return (str(a.dtype), a.shape, a.tobytes())


def assert_bit_equal(a, b):
    la, ta = jax.tree_util.tree_flatten_with_path(a)
    lb, tb = jax.tree_util.tree_flatten_with_path(b)
    assert ta == tb
    for (path, x), (_, y) in zip(la, lb):
        assert bits(x) == bits(y), jax.tree_util.keystr(path)


@functools.lru_cache(maxsize=None)
def trained_state(seed=0, steps=3):
    """A TrainState whose Adam moments and counters are non-trivial (f32 and bf16 parameters); one compile."""
    return jax.jit(_train, static_argnums=(0, 1))(seed, steps)


def _train(seed, steps):
    k1, k2 = jax.random.split(jax.random.key(seed))
    params = {"dense": {"kernel": jax.random.normal(k1, (4, 3)), "bias": jnp.zeros((3,))},
              "head": jax.random.normal(k2, (3,)).astype(jnp.bfloat16)}
    optimizer = make_optimizer()
    state = init_train_state(params, optimizer)
    for i in range(steps):
        grads = jax.tree.map(lambda p: jnp.sin(p.astype(jnp.float32) * (i + 1)).astype(p.dtype), state.params)
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        state = state.replace(params=optax.apply_updates(state.params, updates), opt_state=opt_state,
                              update_count=state.update_count + 1, optimizer_steps=state.optimizer_steps + 1,
                              nonfinite_total=state.nonfinite_total + 2)
    return state


def host_state_for(key, batches, moments):
    return {
        "kl_coef": float(np.float32(0.0512345)),
        "score_moments": {name: float(getattr(moments, name)) for name in ("mean", "std", "var", "count")},
        "rng_key_data": np.asarray(jax.random.key_data(key)),  # uint32, stored with its dtype
        "rng_key": key,                                          # or the typed key itself
        "data": batches.state_dict(),
        "update": 3,
        "episode": 48,
        "nan_is_fine": float("nan"),
    }


def config_dict(**overrides):
    return PPOConfig(**{"model_name_or_path": "tiny", "response_length": 8, **overrides}).to_dict()


def test_round_trip_is_bit_exact(tmp_path):
    state = {"train": trained_state(), "rng": jax.random.key(7)}  # a typed key inside the device pytree
    key = jax.random.key(3_141_592)
    batches = PromptBatches(np.arange(40).reshape(10, 4), batch_size=4, seed=1)
    next(batches), next(batches)
    moments = RunningMoments(*(jnp.asarray(np.float32(v)) for v in (1 / 3, 2 ** 0.5, 1e-7 / 3, 3.0000002)))
    host = host_state_for(key, batches, moments)
    path = ckpt.save_checkpoint(tmp_path / "ckpt", jnp.int32(3), state, host, config_dict())
    assert path == tmp_path / "ckpt" / "step_3" and ckpt.latest_checkpoint(tmp_path / "ckpt") == path

    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
    restored, host2, cfg = ckpt.restore_checkpoint(path, abstract)
    assert_bit_equal(restored, state)
    assert all(r.sharding == s.sharding for r, s in zip(jax.tree.leaves(restored), jax.tree.leaves(state)))
    assert cfg == json.loads(json.dumps(config_dict()))

    # host state: floats back to the same float32 bits, arrays with their dtype, keys as typed keys
    assert np.float32(host2["kl_coef"]) == np.float32(0.0512345)
    again = RunningMoments(**{k: jnp.float32(v) for k, v in host2["score_moments"].items()})
    assert_bit_equal(again, moments)
    assert bits(host2["rng_key_data"]) == bits(jax.random.key_data(key))
    assert bits(host2["rng_key"]) == bits(key)
    assert bits(jax.random.wrap_key_data(jnp.asarray(host2["rng_key_data"]))) == bits(key)
    resumed = PromptBatches(np.arange(40).reshape(10, 4), batch_size=4, seed=1).load_state_dict(host2["data"])
    assert np.array_equal(next(resumed).input_ids, next(batches).input_ids)
    assert (host2["update"], host2["episode"]) == (3, 48) and np.isnan(host2["nan_is_fine"])
    # the restored state keeps training exactly like the original
    step = lambda s: jax.tree.map(lambda p, m: p - m.astype(p.dtype), s.params, s.opt_state[0].mu)  # noqa: E731
    assert_bit_equal(step(restored["train"]), step(state["train"]))
    # a checkpoints directory resolves to its latest complete checkpoint
    assert_bit_equal(ckpt.restore_checkpoint(tmp_path / "ckpt", state)[0], state)


def test_keep_last_k_and_resave(tmp_path):
    state = trained_state()
    for step in range(1, 6):
        ckpt.save_checkpoint(tmp_path, step, state, {"update": step}, config_dict(), save_total_limit=2)
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == ["step_4", "step_5"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_4", "step_5"]  # nothing else left behind
    # saving a step again (e.g. after resuming from it) replaces it atomically
    ckpt.save_checkpoint(tmp_path, 5, state, {"update": 55}, config_dict(), save_total_limit=2)
    assert ckpt.restore_checkpoint(tmp_path / "step_5", state)[1] == {"update": 55}
    # the newest save is always kept, even when an older run left higher steps behind
    ckpt.save_checkpoint(tmp_path, 2, state, {"update": 2}, config_dict(), save_total_limit=1)
    assert (tmp_path / "step_2" / ckpt.COMPLETE).exists()


def test_half_written_checkpoints_are_ignored_and_cleaned(tmp_path):
    state = trained_state()
    good = ckpt.save_checkpoint(tmp_path, 5, state, {"update": 5}, config_dict())
    # crash leftovers: a tmp dir mid-save; a step dir with no marker; a checkpoint caught mid-deletion;
    # a complete-looking dir whose train_state is missing
    (tmp_path / "step_6.tmp" / "train_state").mkdir(parents=True)
    (tmp_path / "step_7" / "train_state").mkdir(parents=True)
    (tmp_path / "step_3.deleting.tmp").mkdir()
    (tmp_path / "step_8").mkdir()
    (tmp_path / "step_8" / ckpt.COMPLETE).write_text("{}")
    (tmp_path / "unrelated.txt").write_text("not ours")
    assert ckpt.latest_checkpoint(tmp_path) == good
    with pytest.raises(ckpt.CheckpointError, match="not a complete checkpoint"):
        ckpt.restore_checkpoint(tmp_path / "step_7", state)
    ckpt.save_checkpoint(tmp_path, 6, state, {"update": 6}, config_dict(), save_total_limit=5)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_5", "step_6", "unrelated.txt"]
    assert ckpt.restore_checkpoint(tmp_path, state)[1] == {"update": 6}


def test_bad_host_state_fails_before_writing(tmp_path):
    with pytest.raises(ckpt.CheckpointError, match=r"host_state\['x'\]\['f'\]: cannot store a function"):
        ckpt.save_checkpoint(tmp_path, 1, trained_state(), {"x": {"f": test_keep_last_k_and_resave}}, {})
    assert not any(tmp_path.iterdir())


def test_structure_mismatch_names_the_tensor(tmp_path):
    state = trained_state()
    path = ckpt.save_checkpoint(tmp_path, 1, state, {}, config_dict())
    other = state.replace(params={**state.params, "head": jnp.zeros((5,), jnp.bfloat16),
                                  "extra": jnp.zeros(2)})
    other = other.replace(opt_state=make_optimizer().init(other.params))
    with pytest.raises(ckpt.CheckpointError) as err:
        ckpt.restore_checkpoint(path, other)
    message = str(err.value)
    assert "params.head: checkpoint bfloat16[3] -> this run bfloat16[5]" in message
    assert "params.extra: in this run's state, not in the checkpoint" in message
    assert "opt_state.0.mu.extra" in message
    with pytest.raises(ckpt.CheckpointError, match=r"params.head: checkpoint bfloat16\[3\] -> this run float32"):
        ckpt.restore_checkpoint(path, state.replace(params={**state.params, "head": jnp.zeros(3)}))


def test_check_compatible_lists_every_difference():
    saved = config_dict(output_dir="a", save_steps=5)
    now = config_dict(model_name_or_path="other", response_length=16, dtype="bfloat16", batch_size=32,
                      output_dir="b", save_steps=10, total_episodes=999, resume="auto", learning_rate=1e-5)
    with pytest.raises(ckpt.CheckpointError) as err:
        ckpt.check_compatible(saved, now)
    message = str(err.value)
    for line in ("batch_size: None -> 32", "dtype: 'float32' -> 'bfloat16'",
                 "model_name_or_path: 'tiny' -> 'other'", "response_length: 8 -> 16"):
        assert line in message
    assert "4 field(s)" in message
    for harmless in ("output_dir", "save_steps", "total_episodes", "resume", "learning_rate"):
        assert f"  {harmless}:" not in message
    # harmless and tunable differences pass; tunable ones are reported for a warning
    relaxed = config_dict(model_name_or_path="tiny", response_length=8, output_dir="b", learning_rate=1e-5)
    assert ckpt.check_compatible(saved, relaxed) == ["learning_rate: 3e-06 -> 1e-05"]
    # per_device_train_batch_size does not matter once the global batch_size is set (and equal)
    assert ckpt.check_compatible(config_dict(batch_size=16, per_device_train_batch_size=2),
                                 config_dict(batch_size=16, per_device_train_batch_size=4)) == []
    # a field an older checkpoint lacks counts as its default; an unknown field is strict
    older = {k: v for k, v in saved.items() if k != "chat_template"}
    assert ckpt.check_compatible(older, saved) == []
    with pytest.raises(ckpt.CheckpointError, match="vocab_size: <absent> -> 512"):
        ckpt.check_compatible(saved, {**saved, "vocab_size": 512})


CRASH_SCRIPT = textwrap.dedent("""
    import sys
    import numpy as np, jax.numpy as jnp
    from ppojax import checkpoint as ckpt

    def tree(offset):  # ~24 MB of float32
        rng = np.random.default_rng(0)
        return {f"w{i}": jnp.asarray(rng.standard_normal((1000, 2000), np.float32) + offset) for i in range(3)}

    directory = sys.argv[1]
    ckpt.save_checkpoint(directory, 1, tree(0.0), {"update": 1}, {"m": "x"}, save_total_limit=1)
    print("SAVED 1", flush=True)
    big = tree(1.0)
    print("SAVING 2", flush=True)
    ckpt.save_checkpoint(directory, 2, big, {"update": 2}, {"m": "x"}, save_total_limit=1)
    print("SAVED 2", flush=True)
""")


def expected_tree(offset):
    rng = np.random.default_rng(0)
    return {f"w{i}": rng.standard_normal((1000, 2000), np.float32) + np.float32(offset) for i in range(3)}


def _start_saver(tmp_path, kill_at):
    directory = tmp_path / kill_at
    script = tmp_path / "crash.py"
    script.write_text(CRASH_SCRIPT)
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(REPO)}
    env.pop(ckpt.PAUSE_ENV, None)
    if kill_at != "orbax_writing":
        env[ckpt.PAUSE_ENV] = f"{kill_at}@2"
    proc = subprocess.Popen([sys.executable, str(script), str(directory)], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, env=env)
    return proc, directory


def _bytes_under(path) -> int:
    total = 0
    for dirpath, _, files in os.walk(path):
        for name in files:
            try:
                total += os.stat(os.path.join(dirpath, name)).st_size
            except FileNotFoundError:
                pass
    return total


def _kill_when_reached(proc, directory, kill_at):
    wanted = "SAVING 2" if kill_at == "orbax_writing" else f"PPOJAX_PAUSED {kill_at} 2"
    deadline = time.time() + 120
    for line in proc.stdout:
        if line.strip() == wanted:
            break
    else:
        pytest.fail(f"the saving process ended before {wanted!r}")
    if kill_at == "orbax_writing":  # kill once orbax has written some (not all) of step 2's array bytes
        tmp = directory / "step_2.tmp"
        while _bytes_under(tmp) < 1_000_000 and time.time() < deadline:
            time.sleep(0.0005)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL


def test_sigkill_during_save_keeps_the_previous_checkpoint(tmp_path):
    """A real SIGKILL while saving ~24 MB (mid orbax write; and after COMPLETE is written but before the
    commit rename): the previous checkpoint restores bit for bit, and the next save cleans up."""
    kill_points = ["orbax_writing", "marked"]
    procs = {k: _start_saver(tmp_path, k) for k in kill_points}  # concurrently: the imports dominate
    try:
        for kill_at, (proc, directory) in procs.items():
            _kill_when_reached(proc, directory, kill_at)
    finally:
        for proc, _ in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    target = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in expected_tree(0).items()}
    for kill_at, (_, directory) in procs.items():
        assert (directory / "step_2.tmp").is_dir() and not (directory / "step_2").exists(), kill_at
        latest = ckpt.latest_checkpoint(directory)
        assert latest == directory / "step_1", kill_at
        restored, host, _ = ckpt.restore_checkpoint(latest, target)
        assert host == {"update": 1}
        for name, want in expected_tree(0).items():
            assert bits(restored[name]) == bits(want), (kill_at, name)
        # the next save removes the leftover tmp dir and, with limit 1, the older checkpoint
        ckpt.save_checkpoint(directory, 2, {"w": jnp.ones(3)}, {"update": 2}, {"m": "x"}, save_total_limit=1)
        assert sorted(p.name for p in directory.iterdir()) == ["step_2"], kill_at


SHARDED_SCRIPT = textwrap.dedent("""
    import sys
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from ppojax import checkpoint as ckpt
    assert jax.device_count() == 4, jax.devices()
    mesh = Mesh(np.array(jax.devices()).reshape(4), ("fsdp",))
    w = jax.device_put(jnp.arange(32.0).reshape(8, 4), NamedSharding(mesh, P("fsdp", None)))
    state = {"w": w, "count": jnp.int32(3)}
    ckpt.save_checkpoint(sys.argv[1], 1, state, {}, {})
    # resume on a different layout: 2 x 2 mesh, sharded over both axes
    mesh2 = Mesh(np.array(jax.devices()).reshape(2, 2), ("data", "tensor"))
    target = {"w": jax.ShapeDtypeStruct((8, 4), jnp.float32, sharding=NamedSharding(mesh2, P("data", "tensor"))),
              "count": jax.ShapeDtypeStruct((), jnp.int32, sharding=NamedSharding(mesh2, P()))}
    restored, _, _ = ckpt.restore_checkpoint(sys.argv[1], target)
    assert restored["w"].sharding == target["w"].sharding, restored["w"].sharding
    assert len(restored["w"].addressable_shards) == 4 and restored["w"].addressable_shards[0].data.shape == (4, 2)
    assert np.array_equal(np.asarray(restored["w"]), np.arange(32.0).reshape(8, 4))
    assert int(restored["count"]) == 3
    print("SHARDED OK")
""")


def test_sharded_state_restores_into_the_target_sharding(tmp_path):
    script = tmp_path / "sharded.py"
    script.write_text(SHARDED_SCRIPT)
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(REPO),
           "XLA_FLAGS": os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"}
    out = subprocess.run([sys.executable, str(script), str(tmp_path / "ckpt")], capture_output=True, text=True,
                         env=env, timeout=120)
    assert "SHARDED OK" in out.stdout, out.stderr[-3000:]


def test_relative_checkpoint_directory(tmp_path, monkeypatch):
    """A relative output_dir (the demo's `outputs/demo`) saves and restores: orbax itself refuses relative paths."""
    monkeypatch.chdir(tmp_path)
    state = {"train": trained_state()}
    path = ckpt.save_checkpoint("runs/ckpt", 2, state, {"update": 2}, config_dict())
    assert (tmp_path / path).is_dir() and ckpt.latest_checkpoint("runs/ckpt") is not None
    restored, host, _ = ckpt.restore_checkpoint("runs/ckpt", state)
    assert_bit_equal(restored, state)
    assert host["update"] == 2
