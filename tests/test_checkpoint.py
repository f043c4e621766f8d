"""Checkpoints: bit-exact round trip, keep-last-K, crash safety (leftovers and a real SIGKILL mid-save),
config compatibility and structure-mismatch messages; manifests and damage (each damaged checkpoint skipped
with one line, the older one restored), save_total_limit after real crashes, a full disk (ulimit -f); asynchronous
saves (the caller goes on while orbax writes)."""
from __future__ import annotations

import errno
import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import zlib
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from ppojax.io import checkpoint as ckpt
from ppojax.trainer.config import check_compatible
from ppojax.io import file_manifest
from ppojax.trainer.config import PPOConfig
from ppojax.trainer.data import PromptBatches
from ppojax.core.controllers import RunningMoments
from ppojax.rl.settings import Hyperparams
from ppojax.rl.types import init_train_state
from ppojax.rl.optimizer import make_optimizer

REPO = Path(__file__).resolve().parents[1]
UNFINISHED = "step_{}.orbax-checkpoint-tmp"  # where orbax writes a step until it renames it


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
    state = init_train_state(params, optimizer, hyperparams=Hyperparams.create())
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



def test_a_released_target_is_freed_before_the_read_and_kept_when_the_checkpoint_differs(tmp_path):
    """release_target=True (a resume): the target's arrays are deleted before the checkpoint's are read, so the
    state is never held twice, and the restored state is the saved one; a checkpoint that does not match the
    target is refused with the target still intact."""
    state = trained_state()
    path = ckpt.save_checkpoint(tmp_path, 1, state, {"update": 1}, config_dict())
    different = state.replace(params={**state.params, "head": jnp.zeros((5,), jnp.bfloat16)})
    with pytest.raises(ckpt.CheckpointError, match="params.head"):
        ckpt.restore_checkpoint(path, different, release_target=True)
    assert not any(leaf.is_deleted() for leaf in jax.tree.leaves(different))
    target = jax.tree.map(jnp.zeros_like, state)
    restored, host, _ = ckpt.restore_checkpoint(path, target, release_target=True)
    assert all(leaf.is_deleted() for leaf in jax.tree.leaves(target))
    assert_bit_equal(restored, state)
    assert host == {"update": 1}

def test_check_compatible_lists_every_difference():
    saved = config_dict(output_dir="a", save_steps=5)
    now = config_dict(model_name_or_path="other", response_length=16, precision="bfloat16", batch_size=32,
                      output_dir="b", save_steps=10, total_episodes=999, resume="auto", learning_rate=1e-5)
    with pytest.raises(ckpt.CheckpointError) as err:
        check_compatible(saved, now)
    message = str(err.value)
    for line in ("batch_size: None -> 32", "precision: 'float32' -> 'bfloat16'",
                 "model_name_or_path: 'tiny' -> 'other'", "response_length: 8 -> 16"):
        assert line in message
    assert "4 field(s)" in message
    for harmless in ("output_dir", "save_steps", "total_episodes", "resume", "learning_rate"):
        assert f"  {harmless}:" not in message
    # harmless and tunable differences pass; tunable ones are reported for a warning
    relaxed = config_dict(model_name_or_path="tiny", response_length=8, output_dir="b", learning_rate=1e-5)
    assert check_compatible(saved, relaxed) == ["learning_rate: 3e-06 -> 1e-05"]
    # per_device_train_batch_size does not matter once the global batch_size is set (and equal)
    assert check_compatible(config_dict(batch_size=16, per_device_train_batch_size=2),
                                 config_dict(batch_size=16, per_device_train_batch_size=4)) == []
    # a field an older checkpoint lacks counts as its default; an unknown field is strict
    older = {k: v for k, v in saved.items() if k != "chat_template"}
    assert check_compatible(older, saved) == []
    with pytest.raises(ckpt.CheckpointError, match="vocab_size: <absent> -> 512"):
        check_compatible(saved, {**saved, "vocab_size": 512})


