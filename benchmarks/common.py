"""What both sides of the benchmark share: the work (model shapes, prompts, PPO settings) and how timings
become figures. Standard library only: it is imported by the TRL side (``.venv-bench``, torch, no jax) and by
the ppojax side (project venv, jax).

The contract for the ppojax side (``benchmarks/ppojax_ppo.py``, written by the ppojax engineers)::

    def run(config: dict) -> dict

``config`` is ``make_config(size, ...)``: ``model`` (HF ``LlamaConfig`` keyword arguments; the same shape
for policy, reference, reward and value models; reward/value = that backbone + a random Linear(hidden, 1)
score head), ``model_dir`` (None, or a converted HF checkpoint directory to load instead of random init),
``prompts`` (``batch_size * num_updates`` lists of exactly ``prompt_length`` token ids, LEFT padded with
``pad_token_id``; use them in order, ``batch_size`` per update), ``batch_size``, ``prompt_length``,
``response_length`` (fixed: no stop token, never stop early), ``num_ppo_epochs``, ``num_mini_batches``,
``num_updates`` (the first one is the warm-up/compile update), ``temperature``, ``learning_rate``, ``seed``,
``pad_token_id``, ``eos_token_id``, ``bos_token_id``.

It returns ``summarize(...)`` of its timings (see that function): one record per update with the
wall times of generation, of the whole rollout (generation + reference/value/reward forwards + scoring) and
of the update (rewards/GAE + epochs of optimizer steps), all measured after blocking on the results
(``jax.block_until_ready``), plus the time spent building/loading models before the first update;
optionally ``cpu_s`` per update (``time.process_time()`` deltas), a figure that shared-machine load
disturbs much less than wall time.
``run.py`` adds the peak RSS of the worker process; the side may add any extra keys.

Interleaved runs (``run.py --interleave``): ``config["turn_dir"]`` names a directory through which the
orchestrator hands out turns, so that the two sides' updates alternate on the same machine minutes and share
its slow and fast spells. A side calls ``Turns(config, side).wait(u)`` before update ``u`` (and starts its
clock after it returns) and ``.done(u)`` after it; without ``turn_dir`` both do nothing.
"""

from __future__ import annotations

import os
import platform
import random
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

# ---------------------------------------------------------------------------------------------------------
# The work

PAD_TOKEN_ID = 0  # SmolLM2: <|endoftext|>
BOS_TOKEN_ID = 1  # SmolLM2: <|im_start|>
EOS_TOKEN_ID = 2  # SmolLM2: <|im_end|>; differs from pad (docs/algorithm.md). Never used to stop: lengths are fixed.

SIZES: dict[str, dict] = {
    "tiny": {
        "model": dict(
            vocab_size=512,
            hidden_size=64,
            intermediate_size=256,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            max_position_embeddings=256,
            rms_norm_eps=1e-6,
            rope_theta=10000.0,
            tie_word_embeddings=False,
            hidden_act="silu",
        ),
        "batch_size": 16,
        "num_updates": 12,
        "quick_num_updates": 4,
    },
    # SmolLM2-135M(-Instruct)'s exact config (ppojax/assets); random init unless a converted checkpoint is given.
    "smollm2": {
        "model": dict(
            vocab_size=49152,
            hidden_size=576,
            intermediate_size=1536,
            num_hidden_layers=30,
            num_attention_heads=9,
            num_key_value_heads=3,
            head_dim=64,
            max_position_embeddings=8192,
            rms_norm_eps=1e-5,
            rope_theta=100000.0,
            tie_word_embeddings=True,
            hidden_act="silu",
        ),
        "batch_size": 8,
        "num_updates": 4,
        "quick_num_updates": 2,
    },
}

PPO_SETTINGS = dict(
    prompt_length=16,
    response_length=32,
    num_ppo_epochs=4,
    num_mini_batches=1,
    temperature=0.7,
    learning_rate=3e-6,
    seed=0,
)


