"""Loading a checkpoint onto a mesh, two ways, each in a fresh process on N virtual CPU devices (a measurement:
run it by hand, not in the tests):

- ``whole``: ``load_pretrained`` onto the default device, then ``sharding.shard_params`` (what ``build_run`` did
  before the fourteenth session: the whole model on one device, then its shards beside it);
- ``sharded``: ``load_pretrained(mesh=)``, every weight read shard by shard straight into its sharding.

    python -m benchmarks.sharded_load --make-checkpoint DIR [--preset llama-3.2-1b]   # once: random bf16 weights
    python -m benchmarks.sharded_load --dir DIR [--devices 8] [--mesh 1,8,1] [--param-dtype float32]

Reported per way: load time, the process's peak RSS (VmHWM) and its RSS before loading (imports, runtime), the
largest number of bytes any one device holds at the end, and the page cache is dropped before each way when
this process may (root). On the CPU the devices' buffers are the process's memory, so the peak RSS shows what
one accelerator would have to hold on the way: the whole model (``whole``) or its shard (``sharded``).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.common import status_mb

REPO = Path(__file__).resolve().parents[1]


def make_checkpoint(directory: str, preset: str) -> None:
    """A random bfloat16 checkpoint of a preset's shape (normal(0, 0.02) weights, norms 1), written tensor by
    tensor through ``save_pretrained``."""
    import ml_dtypes
    import numpy as np
    from flax import nnx

    from ppojax.models import CausalLM, ModelConfig, save_pretrained
    from ppojax.trainer.plan import PRESETS

    cfg = ModelConfig.from_hf(PRESETS[preset])
    abstract = nnx.eval_shape(lambda: CausalLM(cfg, rngs=nnx.Rngs(0)))
    rng = np.random.default_rng(0)

    def draw(path, shape):
        if "norm" in path:
            return np.ones(shape.shape, ml_dtypes.bfloat16)
        return (0.02 * rng.standard_normal(shape.shape, np.float32)).astype(ml_dtypes.bfloat16)

    params = nnx.to_pure_dict(nnx.state(abstract))
    import jax
    params = jax.tree_util.tree_map_with_path(lambda p, s: draw(jax.tree_util.keystr(p), s), params)
    save_pretrained(abstract, cfg, directory, params=params)


def measure(way: str, directory: str, mesh_shape: tuple, param_dtype: str) -> dict:
    """In this (fresh) process: load ``directory`` onto the mesh the ``way`` says -> figures."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from ppojax.parallel import sharding
    from ppojax.models import load_pretrained

    mesh = sharding.make_mesh(*mesh_shape)
    dtype = jnp.dtype(param_dtype)
    before = status_mb("VmRSS")
    anonymous = _PeakSampler("RssAnon")  # the arrays' memory, without the checkpoint's mapped file pages
    start = time.perf_counter()
    if way == "whole":
        model, _ = load_pretrained(directory, dtype=dtype, param_dtype=dtype)
    else:
        model, _ = load_pretrained(directory, dtype=dtype, param_dtype=dtype, mesh=mesh)
    loaded = nnx.state(model)
    largest = lambda tree: max(sharding.addressable_bytes(tree, d) for d in jax.devices()) / 2**20  # noqa: E731
    after_load = largest(loaded)
    state = sharding.shard_params(loaded, mesh)  # a no-op for the sharded way (already placed so)
    jax.block_until_ready(state)
    seconds = time.perf_counter() - start
    return dict(way=way, seconds=round(seconds, 2), rss_before_mb=round(before),
                peak_rss_mb=round(status_mb("VmHWM")), peak_anonymous_rss_mb=round(anonymous.stop()),
                largest_device_after_load_mb=round(after_load), largest_device_at_end_mb=round(largest(state)),
                model_mb=round(sum(x.nbytes for x in jax.tree.leaves(state)) / 2**20))


class _PeakSampler:
    """The peak of a /proc/self/status field, sampled every 10 ms on a thread until ``stop()``."""

    def __init__(self, field: str):
        import threading
        self.field, self.peak, self._done = field, status_mb(field), threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        while not self._done.wait(0.01):
            self.peak = max(self.peak, status_mb(self.field))

    def stop(self) -> float:
        self._done.set()
        self._thread.join()
        return max(self.peak, status_mb(self.field))


def _drop_page_cache() -> bool:
    try:
        subprocess.run(["sync"], check=True)
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--make-checkpoint", metavar="DIR")
    parser.add_argument("--preset", default="llama-3.2-1b")
    parser.add_argument("--dir")
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--mesh", default="1,8,1", help="data,fsdp,tensor")
    parser.add_argument("--param-dtype", default="float32")
    parser.add_argument("--ways", default="whole,sharded")
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--out")
    parser.add_argument("--way", help=argparse.SUPPRESS)
    args = parser.parse_args()
    mesh_shape = tuple(int(n) for n in args.mesh.split(","))
    if args.make_checkpoint:
        make_checkpoint(args.make_checkpoint, args.preset)
        return
    if args.way:  # the child process
        print(json.dumps(measure(args.way, args.dir, mesh_shape, args.param_dtype)))
        return
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={args.devices}")
    results = []
    for _ in range(args.repeat):
        for way in args.ways.split(","):
            dropped = _drop_page_cache()
            out = subprocess.run([sys.executable, "-m", "benchmarks.sharded_load", "--way", way, "--dir", args.dir,
                                  "--mesh", args.mesh, "--param-dtype", args.param_dtype],
                                 cwd=REPO, env=env, capture_output=True, text=True, check=True)
            row = dict(json.loads(out.stdout.strip().splitlines()[-1]), page_cache_dropped=dropped)
            print(row, flush=True)
            results.append(row)
    if args.out:
        from benchmarks.common import machine_info
        Path(args.out).write_text(json.dumps(dict(machine=machine_info(), devices=args.devices, mesh=args.mesh,
                                                  param_dtype=args.param_dtype, checkpoint=args.dir,
                                                  results=results), indent=2) + "\n")


if __name__ == "__main__":
    main()