CRASH_SCRIPT = textwrap.dedent("""
    import sys
    import numpy as np, jax.numpy as jnp
    from ppojax.io import checkpoint as ckpt

    def tree(offset):  # ~24 MB of float32
        rng = np.random.default_rng(0)
        return {f"w{i}": jnp.asarray(rng.standard_normal((1000, 2000), np.float32) + offset) for i in range(3)}

    directory = sys.argv[1]
    if sys.argv[2] != "orbax_writing":
        from tests.save_faults import pause_at
        pause_at(sys.argv[2], 2)
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
    proc = subprocess.Popen([sys.executable, str(script), str(directory), kill_at], stdout=subprocess.PIPE,
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
        tmp = directory / UNFINISHED.format(2)
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
        assert (directory / UNFINISHED.format(2)).is_dir() and not (directory / "step_2").exists(), kill_at
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
    from ppojax.io import checkpoint as ckpt
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


# ----------------------------------------------------------------------------------------------------------
# manifests, damage, resume choice


def small_tree(step: int) -> dict:
    """A state whose values depend on the step (so the restored checkpoint is identifiable); one ~32 kB file."""
    rng = np.random.default_rng(step)
    return {"w": jnp.asarray(rng.standard_normal((64, 128), np.float32)),
            "b": jnp.asarray(rng.standard_normal(5), jnp.bfloat16), "n": jnp.int32(step)}


def files_of(path: Path) -> dict[str, int]:
    """Every file under a checkpoint (relative name -> size), walked independently of the module."""
    out = {}
    for dirpath, _, names in os.walk(path):
        for name in names:
            full = Path(dirpath, name)
            out[full.relative_to(path).as_posix()] = full.stat().st_size
    return out


def largest_state_file(path: Path) -> str:
    sizes = {k: v for k, v in files_of(path).items() if k.startswith("train_state/")}
    return max(sizes, key=sizes.get)


def block_crcs(path: Path, block_size: int) -> list[str]:
    """Reference: CRC32 of each block_size piece of the file, read in one plain loop."""
    out = []
    with open(path, "rb") as f:
        while True:
            block = f.read(block_size)
            if not block and out:
                break
            out.append(f"{zlib.crc32(block):08x}")
            if len(block) < block_size:
                break
    return out


def test_manifest_lists_every_file_with_size_and_checksum(tmp_path, monkeypatch):
    monkeypatch.setattr(file_manifest, "BLOCK_SIZE", 4096)  # several blocks per data file
    path = ckpt.save_checkpoint(tmp_path, 3, small_tree(3), {"update": 3}, config_dict())
    on_disk = files_of(path)
    raw = (path / ckpt.MANIFEST_FILE).read_bytes()
    manifest = json.loads(raw)
    assert json.loads((path / ckpt.COMPLETE).read_text())["manifest_crc32"] == f"{zlib.crc32(raw):08x}"
    assert manifest["block_size"] == 4096 and manifest["checksum"] == "crc32"
    assert set(manifest["files"]) == set(on_disk) - {ckpt.COMPLETE, ckpt.MANIFEST_FILE, *ckpt.ORBAX_FILES}
    assert {ckpt.CONFIG_FILE, ckpt.HOST_STATE_FILE} < set(manifest["files"])
    for name, entry in manifest["files"].items():
        assert entry["size"] == on_disk[name], name
        assert entry["crc32"] == block_crcs(path / name, 4096), name
    assert max(len(e["crc32"]) for e in manifest["files"].values()) >= 8  # the ~32 kB data file: 8+ blocks
    assert ckpt.verify_checkpoint(path) == (True, f"{len(manifest['files'])} files match their sizes and checksums")


def _truncate(path: Path, rel: str):
    full = path / rel
    before = full.stat().st_size
    with open(full, "r+b") as f:
        f.truncate(before // 2)
    return f"model state file {rel} is {before // 2:,} bytes, the manifest says {before:,} (truncated)"


def _corrupt(path: Path, rel: str):  # same size, one byte flipped in the middle
    full = path / rel
    size = full.stat().st_size
    with open(full, "r+b") as f:
        f.seek(size // 2)
        byte = f.read(1)
        f.seek(size // 2)
        f.write(bytes([byte[0] ^ 0xFF]))
    assert full.stat().st_size == size
    return (f"model state file {rel} has changed contents: bytes 0-{size - 1:,} do not match the manifest's "
            "checksum (same size)")


def _delete_state_file(path: Path, rel: str):
    (path / rel).unlink()
    return f"model state file {rel} is missing"


def _delete_config(path: Path, rel: str):
    (path / ckpt.CONFIG_FILE).unlink()
    return f"config file {ckpt.CONFIG_FILE} is missing"


def _config_not_json(path: Path, rel: str):  # rewritten, same size, not JSON
    size = (path / ckpt.CONFIG_FILE).stat().st_size
    (path / ckpt.CONFIG_FILE).write_bytes(b"{" * size)
    return (f"config file {ckpt.CONFIG_FILE} is not valid JSON (Expecting property name enclosed in double quotes: "
            "line 1 column 2 (char 1))")


def _delete_complete(path: Path, rel: str):
    (path / ckpt.COMPLETE).unlink()
    return "not a complete checkpoint: no COMPLETE marker (its save was interrupted, or the marker was deleted)"


def _delete_manifest(path: Path, rel: str):
    (path / ckpt.MANIFEST_FILE).unlink()
    return "MANIFEST.json is missing"


DAMAGES = [_truncate, _corrupt, _delete_state_file, _delete_config, _config_not_json, _delete_complete,
           _delete_manifest]


@pytest.mark.parametrize("damage", DAMAGES, ids=lambda f: f.__name__.strip("_"))
def test_damaged_latest_checkpoint_is_skipped_in_one_line(tmp_path, capfd, damage):
    """The newest checkpoint is damaged: verify names the file and what is wrong; resume skips it with ONE
    line and restores the older one bit for bit; restoring it explicitly is one CheckpointError; the next
    save moves it aside (it holds data) and save_total_limit counts only intact checkpoints."""
    d = tmp_path / "checkpoints"
    ckpt.save_checkpoint(d, 6, small_tree(6), {"update": 6}, config_dict())
    step_8 = ckpt.save_checkpoint(d, 8, small_tree(8), {"update": 8}, config_dict())
    reason = damage(step_8, largest_state_file(step_8))

    assert ckpt.verify_checkpoint(step_8) == (False, reason)
    lines: list[str] = []
    assert ckpt.latest_checkpoint(d, log=lines.append) == d / "step_6"
    assert lines == [f"skipping {step_8}: {reason}; using step_6"]

    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), small_tree(0))
    capfd.readouterr()
    restored, host, _ = ckpt.restore_checkpoint(d, target)  # the default log: one line on stderr
    assert_bit_equal(restored, small_tree(6))
    assert host == {"update": 6}
    out, err = capfd.readouterr()
    assert err == f"ppojax: skipping {step_8}: {reason}; using step_6\n" and out == ""

    with pytest.raises(ckpt.CheckpointError) as raised:
        ckpt.restore_checkpoint(step_8, target)
    assert str(raised.value) == f"cannot resume from {step_8}: {reason}; the newest intact checkpoint beside it " \
                                f"is {d / 'step_6'}."
    assert ckpt.resolve_checkpoint("auto", d, log=lambda m: None) == d / "step_6"

    # the resumed run (its checkpoints, as a trainer's: what resume found is known when it saves) saves step 7
    # with save_total_limit=1: the damaged step_8 is moved aside (not counted, not deleted), step_6 is deleted
    # because the intact step_7 now exists
    moved: list[str] = []
    with ckpt.RunCheckpoints(d, save_total_limit=1, log=moved.append) as checkpoints:
        assert checkpoints.resolve("auto") == d / "step_6"
        assert moved == [f"skipping {step_8}: {reason}; using step_6"]
        moved.clear()
        checkpoints.save(7, small_tree(7), {"update": 7}, config_dict())
    assert moved == [f"moved damaged checkpoint {step_8} aside to {d / 'damaged' / 'step_8'}: {reason}"]
    assert sorted(p.name for p in d.iterdir()) == ["damaged", "step_7"]
    assert ckpt.verify_checkpoint(d / "damaged" / "step_8") == (False, reason)
    assert ckpt.latest_checkpoint(d, log=lambda m: pytest.fail(m)) == d / "step_7"
    out, err = capfd.readouterr()
    assert "Traceback" not in out + err and "ERROR" not in out + err


def test_changed_bytes_name_their_block(tmp_path, monkeypatch):
    monkeypatch.setattr(file_manifest, "BLOCK_SIZE", 4096)
    path = ckpt.save_checkpoint(tmp_path, 1, small_tree(1), {}, config_dict())
    rel = largest_state_file(path)
    assert (path / rel).stat().st_size > 12_288
    with open(path / rel, "r+b") as f:
        f.seek(10_000)
        byte = f.read(1)
        f.seek(10_000)
        f.write(bytes([byte[0] ^ 1]))  # one bit
    reason = (f"model state file {rel} has changed contents: bytes 8,192-12,287 do not match the manifest's "
              "checksum (same size)")
    assert ckpt.verify_checkpoint(path) == (False, reason)
    assert ckpt.verify_checkpoint(path, checksums=False)[0]  # the sizes alone cannot see it
    # the sizes-only check a save makes of older checkpoints still knows what the run's checks found
    checkpoints = ckpt.RunCheckpoints(tmp_path)
    assert checkpoints.verify(path) == (False, reason)
    assert checkpoints.verify(path, checksums=False) == (False, reason)


def test_edited_manifest_is_damage(tmp_path):
    path = ckpt.save_checkpoint(tmp_path, 1, small_tree(1), {}, config_dict())
    manifest = json.loads((path / ckpt.MANIFEST_FILE).read_text())
    manifest["files"][ckpt.CONFIG_FILE]["size"] += 1
    (path / ckpt.MANIFEST_FILE).write_text(json.dumps(manifest))
    assert ckpt.verify_checkpoint(path) == (False, "MANIFEST.json does not match the checksum recorded in COMPLETE")


UNREADABLE_SCRIPT = textwrap.dedent("""
    import sys
    import numpy as np, jax, jax.numpy as jnp
    from ppojax.io import checkpoint as ckpt

    def tree(step):
        rng = np.random.default_rng(step)
        return {"w": jnp.asarray(rng.standard_normal((64, 128), np.float32)),
                "b": jnp.asarray(rng.standard_normal(5), jnp.bfloat16), "n": jnp.int32(step)}

    path = ckpt.save_checkpoint(sys.argv[1], 5, tree(5), {"update": 5}, {})
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree(0))
    data = max((p for p in (path / "train_state").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    with open(data, "r+b") as f:
        f.truncate(100)
    ckpt._seal(path, 5)  # damage the manifest vouches for (e.g. the disk returned bad bytes when it was written)
    print(ckpt.verify_checkpoint(path)[0], flush=True)
    messages = set()
    for attempt in range(5):  # orbax abandons work at a different point each time
        try:
            ckpt.restore_checkpoint(path, target)
        except ckpt.CheckpointError as err:
            assert err.__cause__ is not None  # orbax's error stays chained for whoever debugs it
            messages.add(str(err))
    for message in messages:  # as the CLI: print the message, exit
        print(f"ppojax: error: {message}", file=sys.stderr, flush=True)
    sys.exit(1)
""")


def test_damage_orbax_meets_while_reading_is_one_error(tmp_path):
    """Damage the manifest cannot see (it was checksummed as it is) and orbax meets while reading: ONE
    CheckpointError (the orbax/tensorstore error chained), and nothing else is printed, then or at exit
    (orbax's abandoned coroutines, if collected later, would print tracebacks)."""
    script = tmp_path / "unreadable.py"
    script.write_text(UNREADABLE_SCRIPT)
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, str(script), str(tmp_path / "checkpoints")], capture_output=True,
                         text=True, env=env, timeout=120)
    assert out.returncode == 1, out.stderr[-3000:]
    assert out.stdout == "True\n"
    lines = out.stderr.splitlines()
    path = tmp_path / "checkpoints" / "step_5"
    assert len(lines) == 1, out.stderr[-3000:]
    assert lines[0].startswith(f"ppojax: error: cannot read the model state in {path} (train_state/): ")


def test_resolve_checkpoint_paths(tmp_path):
    out_dir = tmp_path / "run"
    d = out_dir / "checkpoints"
    with pytest.raises(ckpt.CheckpointError) as raised:
        ckpt.resolve_checkpoint(tmp_path / "nope" / "step_3")
    assert str(raised.value) == (f"checkpoint path {tmp_path / 'nope' / 'step_3'} does not exist; give a step_N "
                                 "checkpoint, a checkpoints directory, or resume: auto.")
    with pytest.raises(ckpt.CheckpointError, match="checkpoint path .*nope does not exist"):
        ckpt.restore_checkpoint(tmp_path / "nope", small_tree(0))
    assert ckpt.resolve_checkpoint("auto", d) is None  # nothing saved yet: start fresh
    d.mkdir(parents=True)
    assert ckpt.resolve_checkpoint(True, d) is None
    with pytest.raises(ckpt.CheckpointError, match=r"no checkpoint under .*checkpoints \(looked for step_<N>/"):
        ckpt.resolve_checkpoint(d)
    for step in (2, 4):
        ckpt.save_checkpoint(d, step, small_tree(step), {}, config_dict())
    for where in ("auto", True):
        assert ckpt.resolve_checkpoint(where, d) == d / "step_4"
    assert ckpt.resolve_checkpoint(d) == d / "step_4"          # a checkpoints directory
    assert ckpt.resolve_checkpoint(out_dir) == d / "step_4"    # a run's output_dir
    assert ckpt.resolve_checkpoint(d / "step_2") == d / "step_2"
    assert ckpt.read_checkpoint_config(d / "step_2") == json.loads(json.dumps(config_dict()))
    # every checkpoint damaged: resume refuses (rather than silently starting over), one line each
    for step in (2, 4):
        (d / f"step_{step}" / ckpt.CONFIG_FILE).unlink()
    lines: list[str] = []
    with pytest.raises(ckpt.CheckpointError) as raised:
        ckpt.resolve_checkpoint("auto", d, log=lines.append)
    assert str(raised.value) == (f"none of the 2 checkpoint(s) under {d} is intact (each is named above with what "
                                 "is wrong): restore the missing files, or move them aside to start a fresh run.")
    assert lines == [f"skipping {d / f'step_{s}'}: config file {ckpt.CONFIG_FILE} is missing; no intact checkpoint "
                     "is left" for s in (4, 2)]
    with pytest.raises(ckpt.CheckpointError, match=f"config file {ckpt.CONFIG_FILE} is missing"):
        ckpt.read_checkpoint_config(d / "step_2")


LIMIT_SCRIPT = textwrap.dedent("""
    import sys
    import numpy as np, jax.numpy as jnp
    from ppojax.io import checkpoint as ckpt

    def tree(step):
        rng = np.random.default_rng(step)
        return {"w": jnp.asarray(rng.standard_normal((256, 256), np.float32))}

    from tests.save_faults import pause_at
    pause_at(sys.argv[2], 4)
    for step in (1, 2, 3, 4):  # paused (then killed) at a stage of step 4's save
        ckpt.save_checkpoint(sys.argv[1], step, tree(step), {"update": step}, {"m": "x"}, save_total_limit=2)
""")


def test_save_total_limit_holds_after_real_crashes(tmp_path):
    """Runs with save_total_limit=2 are SIGKILLed at each stage of a save; a checkpoint is then damaged. The
    next save leaves exactly the intact checkpoints the limit allows, no debris, and the damaged one aside."""
    script = tmp_path / "limit.py"
    script.write_text(LIMIT_SCRIPT)
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(REPO)}
    stages = ["started", "state_written", "marked", "committed"]
    procs = {}
    for stage in stages:
        procs[stage] = subprocess.Popen([sys.executable, str(script), str(tmp_path / stage), stage], text=True,
                                        env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    try:
        for stage, proc in procs.items():
            assert proc.stdout.readline().strip() == f"PPOJAX_PAUSED {stage} 4", stage
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=30)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    # what each crash left: the limit is broken after "committed" (step_2 not yet deleted)
    left = {stage: sorted(p.name for p in (tmp_path / stage).iterdir()) for stage in stages}
    unfinished = UNFINISHED.format(4)
    assert left == {"started": ["step_2", "step_3"], "state_written": ["step_2", "step_3", unfinished],
                    "marked": ["step_2", "step_3", unfinished], "committed": ["step_2", "step_3", "step_4"]}

    def intact(directory):
        return [p.name for p in ckpt.list_checkpoints(directory) if ckpt.verify_checkpoint(p)[0]]

    for stage in stages:
        plain, damaged = tmp_path / stage, tmp_path / f"{stage}-damaged"
        shutil.copytree(plain, damaged)
        newest = ckpt.list_checkpoints(damaged)[-1]
        reason = _truncate(newest, largest_state_file(newest))
        for directory in (plain, damaged):
            lines: list[str] = []
            ckpt.save_checkpoint(directory, 5, small_tree(5), {}, config_dict(), save_total_limit=2,
                                 log=lines.append)
            names = sorted(p.name for p in directory.iterdir())
            if directory == plain:
                want = ["step_4", "step_5"] if stage == "committed" else ["step_3", "step_5"]
                assert names == want and intact(directory) == want and lines == [], stage
            else:  # the damaged newest is moved aside and not counted: the older intact one is kept
                want = ["step_3", "step_5"] if stage == "committed" else ["step_2", "step_5"]
                assert names == ["damaged"] + want and intact(directory) == want, stage
                assert lines == [f"moved damaged checkpoint {newest} aside to {directory / 'damaged' / newest.name}: "
                                 f"{reason}"], stage


