"""Generation throughput: ppojax's jitted KV-cache sampler vs transformers' torch ``generate``.

Same model (one checkpoint directory loaded by both), same left-padded prompt batch, same sampling
(temperature 0.7, no top-k / top-p), no stop token: every sequence generates exactly ``response_length``
tokens, so both sides do the same work. Generated tokens per second = batch * response_length / wall time,
steady state (median over repeats, after one warm-up call; ppojax's compile time is reported separately).

    python -m benchmarks.generation [--sizes tiny,smollm2] [--model-dir DIR] [--repeats 5]
                                    [--torch-threads 1,2] [--json out.json]

Sizes and prompts are those of the PPO benchmark (``benchmarks.common``): ``tiny`` (random Llama, batch 16)
and ``smollm2`` (SmolLM2-135M, batch 8; the converted checkpoint in ``.cache/ppojax/`` when it is there or
``--model-dir`` is given, else random init of the same config). Prompts 16 tokens, responses 32.

On a shared machine the timings are noisy: the load average before and after is recorded with the results.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import SIZES, PPO_SETTINGS, PAD_TOKEN_ID, BOS_TOKEN_ID, EOS_TOKEN_ID, machine_info, \
    make_prompts

REPO = Path(__file__).resolve().parent.parent


def _default_smollm2_dir():
    path = REPO / ".cache" / "ppojax" / "smollm2-135m-instruct"
    return path if (path / "model.safetensors").exists() else None


def _checkpoint(size, model_dir, workdir):
    """(directory, 'checkpoint' | 'random init'): a HF checkpoint directory both sides load."""
    if model_dir is not None:
        return Path(model_dir), "checkpoint"
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(**SIZES[size]["model"], pad_token_id=PAD_TOKEN_ID,
                                      bos_token_id=BOS_TOKEN_ID, eos_token_id=EOS_TOKEN_ID)
    directory = Path(workdir) / size
    transformers.LlamaForCausalLM(config).save_pretrained(directory)
    return directory, "random init"


def _time_calls(fn, repeats):
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


def bench_ppojax(directory, prompts, response_length, temperature, repeats):
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from ppojax.rl.sampler import generate_jit
    from ppojax.models import load_pretrained

    model, _ = load_pretrained(directory)
    graphdef, params = nnx.split(model)
    prompt_ids = jnp.asarray(prompts, jnp.int32)
    keys = iter(jax.random.split(jax.random.key(0), repeats + 1))

    def call():
        out = generate_jit(graphdef, params, prompt_ids, next(keys), response_length=response_length,
                           pad_token_id=PAD_TOKEN_ID, temperature=temperature)
        return jax.block_until_ready(out)

    t0 = time.perf_counter()
    first = call()  # compile + one run
    first_s = time.perf_counter() - t0
    assert first.shape == (len(prompts), response_length)
    times = _time_calls(call, repeats)
    return dict(first_call_s=first_s, times_s=times, median_s=statistics.median(times),
                tokens_per_s=len(prompts) * response_length / statistics.median(times))


def bench_transformers(directory, prompts, response_length, temperature, repeats, threads):
    import torch
    import transformers

    torch.set_num_threads(threads)
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    ids = torch.tensor(prompts, dtype=torch.long)
    mask = ids != PAD_TOKEN_ID

    def call():
        with torch.no_grad():
            out = model.generate(ids, attention_mask=mask, do_sample=True, temperature=temperature, top_k=0,
                                 top_p=1.0, max_new_tokens=response_length, min_new_tokens=response_length,
                                 pad_token_id=PAD_TOKEN_ID, eos_token_id=None)
        assert out.shape == (len(prompts), ids.shape[1] + response_length)

    t0 = time.perf_counter()
    call()  # warm-up
    first_s = time.perf_counter() - t0
    times = _time_calls(call, repeats)
    return dict(first_call_s=first_s, times_s=times, median_s=statistics.median(times),
                tokens_per_s=len(prompts) * response_length / statistics.median(times), torch_threads=threads)


def run(sizes=("tiny", "smollm2"), model_dir=None, repeats=5, torch_threads=None, batch_size=None,
        response_length=None) -> dict:
    """Benchmark each size; returns {'machine', 'load_before', 'load_after', 'sizes': {size: {...}}}."""
    if torch_threads is None:
        torch_threads = sorted({1, os.cpu_count() or 1})
    elif isinstance(torch_threads, int):
        torch_threads = [torch_threads]
    response_length = response_length or PPO_SETTINGS["response_length"]
    results = dict(machine=machine_info(), load_before=os.getloadavg(), sizes={})
    with tempfile.TemporaryDirectory() as workdir:
        for size in sizes:
            size_dir = model_dir if size == "smollm2" else None
            if size == "smollm2" and size_dir is None:
                size_dir = _default_smollm2_dir()
            directory, source = _checkpoint(size, size_dir, workdir)
            batch = batch_size or SIZES[size]["batch_size"]
            vocab = SIZES[size]["model"]["vocab_size"]
            prompts = make_prompts(batch, PPO_SETTINGS["prompt_length"], vocab, seed=0)
            temperature = PPO_SETTINGS["temperature"]
            ppojax = bench_ppojax(directory, prompts, response_length, temperature, repeats)
            runs = [bench_transformers(directory, prompts, response_length, temperature, repeats, threads)
                    for threads in torch_threads]
            torch_side = max(runs, key=lambda r: r["tokens_per_s"])  # the best thread count, as for TRL
            torch_side["tokens_per_s_by_threads"] = {r["torch_threads"]: r["tokens_per_s"] for r in runs}
            results["sizes"][size] = dict(
                weights=source, batch_size=batch, prompt_length=PPO_SETTINGS["prompt_length"],
                response_length=response_length, temperature=temperature, ppojax=ppojax,
                transformers=torch_side, speedup=ppojax["tokens_per_s"] / torch_side["tokens_per_s"])
            _print_size(size, results["sizes"][size])
    results["load_after"] = os.getloadavg()
    print(f"load average before {results['load_before'][0]:.1f}, after {results['load_after'][0]:.1f} "
          f"(on {results['machine'].get('cores')} cores; a shared machine makes these timings noisy)")
    return results


def _print_size(size, r):
    p, t = r["ppojax"], r["transformers"]
    print(f"[{size}] {r['weights']}, batch {r['batch_size']}, prompt {r['prompt_length']}, "
          f"{r['response_length']} new tokens, T={r['temperature']}")
    print(f"  ppojax       {p['tokens_per_s']:10.1f} tokens/s  (median {p['median_s']:.3f} s; first call incl. "
          f"compile {p['first_call_s']:.2f} s)")
    print(f"  transformers {t['tokens_per_s']:10.1f} tokens/s  (median {t['median_s']:.3f} s; best of torch "
          f"threads {t['tokens_per_s_by_threads']})")
    print(f"  speedup      {r['speedup']:10.2f}x")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="tiny,smollm2")
    parser.add_argument("--model-dir", default=None, help="HF checkpoint dir for the smollm2 size")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--torch-threads", default=None,
                        help="comma-separated torch thread counts to try (best reported); default 1 and all cores")
    parser.add_argument("--batch-size", type=int, default=None)
    parser.add_argument("--response-length", type=int, default=None)
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args(argv)
    threads = [int(t) for t in args.torch_threads.split(",")] if args.torch_threads else None
    results = run(tuple(s for s in args.sizes.split(",") if s), args.model_dir, args.repeats, threads,
                  args.batch_size, args.response_length)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
