"""Two XLA forms of grouped-query attention, timed inside a SmolLM2-135M backbone's forward + backward.

    python -m benchmarks.attention_forms [--reps 24] [--rows 8] [--length 48] [--json F]

- ``jax_nn``: ``jax.nn.dot_product_attention(implementation="xla")``, which vmaps its core over a key head's
  G = H/K query heads (G products of ``[S, hd] x [hd, T]`` per row and key head);
- ``grouped_rows``: ``ppojax.models.attention`` today: the G query heads are extra query rows, one product of
  ``[G*S, hd] x [hd, T]`` per row and key head.

Both run in the same process on the same randomly initialised SmolLM2 backbone (``remat: dots``, left-padded
rows as the PPO benchmark's), alternating call by call so that both meet the same minutes of the host. Both
give the same gradient (``tests/test_benchmarks.py`` checks it on a tiny model). The figures per host are in
``benchmarks/README.md``.
"""

from __future__ import annotations

import argparse
import json
import time

VARIANTS = ("jax_nn", "grouped_rows")


def jax_nn_attention(q, k, v, mask, *, scale, implementation="auto", is_causal=False, window=None):
    """``ppojax.models.attention.attention``'s signature over jax.nn's XLA path (the form ppojax used before)."""
    import jax

    return jax.nn.dot_product_attention(q, k, v, mask=mask[:, None], scale=float(scale), is_causal=is_causal,
                                        local_window_size=None if window is None else (window - 1, 0),
                                        implementation="xla")


def backbone_gradients(cfg, rows: int, length: int, seed: int = 0) -> dict:
    """{variant: jitted () -> (loss, gradient of the backbone's parameters)} for a random ``CausalLM(cfg)``.

    The loss is the sum of squares of the real tokens' last hidden states over ``rows`` left-padded rows of
    ``length`` tokens. The attention function is chosen when each variant is traced."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    import ppojax.models.transformer as transformer
    from ppojax.models import CausalLM
    from ppojax.models.attention import attention

    graphdef = nnx.graphdef(nnx.eval_shape(lambda: CausalLM(cfg, rngs=nnx.Rngs(seed), remat="dots")))
    params = jax.jit(lambda: nnx.state(CausalLM(cfg, rngs=nnx.Rngs(seed), remat="dots")))()
    rng = np.random.default_rng(seed)
    ids = jnp.asarray(rng.integers(3, cfg.vocab_size, (rows, length)), jnp.int32)
    real = jnp.asarray(np.arange(length)[None] >= rng.integers(0, length // 6 + 1, rows)[:, None])

    def loss(p):
        hidden, _ = nnx.merge(graphdef, p)(ids, real)  # (hidden [B, S, D], cache)
        return jnp.sum(jnp.where(real[..., None], hidden, 0.0) ** 2)

    fns = {}
    for name, fn in (("jax_nn", jax_nn_attention), ("grouped_rows", attention)):
        transformer.attention = fn
        try:
            compiled = jax.jit(jax.value_and_grad(loss)).lower(params).compile()
        finally:
            transformer.attention = attention
        fns[name] = lambda compiled=compiled: compiled(params)
    return fns


def measure(reps: int, rows: int, length: int) -> dict:
    import jax

    from benchmarks.common import SIZES
    from ppojax.models import ModelConfig

    cfg = ModelConfig.from_hf(dict(SIZES["smollm2"]["model"], model_type="llama"))
    fns = backbone_gradients(cfg, rows, length)
    for fn in fns.values():
        jax.block_until_ready(fn())
    times = {name: [] for name in fns}
    for r in range(reps):
        for name in (VARIANTS if r % 2 == 0 else VARIANTS[::-1]):
            start = time.perf_counter()
            jax.block_until_ready(fns[name]())
            times[name].append(time.perf_counter() - start)
    out = {"rows": rows, "length": length, "reps": reps, "jax": jax.__version__, "by_variant": {}}
    for name, seconds in times.items():
        seconds = sorted(seconds)
        out["by_variant"][name] = {"best_ms": 1e3 * seconds[0], "median_ms": 1e3 * seconds[len(seconds) // 2]}
    return out


def main(argv=None) -> int:
    from benchmarks.common import positive_int

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=positive_int, default=24)
    parser.add_argument("--rows", type=positive_int, default=8, help="rows per call (the PPO benchmark's batch)")
    parser.add_argument("--length", type=positive_int, default=48, help="tokens per row (prompt 16 + response 32)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    from ppojax.backends.cpu.program_start import start_program

    start_program()
    from benchmarks.common import machine_info

    result = dict(measure(args.reps, args.rows, args.length), machine=machine_info())
    for name, figures in result["by_variant"].items():
        print(f"{name:14s} best {figures['best_ms']:8.1f} ms  median {figures['median_ms']:8.1f} ms  "
              f"(backbone forward + backward, {args.rows} x {args.length} tokens)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