FULL_DISK_SCRIPT = textwrap.dedent("""
    import resource, signal, sys
    import numpy as np, jax.numpy as jnp
    from ppojax.io import checkpoint as ckpt

    # As the CLI must: without this, a write past `ulimit -f` kills the process (SIGXFSZ) instead of failing
    # with EFBIG.
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)

    def tree(step, n):
        return {"w": jnp.asarray(np.random.default_rng(step).standard_normal(n, np.float32))}

    directory = sys.argv[1]
    ckpt.save_checkpoint(directory, 6, tree(6, 1000), {"update": 6}, {"m": "x"}, save_total_limit=1)
    resource.setrlimit(resource.RLIMIT_FSIZE, (256 * 1024, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
    failed = 0
    for state, host in [(tree(8, 250_000), {"update": 8}),                     # ~1 MB array: orbax's write
                        (tree(8, 1000), {"update": 8, "big": np.zeros(60_000)})]:  # ~300 kB host_state.json
        try:
            ckpt.save_checkpoint(directory, 8, state, host, {"m": "x"}, save_total_limit=1)
        except ckpt.CheckpointError as err:
            print(f"ppojax: error: {err}", file=sys.stderr, flush=True)
            failed += 1
    sys.exit(1 if failed else 0)
""")


def test_full_disk_is_one_message_and_keeps_the_previous_checkpoint(tmp_path):
    """A real write failure (EFBIG past `ulimit -f`), in orbax's background writers and in the JSON files: one
    message each, no traceback or orbax log, no .tmp left, the previous checkpoint intact and restorable."""
    script = tmp_path / "full.py"
    script.write_text(FULL_DISK_SCRIPT)
    directory = tmp_path / "checkpoints"
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, str(script), str(directory)], capture_output=True, text=True, env=env,
                         timeout=120)
    message = (f"ppojax: error: file too large while writing {directory / 'step_8'}; the previous checkpoint "
               "step_6 is intact; raise the file size limit (`ulimit -f unlimited`) or use a file system that "
               "allows larger files.")
    assert out.returncode == 1, out.stderr[-3000:]
    assert out.stderr.splitlines() == [message, message] and out.stdout == ""
    assert sorted(p.name for p in directory.iterdir()) == ["step_6"]
    assert ckpt.verify_checkpoint(directory / "step_6")[0]
    target = {"w": jax.ShapeDtypeStruct((1000,), jnp.float32)}
    restored, host, _ = ckpt.restore_checkpoint(directory, target)
    assert host == {"update": 6}
    assert bits(restored["w"]) == bits(np.random.default_rng(6).standard_normal(1000, np.float32))