def make_prompts(n: int, prompt_length: int, vocab_size: int, seed: int = 0) -> list[list[int]]:
    """``n`` prompts of exactly ``prompt_length`` ids: a real part of ``prompt_length//2 … prompt_length``
    random ordinary tokens (ids >= 3: no pad/bos/eos inside), starting with BOS, LEFT padded with PAD."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(n):
        real = rng.randint(max(2, prompt_length // 2), prompt_length)
        ids = [BOS_TOKEN_ID] + [rng.randrange(3, vocab_size) for _ in range(real - 1)]
        prompts.append([PAD_TOKEN_ID] * (prompt_length - real) + ids)
    return prompts


def make_config(size: str, *, quick: bool = False, num_updates: int | None = None,
                model_dir: str | None = None) -> dict:
    """The full description of one benchmark run (JSON-serialisable); both sides receive the same one."""
    if size not in SIZES:
        raise ValueError(f"unknown benchmark size {size!r}; expected one of {sorted(SIZES)}")
    spec = SIZES[size]
    n = num_updates or (spec["quick_num_updates"] if quick else spec["num_updates"])
    if n < 2:
        raise ValueError(f"num_updates={n}: need at least 2 (the first update is excluded from steady state)")
    cfg = dict(PPO_SETTINGS)
    cfg.update(
        size=size,
        model=dict(spec["model"], pad_token_id=PAD_TOKEN_ID, bos_token_id=BOS_TOKEN_ID,
                   eos_token_id=EOS_TOKEN_ID),
        model_dir=model_dir,
        batch_size=spec["batch_size"],
        num_updates=n,
        pad_token_id=PAD_TOKEN_ID,
        bos_token_id=BOS_TOKEN_ID,
        eos_token_id=EOS_TOKEN_ID,
    )
    cfg["prompts"] = make_prompts(cfg["batch_size"] * n, cfg["prompt_length"], spec["model"]["vocab_size"],
                                  seed=cfg["seed"])
    return cfg


# ---------------------------------------------------------------------------------------------------------
# Timings → figures

METRIC_KEYS = (
    "episodes_per_s",
    "time_to_first_update_s",
    "setup_and_first_update_s",
    "generation_tokens_per_s",
    "update_tokens_per_s",
    "rollout_s",
    "update_s",
    "step_s",
    "setup_s",
)


def summarize(config: dict, updates: list[dict], setup_s: float) -> dict:
    """Figures from per-update wall times.

    ``updates[i]`` has ``total_s`` (end of update i-1, or the start of training for i = 0, to the end of
    update i: back to back, so their sum is the training wall time), ``generation_s``, ``rollout_s``
    (generation included) and ``update_s``. Update 0 (compilation / warm-up) is excluded from every steady
    figure and reported as ``time_to_first_update_s``; ``setup_and_first_update_s`` adds the model building
    before it (``setup_s``), the launch-to-first-update time where a side compiles while its models load.

    - ``episodes_per_s``: ``batch_size * (n-1) / sum(total_s[1:])``.
    - ``generation_tokens_per_s``: generated tokens (``batch_size * response_length``) / generation time.
    - ``update_tokens_per_s``: tokens pushed through forward+backward in the update
      (``num_ppo_epochs * batch_size * (prompt_length + response_length)``) / update time.
    - ``rollout_s``, ``update_s``, ``step_s``: mean steady seconds per update of each phase.
    - when the records also have ``cpu_s`` (``time.process_time()`` of the process, all its threads, over
      the update): ``cpu_s_per_update`` and ``episodes_per_cpu_s``. On a machine shared with other work,
      wall-clock figures drop with the load while CPU seconds mostly do not: on an idle machine with C cores
      ``episodes_per_s`` is at most ``C * episodes_per_cpu_s`` (equal when every core is busy with it).
    """
    if len(updates) < 2:
        raise ValueError(f"need timings of at least 2 updates, got {len(updates)}")
    B, P, R, E = (config["batch_size"], config["prompt_length"], config["response_length"],
                  config["num_ppo_epochs"])
    steady = updates[1:]
    total = sum(u["total_s"] for u in steady)
    gen = statistics.mean(u["generation_s"] for u in steady)
    upd = statistics.mean(u["update_s"] for u in steady)
    extra = {}
    if all("cpu_s" in u for u in steady):
        cpu = sum(u["cpu_s"] for u in steady)
        extra = {"cpu_s_per_update": cpu / len(steady), "episodes_per_cpu_s": B * len(steady) / cpu}
    return {
        **extra,
        "episodes_per_s": B * len(steady) / total,
        "time_to_first_update_s": updates[0]["total_s"],
        "setup_and_first_update_s": setup_s + updates[0]["total_s"],
        "generation_tokens_per_s": B * R / gen,
        "update_tokens_per_s": E * B * (P + R) / upd,
        "rollout_s": statistics.mean(u["rollout_s"] for u in steady),
        "update_s": upd,
        "step_s": total / len(steady),
        "setup_s": setup_s,
        "num_updates": len(updates),
        "updates": updates,
    }


def status_mb(field: str) -> float:
    """A ``/proc/self/status`` memory field of this process in MiB (Linux): VmRSS (resident now), VmHWM (the peak
    since the last ``clear_refs``), RssAnon (anonymous memory: the arrays, without mapped file pages)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise KeyError(field)


