"""The persistent compilation cache: where it goes, and that a second process loads instead of compiling."""
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from ppojax.trainer.compile_cache import enable_compilation_cache, resolve_cache_dir
from ppojax.trainer.stored_callbacks import KEY_SUFFIX

REPO = Path(__file__).resolve().parents[1]
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"  # the first bytes of a zstd frame


def test_resolve_cache_dir(monkeypatch, tmp_path):
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert resolve_cache_dir("auto") == tmp_path / "xdg" / "ppojax" / "xla"
    assert resolve_cache_dir(None) == tmp_path / "xdg" / "ppojax" / "xla"
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path / "env"))
    assert resolve_cache_dir("auto") == tmp_path / "env"
    assert resolve_cache_dir("none") is None
    assert resolve_cache_dir("") is None
    assert resolve_cache_dir(str(tmp_path / "mine")) == tmp_path / "mine"


def test_unwritable_cache_dir_turns_the_cache_off(tmp_path, capsys):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    before = jax.config.jax_compilation_cache_dir
    assert enable_compilation_cache(str(blocker / "xla")) is None
    assert "compilation cache off" in capsys.readouterr().out
    assert jax.config.jax_compilation_cache_dir == before


_CHILD = r"""
import json, sys
import jax, jax.numpy as jnp
from ppojax.trainer.compile_cache import enable_compilation_cache
hits = []
jax.monitoring.register_event_listener(lambda name, **kw: hits.append(name))
jax.jit(lambda x: x + 1).lower(1.0).compile()  # a compile BEFORE the cache is switched on: it must still work
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
enable_compilation_cache(sys.argv[1])
out = jax.jit(lambda x: jnp.tanh(x) * 3.0 - x ** 2)(jnp.arange(5.0))
enable_compilation_cache(sys.argv[2])  # moving the cache elsewhere mid-process takes effect too
jax.jit(lambda x: jnp.sin(x) * 2.0)(jnp.arange(3.0))
print(json.dumps({"hits": sum(h.endswith("cache_hits") for h in hits), "out": out.tolist()}))
"""


def _child(cache_dir, second_dir):
    proc = subprocess.run([sys.executable, "-c", _CHILD, str(cache_dir), str(second_dir)], capture_output=True,
                          text=True, cwd=REPO, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_second_process_loads_the_compiled_program(tmp_path):
    cache = tmp_path / "xla"
    first = _child(cache, tmp_path / "moved")
    assert first["hits"] == 0
    assert any(cache.iterdir()), "the first process wrote no cache entry"
    entries = [p for p in cache.rglob("*") if p.is_file() and not p.name.endswith("atime")]
    # zstd-compressed (the zstandard dependency), not zlib's slower stream
    assert entries and all(p.read_bytes()[:4] == ZSTD_MAGIC for p in entries), [p.read_bytes()[:4] for p in entries]
    assert any((tmp_path / "moved").iterdir()), "a cache moved mid-process received no entry"
    second = _child(cache, tmp_path / "moved")
    assert second["hits"] >= 1, "the second process compiled again instead of loading from the cache"
    assert second["out"] == pytest.approx(first["out"])


def test_a_truncated_cache_entry_is_recompiled_not_fatal(tmp_path):
    """A run killed while JAX wrote an entry leaves it half-written: the next run must still work."""
    cache = tmp_path / "xla"
    first = _child(cache, tmp_path / "moved")
    entries = [p for p in cache.rglob("*") if p.is_file() and not p.name.endswith("atime")]
    assert entries
    for entry in entries:
        entry.write_bytes(entry.read_bytes()[:100])
    again = _child(cache, tmp_path / "moved")
    assert again["out"] == pytest.approx(first["out"])


_CALLBACK_CHILD = r"""
import json, logging, sys
import numpy as np
import jax, jax.numpy as jnp
from jax.experimental import io_callback
from ppojax.trainer.compile_cache import enable_compilation_cache
loaded, called = [], []

class Loaded(logging.Handler):  # the programs JAX's compiler reports as loaded from the persistent cache
    def emit(self, record):
        if record.getMessage().startswith("Persistent compilation cache hit"):
            loaded.append(record.args[0])

logging.getLogger("jax._src.compiler").addHandler(Loaded())
logging.getLogger("jax._src.compiler").setLevel(logging.DEBUG)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
if sys.argv[3] == "ppojax":
    enable_compilation_cache(sys.argv[1])
else:  # JAX's cache alone, as a process that never turned it on through ppojax
    jax.config.update("jax_compilation_cache_dir", sys.argv[1])
factor = float(sys.argv[2])
if sys.argv[4] == "gpu":  # a platform not yet enabled: what enabling it would do (see the test's docstring)
    from ppojax.trainer import stored_callbacks
    stored_callbacks._STORED_ON = (jax.devices()[0].client.platform,)

def host(x):  # this process's own Python function: a loaded program must call it, not the writer's
    called.append(float(np.sum(x)))
    return np.asarray(x) * factor

@jax.jit
def program(x):
    return io_callback(host, jax.ShapeDtypeStruct(x.shape, x.dtype), jnp.tanh(x), ordered=True) + 1.0

out = program(jnp.arange(4.0))
print(json.dumps({"loaded": "jit_program" in loaded, "out": out.tolist(), "called": len(called)}))
"""


def _callback_child(cache_dir, factor, platform, opened_by="ppojax"):
    proc = subprocess.run([sys.executable, "-c", _CALLBACK_CHILD, str(cache_dir), str(factor), opened_by, platform],
                          capture_output=True, text=True, cwd=REPO, timeout=300,
                          env={**os.environ, "JAX_PLATFORMS": {"cpu": "cpu", "gpu": "cuda"}[platform]})
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _gpu_present() -> bool:
    try:
        return bool(jax.devices("gpu"))
    except RuntimeError:
        return False


@pytest.mark.parametrize("platform", ["cpu", "gpu"])
def test_a_program_with_host_callbacks_is_loaded_with_the_loading_process_callbacks(tmp_path, platform):
    """JAX stores no program with host callbacks; ppojax stores them on CPU under a key of their own, and a
    process that loads one hands it ITS Python functions: the second process below loads the first one's program
    and its output is made by its own callback (factor 10, not 2). On a GPU (benchmarks/device_check.sh's GPU tests)
    the same with the GPU let in: where it passes, the GPU's platform can join stored_callbacks._STORED_ON."""
    if platform == "gpu" and not _gpu_present():
        pytest.skip("no GPU here: benchmarks/device_check.sh runs this on one")
    cache = tmp_path / "xla"
    expected = lambda factor: [float(np.tanh(x)) * factor + 1.0 for x in range(4)]  # noqa: E731
    first = _callback_child(cache, 2.0, platform)
    assert not first["loaded"] and first["out"] == pytest.approx(expected(2.0)) and first["called"] == 1
    stored = [p.name for p in cache.rglob("*") if p.is_file() and not p.name.endswith("atime")]
    assert any(name.startswith("jit_program-") and KEY_SUFFIX in name for name in stored), stored
    second = _callback_child(cache, 10.0, platform)
    assert second["loaded"], "the second process compiled the program with a callback again"
    assert second["out"] == pytest.approx(expected(10.0)) and second["called"] == 1
    # a process with JAX's cache alone never loads that entry (it would have no callbacks): it compiles its own
    plain = _callback_child(cache, 3.0, platform, opened_by="jax")
    assert not plain["loaded"] and plain["out"] == pytest.approx(expected(3.0))