LIBRARY_LOG_SCRIPT = textwrap.dedent("""
    import atexit, resource, signal, sys
    from pathlib import Path
    import numpy as np, jax.numpy as jnp
    from ppojax.io import checkpoint as ckpt
    from ppojax.io.library_logs import library_output_to

    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    atexit.register(lambda: print("atexit ran", flush=True))
    directory, log = Path(sys.argv[1]), Path(sys.argv[2])
    # arrays that fit under the limit and arrays that do not, in one item: orbax abandons the writes of the
    # others at the first failure
    rng = np.random.default_rng(0)
    state = {f"w{i}": jnp.asarray(rng.standard_normal(n, np.float32)) for i, n in enumerate([200_000, 20_000] * 6)}
    with library_output_to(log):
        with ckpt.RunCheckpoints(directory) as checkpoints:
            checkpoints.save(1, {"w": jnp.ones(3)}, {}, {})
            resource.setrlimit(resource.RLIMIT_FSIZE, (256 * 1024, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
            try:
                checkpoints.save(2, state, {}, {}, wait=False)
                checkpoints.close()
            except ckpt.CheckpointError as err:
                print(f"ppojax: error: {err}", file=sys.stderr, flush=True)
                failed = err
    sys.exit(1 if failed else 0)
""")


def test_a_failed_save_keeps_orbax_reports_in_the_library_log(tmp_path):
    """A failed save during a run that keeps the libraries' output in a file (as `ppojax train` does): ONE line on
    the terminal, orbax's own error records (with their tracebacks) in the file, no unfinished save left, and the
    process ends the ordinary way (exit code 1, atexit handlers run) with nothing printed after the line."""
    script = tmp_path / "failed_save.py"
    script.write_text(LIBRARY_LOG_SCRIPT)
    directory, log = tmp_path / "checkpoints", tmp_path / "libraries.log"
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, str(script), str(directory), str(log)], capture_output=True, text=True,
                         env=env, timeout=120)
    assert out.returncode == 1, out.stderr[-3000:]
    assert out.stderr.splitlines() == [
        f"ppojax: error: file too large while writing {directory / 'step_2'}; the previous checkpoint step_1 is "
        "intact; raise the file size limit (`ulimit -f unlimited`) or use a file system that allows larger files."]
    assert out.stdout == "atexit ran\n"
    assert sorted(p.name for p in directory.iterdir()) == ["step_1"]
    records = log.read_text()
    assert " ERROR absl: " in records and "Traceback (most recent call last)" in records, records[-3000:]
    assert "File too large" in records and "os_error_code='27'" in records, records[-3000:]