def peak_rss_mb() -> float:
    """Peak resident set size of this process (Linux ru_maxrss is in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


# ---------------------------------------------------------------------------------------------------------
# The machine and the code


def median_seconds(call, repeats: int) -> float:
    """Median wall seconds of ``call(i)`` for i = 1 .. repeats, after one ``call(0)`` left out (the compile).
    ``call`` returns once its work is done (a JAX caller blocks on its result); ``i`` may vary its input."""
    call(0)
    times = []
    for i in range(1, repeats + 1):
        start = time.perf_counter()
        call(i)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def source_commit() -> str | None:
    """The repository's commit (abbreviated, "+changes" where the work tree differs from it), or None outside a git
    checkout: what a report's figures were measured at."""
    repo = Path(__file__).resolve().parent.parent
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=repo, capture_output=True, text=True,
                                timeout=10)
        changed = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=repo,
                                 capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    if commit.returncode != 0:
        return None
    return commit.stdout.strip() + ("+changes" if changed.stdout.strip() else "")


def machine_info() -> dict:
    model = platform.processor() or ""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                model = line.split(":", 1)[1].strip()
    except (OSError, subprocess.SubprocessError):
        pass
    mem_gb = None
    try:
        with open("/proc/meminfo") as f:
            mem_gb = round(int(f.readline().split()[1]) / 2**20, 1)
    except (OSError, ValueError, IndexError):
        pass
    simd = _simd()
    return {
        "cpu_model": model,
        "cores": os.cpu_count(),
        "simd": simd,
        "mem_gb": mem_gb,
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "loadavg_1m": os.getloadavg()[0],
        "xla_flags": os.environ.get("XLA_FLAGS", ""),  # incl. options recorded for this CPU (xla_cpu_options)
        "cpu_signature": _cpu_signature(),
    }


def _simd() -> list:
    """The instruction sets that matter here, as ppojax's probe reports them (a PPOJAX_CPU_ISA cap included); the
    TRL side's interpreter may have no ppojax: /proc/cpuinfo read directly there."""
    wanted = ("avx2", "fma", "avx512f", "avx512_bf16", "amx_tile")
    try:
        from ppojax.backends.cpu.capabilities import probe
    except ImportError:
        try:
            with open("/proc/cpuinfo") as f:
                flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
        except OSError:
            flags = []
        return [f for f in wanted if f in flags]
    return [f for f in wanted if f in probe().flags]


def _cpu_signature() -> str:
    """The key of this CPU's recorded XLA:CPU options (ppojax.backends.cpu.xla_options); the TRL side (its own
    interpreter, no ppojax) reads this module too."""
    try:
        from ppojax.backends.cpu.xla_options import this_cpu
    except ImportError:
        return ""
    return this_cpu().signature


class Turns:
    """A side's half of the turn-taking of ``run.py --interleave`` (files in ``config["turn_dir"]``): a side
    creates ``{side}.ready`` when it is set up and waits for its first turn; the orchestrator creates
    ``{side}.go.{u}`` when update ``u`` of ``side`` may start; the side creates ``{side}.done.{u}`` when it has
    finished. No-ops when the config has no ``turn_dir``."""

    POLL_S = 0.005  # a sleeping poll: no measurable CPU while the other side runs

    def __init__(self, config: dict, side: str):
        self.dir = Path(config["turn_dir"]) if config.get("turn_dir") else None
        self.side = side

    @property
    def active(self) -> bool:
        return self.dir is not None

    def wait(self, update: int) -> None:
        if self.dir is None:
            return
        if update == 0:  # set up (models built): the turns start once every side is
            (self.dir / f"{self.side}.ready").touch()
        go = self.dir / f"{self.side}.go.{update}"
        while not go.exists():
            time.sleep(self.POLL_S)

    def done(self, update: int) -> None:
        if self.dir is not None:
            (self.dir / f"{self.side}.done.{update}").touch()