def test_no_space_left_message(tmp_path, monkeypatch):
    """ENOSPC (which needs a small file system to cause for real) words the message for a full disk."""
    real_write = ckpt._write_bytes

    def full_disk(path, data):
        if path.name == ckpt.MANIFEST_FILE:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        real_write(path, data)

    monkeypatch.setattr(ckpt, "_write_bytes", full_disk)
    with pytest.raises(ckpt.CheckpointError) as raised:
        ckpt.save_checkpoint(tmp_path, 2, small_tree(2), {}, config_dict())
    assert str(raised.value) == (f"no space left on device while writing {tmp_path / 'step_2'}; no earlier "
                                 "checkpoint exists; free space or set save_total_limit.")
    assert isinstance(raised.value.__cause__, OSError) and not any(tmp_path.iterdir())
    monkeypatch.setattr(ckpt, "_write_bytes", real_write)
    ckpt.save_checkpoint(tmp_path, 2, small_tree(2), {}, config_dict())
    monkeypatch.setattr(ckpt, "_write_bytes", full_disk)
    with pytest.raises(ckpt.CheckpointError, match="; the previous checkpoint step_2 is intact; free space"):
        ckpt.save_checkpoint(tmp_path, 3, small_tree(3), {}, config_dict())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_2"]


def test_an_asynchronous_save_returns_before_its_files_and_restores_bit_exact(tmp_path, monkeypatch):
    """wait=False returns once orbax holds the state in host memory, before any file is final: the caller may
    delete (donate) its arrays at once, and the checkpoint written in the background restores bit for bit.
    The write is held (the manifest cannot be written) until the test lets it go, so the order is certain."""
    import threading

    written, real_seal = threading.Event(), ckpt._seal
    monkeypatch.setattr(ckpt, "_seal", lambda path, step: (written.wait(60), real_seal(path, step)))
    rng = np.random.default_rng(11)
    want = {"w": rng.standard_normal((1000, 1000), np.float32), "b": rng.standard_normal(7).astype(jnp.bfloat16)}
    state = {k: jnp.asarray(v) for k, v in want.items()}
    saved: list[int] = []
    checkpoints = ckpt.RunCheckpoints(tmp_path, on_saved=saved.append)
    path = checkpoints.save(1, state, {"update": 1}, config_dict(), wait=False)
    assert not path.exists() and saved == []  # returned while orbax's thread writes
    for leaf in state.values():
        leaf.delete()  # as the next update's donation does
    written.set()
    assert checkpoints.latest() == path  # the run's readers wait for its save in flight
    assert saved == [1] and ckpt.verify_checkpoint(path)[0]
    checkpoints.close()
    target = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in want.items()}
    restored, host, _ = ckpt.restore_checkpoint(path, target)
    assert {k: bits(v) for k, v in restored.items()} == {k: bits(v) for k, v in want.items()}
    assert host == {"update": 1}


def test_asynchronous_saves_keep_save_total_limit(tmp_path, monkeypatch):
    """Saves in a row, none waited for by the caller: each waits for the one before; once they are done exactly
    the newest save_total_limit checkpoints are left (intact), each reported on disk once, in order, all
    written by one orbax CheckpointManager, closed with the run's checkpoints."""
    import orbax.checkpoint as ocp

    managers, closed = [], []
    real_init, real_close = ocp.CheckpointManager.__init__, ocp.CheckpointManager.close
    monkeypatch.setattr(ocp.CheckpointManager, "__init__",
                        lambda self, *a, **k: (managers.append(self), real_init(self, *a, **k))[1])
    monkeypatch.setattr(ocp.CheckpointManager, "close", lambda self: (closed.append(self), real_close(self))[1])
    saved: list[int] = []
    checkpoints = ckpt.RunCheckpoints(tmp_path, save_total_limit=2, on_saved=saved.append)
    for step in range(1, 6):
        checkpoints.save(step, small_tree(step), {"update": step}, config_dict(), wait=False)
        assert saved == list(range(1, step))  # the previous save is finished when the next one starts
    checkpoints.wait()
    assert saved == [1, 2, 3, 4, 5]
    assert len(managers) == 1 and closed == []
    checkpoints.close()
    assert closed == managers
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_4", "step_5"]
    assert all(ckpt.verify_checkpoint(tmp_path / f"step_{s}")[0] for s in (4, 5))
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), small_tree(0))
    restored, host, _ = ckpt.restore_checkpoint(tmp_path, target)
    assert_bit_equal(restored, small_tree(5))
    assert host == {"update": 5}
