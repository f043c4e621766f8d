"""Ahead-of-time memory / FLOP plan of the compiled PPO programs for a model on a mesh (no weights allocated).

    model config (config.json or a preset) -> abstract models (``nnx.eval_shape``) -> abstract TrainState with
    the TRAIN_RULES shardings -> ``jax.jit(...).lower(abstract args).compile()`` per program
    -> XLA's memory analysis (per device: arguments, outputs, aliased, temporaries) and cost analysis (FLOPs)

The programs are the ones a run executes (``ppojax.rl.program``): ``train_step`` (rollout + update as ONE
program), and its two halves ``rollout`` (sample + forwards + reward) and ``update`` (``learn``) for the
breakdown. The reward source is a reward MODEL (a ``ScoreModel`` of the policy's shape) so the whole program
is in the graph; a Python reward function would be a host callback whose memory XLA cannot see.

Where the devices come from is the target (``plan_targets``): by default the CPU backend (``N`` virtual CPU
devices stand in for the accelerators), whose numbers are XLA:CPU's buffer assignment of the same sharded
program: fusion and the attention kernel differ on GPU/TPU (cuDNN's fused attention needs less scratch), so read
them as an estimate with those caveats. A TPU target (``--target tpu:v5e:4x4``) compiles the same program with the
TPU compiler (libtpu) for the slice's chips, without the chips: its memory analysis is what a run on that slice
holds, and a program that does not fit is refused by the compiler itself (reported with the bytes it needed).

LoRA (``lora_r`` > 0, or ``--lora-rank``): compiled as a run builds it (``train.build``): the policy's base
weights frozen and shared with the reference (adapters off), rank-r adapters (and a legacy value head) the only
trainable policy weights, the sampler reading the merged weights. A separate value model trains whole, as in a
run; ``value_head: policy`` puts the value head on the adapted policy instead.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import time
from pathlib import Path
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ppojax import backends, parallel
from ppojax.core.advantages import advantage_estimator
from ppojax.models import CausalLM, CausalLMWithValueHead, ModelConfig, ScoreModel, count_params, init_cache
from ppojax.models.errors import ModelLoadError, UnsupportedModelError
from ppojax.models.flops import Dims, ppo_update_flops
from ppojax.rl import in_flight_updates
from ppojax.rl.program import collect_experience, make_rollout, make_train_step, make_update
from ppojax.rl.rewards import ModelScores
from ppojax.rl.sampler import prefill_slots
from ppojax.rl.settings import Hyperparams
from ppojax.rl.types import init_train_state
from ppojax.trainer import plan_targets
from ppojax.trainer.build import as_config_error, make_program, model_kwargs
from ppojax.trainer.config import ConfigError, PPOConfig
from ppojax.trainer.run_models import assemble_abstractly

GB = 1e9

#: Public configs typed in from their published ``config.json`` (no download), read by the same family code
#: as a checkpoint's file.
PRESETS: dict[str, dict[str, Any]] = {
    "smollm2-135m": dict(
        model_type="llama", hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
        num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True, rope_theta=100000.0,
        max_position_embeddings=8192, rms_norm_eps=1e-5, hidden_act="silu", bos_token_id=1, eos_token_id=2),
    "llama-3.2-1b": dict(
        model_type="llama", hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, head_dim=64, vocab_size=128256, tie_word_embeddings=True, rope_theta=500000.0,
        rope_scaling=dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=8192),
        max_position_embeddings=131072, rms_norm_eps=1e-5, hidden_act="silu", bos_token_id=128000,
        eos_token_id=128001),
    "llama-3.1-8b": dict(
        model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, vocab_size=128256, tie_word_embeddings=False, rope_theta=500000.0,
        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=8192),
        max_position_embeddings=131072, rms_norm_eps=1e-5, hidden_act="silu", bos_token_id=128000,
        eos_token_id=128001),
    "qwen2.5-7b": dict(
        model_type="qwen2", hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
        num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False, rope_theta=1000000.0,
        max_position_embeddings=131072, rms_norm_eps=1e-6, hidden_act="silu", use_sliding_window=False,
        sliding_window=131072, max_window_layers=28, bos_token_id=151643, eos_token_id=151643),
    "llama-3.1-70b": dict(
        model_type="llama", hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
        num_key_value_heads=8, head_dim=128, vocab_size=128256, tie_word_embeddings=False, rope_theta=500000.0,
        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=8192),
        max_position_embeddings=131072, rms_norm_eps=1e-5, hidden_act="silu", bos_token_id=128000,
        eos_token_id=128001),
}

PROGRAMS = ("train_step", "rollout", "update")


# --------------------------------------------------------------------------------------------------
# The model's shape
# --------------------------------------------------------------------------------------------------
def _preset_key(name: str) -> str:
    return str(name).lower().rsplit("/", 1)[-1]


def hf_config_for(name_or_path: str) -> tuple[dict, str]:
    """A preset name ('Llama-3.1-8B', 'meta-llama/Llama-3.1-8B'), 'smollm2', or a checkpoint directory (its
    config.json only; no weights are read) -> (config.json dict, where it came from)."""
    key = "smollm2-135m" if name_or_path == "smollm2" else _preset_key(name_or_path)
    if key in PRESETS:
        return dict(PRESETS[key]), f"preset {key}"
    path = Path(name_or_path)
    file = path / "config.json" if path.is_dir() else path
    if file.name == "config.json" and file.is_file():
        try:
            return json.loads(file.read_text()), str(file)
        except ValueError as err:
            raise ConfigError(f"{file} is not valid JSON ({err}).") from err
    raise ConfigError(f"model {name_or_path!r} is neither a preset ({', '.join(PRESETS)}) nor a directory with a "
                      "config.json; name a preset or a Hugging Face checkpoint directory.")


def model_config_for(name_or_path: str):
    """-> (``ModelConfig``, the config.json dict, its source), read by the family code as a checkpoint is."""
    hf, source = hf_config_for(name_or_path)
    try:
        return ModelConfig.from_hf(hf, source=source), hf, source
    except (ModelLoadError, UnsupportedModelError) as err:
        raise ConfigError(str(err)) from err


# --------------------------------------------------------------------------------------------------
# The abstract program
# --------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class AbstractRun:
    """What the programs are traced from: the PPO program and abstract (shape + sharding) arguments.

    state: the TrainState as ``jax.ShapeDtypeStruct`` leaves carrying their NamedShardings; prompts:
    i32[B / num_generations, P] rows over (data, fsdp); key: a replicated PRNG key.
    """

    program: Any
    state: Any
    state_shardings: Any
    prompts: Any
    key: Any


def _with_shardings(tree, shardings):
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


def abstract_run(config: PPOConfig, model_cfg, mesh) -> AbstractRun:
    """The PPO program of ``config`` for a policy of shape ``model_cfg`` on ``mesh``, with an abstract state:
    trainable policy and value model (or a value head), frozen reference (the policy's shape) and a reward
    ScoreModel of the policy's shape; under LoRA the policy's frozen base is the reference. Nothing is
    allocated."""
    options = model_kwargs(config)
    rngs = lambda: nnx.Rngs(0)  # noqa: E731 - eval_shape: no random numbers are drawn
    uses_critic = advantage_estimator(config.advantage_estimator).uses_critic
    policy_class = CausalLMWithValueHead if config.value_head == "policy" and uses_critic else CausalLM
    policy = nnx.eval_shape(lambda: policy_class(model_cfg, rngs=rngs(), **options))
    score = nnx.eval_shape(lambda: ScoreModel(model_cfg, rngs=rngs(), **options))
    # the target's kernels, chosen for the mesh's devices (a GPU's fused attention); virtual CPU devices stand in
    # for accelerators with XLA's (a CPU backend's custom calls would hide their FLOPs from the cost analysis)
    kernels = as_config_error(backends.kernels_for, [policy, score], matmul_implementation="xla", mesh=mesh,
                              cpu_backend=False, attention_implementation=config.attention_implementation,
                              long_packed_rows=config.packed_row_length is not None)
    backends.use_kernels(kernels, policy, score)
    # the run's assembly (value model = the reward model's copy, LoRA, reference), as build_run makes it
    models = assemble_abstractly(config, dict(policy=policy, ref_model=None, reward_module=score, value_module=None),
                                 uses_critic=uses_critic)
    pad = model_cfg.pad_token_id if model_cfg.pad_token_id is not None else 0
    eos = model_cfg.eos_token_ids[0] if model_cfg.eos_token_ids else None
    stop = config.stop_token_id if config.stop_token_id is not None else (eos if config.stop_token_is_eos else None)
    # a stand-in reward model, under the name dynamic sampling's filter_groups_metric reads (when set)
    reward = ModelScores(models.reward_graphdef, pad, config.local_rollout_forward_batch_size,
                         name=config.filter_groups_metric or "reward_model")
    program = make_program(config, mesh, (models.policy_graphdef, models.value_graphdef, models.ref_graphdef),
                           reward, pad_token_id=pad, stop_token_id=stop, eos_token_id=eos, num_updates=1,
                           vocab_size=model_cfg.vocab_size, base_graphdef=models.base_graphdef,
                           lora_scale=None if models.lora_spec is None else models.lora_spec.scale,
                           kernels=kernels)
    hyperparams = Hyperparams.from_config(config)
    in_flight = in_flight_updates.in_flight_shapes(program, models.params, models.frozen, config.max_prompt_length)
    state = jax.eval_shape(lambda p, f: init_train_state(p, program.optimizer, hyperparams=hyperparams, frozen=f,
                                                         kl_coef=config.kl_coef, in_flight=in_flight),
                           models.params, models.frozen)
    state_shardings = parallel.train_state_shardings(state, mesh)
    # the prompts of one update: batch_size / num_generations rows (the program samples each num_generations times);
    # with dynamic sampling, max_num_gen_batches rounds of gen_batch_size
    prompt_rows = program.settings.batch.batch_size // program.settings.sampling.num_generations
    shape, sharding = (prompt_rows, config.max_prompt_length), parallel.batch_sharding(mesh)
    dynamic = program.settings.dynamic_sampling
    if dynamic is not None:
        shape = (dynamic.max_rounds, dynamic.prompts_per_round, config.max_prompt_length)
        sharding = jax.sharding.NamedSharding(mesh, parallel.batch_partition_spec(mesh, axis=1))
    prompts = jax.ShapeDtypeStruct(shape, jnp.int32, sharding=sharding)
    key = jax.eval_shape(lambda: jax.random.key(0))
    key = jax.ShapeDtypeStruct(key.shape, key.dtype, sharding=parallel.replicated(mesh))
    return AbstractRun(program, _with_shardings(state, state_shardings), state_shardings, prompts, key)


# --------------------------------------------------------------------------------------------------
# Compiling and reading XLA's analyses
# --------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class ProgramPlan:
    """One compiled program, per device (bytes): arguments, outputs, aliased (outputs written into donated
    arguments), temporaries; peak = arguments + outputs - aliased + temporaries. flops: XLA's cost analysis
    (per device; see ``plan``'s caveat on loops)."""

    name: str
    argument_bytes: int
    output_bytes: int
    alias_bytes: int
    temp_bytes: int
    code_bytes: int
    flops: Optional[float]
    compile_seconds: float
    bytes_accessed: Optional[float] = None  # XLA's cost analysis: bytes read and written (per device)
    #: the compiler refused the program for want of memory: (bytes it needed, bytes the device has); the
    #: buffer fields are then 0
    out_of_memory: Optional[tuple] = None
    #: the compiler's own peak of the bytes live at once (None where it gives none)
    compiler_peak_bytes: Optional[int] = None

    @property
    def peak_bytes(self) -> int:
        return self.argument_bytes + self.output_bytes - self.alias_bytes + self.temp_bytes


def _abstract_experience(run: AbstractRun):
    experience, _ = jax.eval_shape(lambda s, p, k: collect_experience(run.program, s, p, k), run.state,
                                   run.prompts, run.key)
    return _with_shardings(experience, parallel.batch_shardings(experience, run.program.mesh))


def compile_program(run: AbstractRun, name: str) -> ProgramPlan:
    """Lower and compile one program against the abstract arguments; read XLA's memory and cost analyses."""
    if name == "train_step":
        jitted, args = make_train_step(run.program, run.state_shardings).jitted, (run.state, run.prompts, run.key)
    elif name == "rollout":
        jitted, args = make_rollout(run.program).jitted, (run.state, run.prompts, run.key)
    elif name == "update":
        jitted, args = make_update(run.program, run.state_shardings), (run.state, _abstract_experience(run), run.key)
    else:
        raise ConfigError(f"program {name!r}: expected one of {', '.join(PROGRAMS)}.")
    start = time.perf_counter()
    try:
        compiled = jitted.lower(*args).compile()
    except Exception as err:  # noqa: BLE001 - the compiler's own error type; only its out-of-memory verdict is ours
        needed = out_of_memory(err)
        if needed is None:
            raise
        return ProgramPlan(name, 0, 0, 0, 0, 0, None, time.perf_counter() - start, out_of_memory=needed)
    seconds = time.perf_counter() - start
    memory = compiled.memory_analysis()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    return ProgramPlan(name, int(memory.argument_size_in_bytes), int(memory.output_size_in_bytes),
                       int(memory.alias_size_in_bytes), int(memory.temp_size_in_bytes),
                       int(memory.generated_code_size_in_bytes), (cost or {}).get("flops"), seconds,
                       bytes_accessed=(cost or {}).get("bytes accessed"),
                       compiler_peak_bytes=int(getattr(memory, "peak_memory_in_bytes", 0) or 0) or None)


#: the TPU compiler's refusal of a program that does not fit: "... required for HLO temporaries (22.00G) exceeds
#: available HBM (15.75G)" (G: GiB)
_OUT_OF_MEMORY = re.compile(r"RESOURCE_EXHAUSTED.*?\(([0-9.]+)([KMGT])\) exceeds available HBM \(([0-9.]+)([KMGT])\)",
                            re.DOTALL)


def out_of_memory(err: BaseException) -> Optional[tuple]:
    """(bytes needed, bytes available) from a compiler's out-of-memory refusal, else None."""
    found = _OUT_OF_MEMORY.search(str(err))
    if not found:
        return None
    unit = {"K": 2 ** 10, "M": 2 ** 20, "G": 2 ** 30, "T": 2 ** 40}
    return (int(float(found[1]) * unit[found[2]]), int(float(found[3]) * unit[found[4]]))


def device_bytes(tree) -> int:
    """Bytes one device holds of a tree of sharded ``jax.ShapeDtypeStruct`` (its largest shard per leaf)."""
    total = 0
    for x in jax.tree.leaves(tree):
        shape = x.sharding.shard_shape(x.shape) if x.sharding is not None else x.shape
        itemsize = 8 if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else np.dtype(x.dtype).itemsize
        total += math.prod(shape) * itemsize
    return total


def rollout_kv_cache(run: AbstractRun, model_cfg, config: PPOConfig) -> dict:
    """The rollout's KV cache as the sampler builds it: rows (the batch, or ``rollout_slots`` rows refilled),
    slots (prompt + response, or an episode's worst case), the dtype (``kv_cache_dtype``: 'int8', or the policy's
    compute dtype: bfloat16 under 'bfloat16' and 'mixed'), and its bytes in all and per device (sharded as
    ``kv_cache_shardings`` says)."""
    sampling, mesh = run.program.settings.sampling, run.program.mesh
    batch = run.program.settings.batch.batch_size
    rows = min(sampling.rollout_slots, batch) if sampling.rollout_slots else batch
    prompt = config.max_prompt_length
    slots = (sampling.episodes.cache_length(prompt) if sampling.episodes is not None
             else prompt + sampling.response_length)
    dtype = jnp.int8 if config.kv_cache_dtype == "int8" else model_kwargs(config)["dtype"]  # as the sampler's
    cache = jax.eval_shape(lambda: init_cache(model_cfg, rows, slots, dtype))
    shardings = parallel.kv_cache_shardings(cache, mesh)
    placed = jax.tree.map(lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), cache, shardings)
    total = sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(cache))
    out = {"rows": rows, "slots": slots, "dtype": jnp.dtype(dtype).name, "bytes": total,
           "bytes_per_device": device_bytes(placed)}
    if sampling.episodes is not None:  # every prompt prefilled once, its rows copied from there (ppojax.rl.episodes)
        bank_rows, bank_slots = batch // sampling.num_generations, prefill_slots(prompt, slots)
        bank = jax.eval_shape(lambda: init_cache(model_cfg, bank_rows, bank_slots, dtype))
        out["prompt_bank"] = {"rows": bank_rows, "slots": bank_slots, "bytes": sum(
            math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(bank))}
    return out


# --------------------------------------------------------------------------------------------------
# The plan
# --------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Plan:
    """A whole plan: the model, the mesh, each program's per-device memory, the FLOP counts, and the fit."""

    model: str
    source: str
    num_params: int
    mesh: dict
    devices: int
    config: PPOConfig
    state_bytes: int
    programs: list
    resident_bytes: dict      # program -> per-device bytes of ALL its inputs (the whole state stays resident)
    model_flops: dict         # the model-shape count of one update (ppojax.models.flops): rollout, update, total
    hbm_bytes: float
    trainable_bytes: int = 0  # per device: the trained weights + their optimizer moments (adapters only under LoRA)
    kv_cache: Optional[dict] = None  # the rollout's KV cache (rollout_kv_cache): rows, slots, dtype, bytes
    target: str = "cpu"       # the --target text
    target_description: str = ""
    compiler: str = "XLA:CPU"
    device_noun: str = "device"  # chip (TPU), GPU, device (the CPU estimate)

    def peak(self, program: ProgramPlan) -> int:
        """Per-device peak. Where the TPU compiler gives its own peak (the bytes live at once in its buffer
        assignment: donated inputs and temporaries share memory as their lifetimes allow), that, plus the state the
        program does not read (in memory anyway). Elsewhere every input resident (XLA leaves unused arguments out
        of its count; the TPU compiler counts the inputs it reads padded to its memory tiles: the larger of the two)
        + outputs not written into donated inputs + temporaries, a bound from above. A program the compiler
        refused for want of memory: the bytes it said it needed."""
        resident = max(self.resident_bytes[program.name], program.argument_bytes)
        if program.out_of_memory:
            return max(program.out_of_memory[0], resident)
        if program.compiler_peak_bytes and self.device_noun == "chip":
            return program.compiler_peak_bytes + max(0, self.resident_bytes[program.name] - program.argument_bytes)
        return resident + program.output_bytes - program.alias_bytes + program.temp_bytes

    @property
    def peak_bytes(self) -> int:
        return max(self.peak(p) for p in self.programs)

    @property
    def fits(self) -> bool:
        return not any(p.out_of_memory for p in self.programs) and self.peak_bytes <= self.hbm_bytes

    def to_dict(self) -> dict:
        return {"model": self.model, "source": self.source, "num_params": self.num_params, "mesh": self.mesh,
                "devices": self.devices, "target": self.target, "compiler": self.compiler,
                "device_noun": self.device_noun,
                "state_bytes": self.state_bytes, "hbm_bytes": self.hbm_bytes,
                "programs": [{**dataclasses.asdict(p), "resident_bytes": self.resident_bytes[p.name],
                              "peak_bytes": self.peak(p)} for p in self.programs],
                "model_flops": self.model_flops, "lora_r": self.config.lora_r,
                "trainable_bytes": self.trainable_bytes, "kv_cache": self.kv_cache,
                "peak_bytes": self.peak_bytes, "fits": self.fits}


def _model_flops(model_cfg, sizes, config: PPOConfig) -> dict:
    """The model-shape count of one update (``ppojax.models.flops``)."""
    f = ppo_update_flops(Dims.from_model_config(model_cfg), sizes.batch_size, config.max_prompt_length,
                         config.response_length, config.num_ppo_epochs)
    return {k: f[k] for k in ("rollout", "update", "total")}


def plan(config: PPOConfig, model: str, *, mesh_shape=None, hbm_gb: float = 80.0,
         programs=PROGRAMS, target=None) -> Plan:
    """Compile ``programs`` for ``model`` (preset name or checkpoint directory) on a mesh of the target's devices
    (``plan_targets.Target``; default: the devices JAX sees, each of ``hbm_gb`` GB) (``mesh_shape`` (data, fsdp,
    tensor), default: the config's mesh fields) and read their memory."""
    model_cfg, _, source = model_config_for(model)
    if target is None:
        target = plan_targets.load_target(plan_targets.parse_target("cpu"), hbm_gb=hbm_gb)
    devices = len(target.devices)
    data, fsdp, tensor = mesh_shape or (config.mesh_data, config.mesh_fsdp, config.mesh_tensor)
    try:
        mesh = parallel.make_mesh(data, fsdp, tensor, devices=target.devices)
    except ValueError as err:
        raise ConfigError(f"--mesh: {err}") from err
    length = config.max_prompt_length + config.response_length
    if length > model_cfg.max_position_embeddings:
        raise ConfigError(f"max_prompt_length + response_length = {length} exceeds the model's "
                          f"max_position_embeddings={model_cfg.max_position_embeddings}; shorten them.")
    sizes = config.derived(parallel.data_parallel_size(mesh))
    run = abstract_run(config, model_cfg, mesh)
    compiled, resident = [], {}
    for name in programs:
        compiled.append(compile_program(run, name))
        inputs = (run.prompts if name != "update" else _abstract_experience(run), run.key)
        resident[name] = device_bytes(run.state) + device_bytes(inputs)
    num_params = count_params(nnx.eval_shape(lambda: _causal_lm(model_cfg)))
    result = Plan(model=model, source=source, num_params=num_params, mesh=dict(mesh.shape), devices=devices,
                  config=config, state_bytes=device_bytes(run.state), programs=compiled, resident_bytes=resident,
                  model_flops=_model_flops(model_cfg, sizes, config), hbm_bytes=target.hbm_bytes,
                  trainable_bytes=device_bytes(run.state.params) + device_bytes(run.state.opt_state),
                  kv_cache=rollout_kv_cache(run, model_cfg, config),
                  target=target.spec.text, target_description=target.description, compiler=target.compiler,
                  device_noun=target.spec.device_noun)
    return result


def _causal_lm(model_cfg):
    return CausalLM(model_cfg, rngs=nnx.Rngs(0))


# --------------------------------------------------------------------------------------------------
# Printing
# --------------------------------------------------------------------------------------------------
def _gb(n) -> str:
    return f"{n / GB:.2f}"


def _critic(config: PPOConfig) -> str:
    if not advantage_estimator(config.advantage_estimator).uses_critic:
        return f"no value model ({config.advantage_estimator}: no critic)"
    return "trainable value model" if config.value_head == "separate" else "value head on it"


def format_plan(p: Plan) -> str:
    c = p.config
    sizes = c.derived(p.mesh["data"] * p.mesh["fsdp"])
    mesh = ", ".join(f"{k} {v}" for k, v in p.mesh.items())
    if c.lora_r:
        policy = (f"policy with rank-{c.lora_r} LoRA adapters on {', '.join(c.lora_target_modules)} "
                  if not isinstance(c.lora_target_modules, str) else
                  f"policy with rank-{c.lora_r} LoRA adapters ({c.lora_target_modules}) ") + "(only they train)"
        reference = "the frozen base weights as the reference (adapters off)"
    else:
        policy, reference = "trainable policy", "frozen reference (a copy of the policy)"
    lines = [
        f"ppojax plan: {p.model} ({p.source}), {p.num_params / 1e9:.2f} B parameters per model, precision "
        f"{c.precision}, remat {c.remat}",
        f"  mesh ({mesh}) on {p.target_description or f'{p.devices} device(s)'}; rollout batch {sizes.batch_size} "
        f"x (prompt {c.max_prompt_length} + response {c.response_length}), micro-batch {sizes.micro_batch_size}, "
        f"{c.num_ppo_epochs} epoch(s)",
        f"  models: {policy}, {_critic(c)}, "
        f"{reference}, and a reward ScoreModel of the policy's shape (in the program: a Python reward function "
        "would be a host callback)",
        f"  state {_gb(p.state_bytes)} GB per device, of which trained weights + optimizer moments "
        f"{_gb(p.trainable_bytes)} GB",
    ]
    if p.kv_cache is not None:
        kv = p.kv_cache
        lines.append(f"  rollout KV cache: {kv['rows']} rows x {kv['slots']} slots, {kv['dtype']}: "
                     f"{_gb(kv['bytes'])} GB in all, {_gb(kv['bytes_per_device'])} GB per device (inside the "
                     "rollout's temporaries)")
        if "prompt_bank" in kv:
            bank = kv["prompt_bank"]
            lines.append(f"  episodes' prompt bank (each prompt prefilled once): {bank['rows']} rows x {bank['slots']} "
                         f"slots, {_gb(bank['bytes'])} GB")
    lines += [
        "",
        f"  {'per device (GB)':<16}{'arguments':>11}{'resident':>10}{'outputs':>9}{'aliased':>9}{'temporaries':>13}"
        f"{'peak':>8}{'compile s':>11}",
    ]
    for prog in p.programs:
        if prog.out_of_memory:
            needed, available = prog.out_of_memory
            refused = f"refused by {p.compiler}: needs {_gb(needed)} of {_gb(available)}"
            lines.append(f"  {prog.name:<16}{refused:>60}{prog.compile_seconds:>11.1f}")
            continue
        lines.append(f"  {prog.name:<16}{_gb(prog.argument_bytes):>11}{_gb(p.resident_bytes[prog.name]):>10}"
                     f"{_gb(prog.output_bytes):>9}{_gb(prog.alias_bytes):>9}{_gb(prog.temp_bytes):>13}"
                     f"{_gb(p.peak(prog)):>8}{prog.compile_seconds:>11.1f}")
    if p.device_noun == "chip":
        lines.append("  (resident: every input incl. the whole TrainState, which stays in memory even where a program "
                     "does not read it; peak: the TPU compiler's own peak of the bytes live at once, below resident + "
                     "outputs - aliased + temporaries where donated inputs and temporaries share memory)")
    else:
        lines.append("  (resident: every input incl. the whole TrainState, which stays in memory even where a program "
                     "does not read it; peak = resident + outputs - aliased + temporaries)")
    if c.precision == "bfloat16" and p.compiler == "XLA:CPU":
        lines.append("  (bfloat16: compiled without hoisting XLA:CPU's float32 copies of the weights out of the loops, "
                     "copies an accelerator never makes; see NO_HOISTED_UPCASTS in ppojax/trainer/plan.py)")
    lines.append("")
    step = next((q for q in p.programs if q.name == "train_step"), None)
    if step is not None and step.flops is not None:
        moved = (f", {step.bytes_accessed / GB:.4g} GB read and written per device"
                 if step.bytes_accessed is not None else "")
        text = (f"  FLOPs per update: XLA's cost analysis {step.flops * p.devices / 1e12:.4g} TFLOP "
                f"(all devices{moved}; XLA counts each loop body once: layers scan, decode loop, epochs)")
        text += (f"; model-shape count (ppojax.models.flops) {p.model_flops['total'] / 1e12:.4g} TFLOP "
                 f"(rollout {p.model_flops['rollout'] / 1e12:.4g}, update {p.model_flops['update'] / 1e12:.4g})")
        lines.append(text)
    verdict = "fits" if p.fits else "does NOT fit"
    if p.compiler == "XLA:CPU":
        lines.append(f"  peak {_gb(p.peak_bytes)} GB per device: {verdict} a {p.hbm_bytes / GB:g} GB device")
    else:
        refused = [q.name for q in p.programs if q.out_of_memory]
        why = f" ({p.compiler} refused {', '.join(refused)} for want of memory)" if refused else ""
        memory = "HBM" if p.device_noun == "chip" else "memory"
        lines.append(f"  peak {_gb(p.peak_bytes)} GB ({p.peak_bytes / 2 ** 30:.2f} GiB) per {p.device_noun}: {verdict} "
                     f"its {p.hbm_bytes / 2 ** 30:.2f} GiB of {memory}{why}")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------------
# Devices
# --------------------------------------------------------------------------------------------------
#: XLA:CPU computes a bfloat16 dot in float32 and converts its operands; loop-invariant code motion then hoists
#: the converts of the weights out of the layer and decode loops, i.e. a float32 copy of every weight that an
#: accelerator (which multiplies bfloat16 directly) never makes. A bfloat16 plan turns that pass off.
NO_HOISTED_UPCASTS = "--xla_disable_hlo_passes=while-loop-invariant-code-motion"


def use_virtual_devices(n: int, precision: str = "float32") -> None:
    """Make JAX see ``n`` virtual CPU devices (the plan's stand-ins for accelerators). Must run before JAX
    starts a backend. LLVM's optimisation is turned off (it changes the machine code, not the buffers XLA
    assigns, and compiling a large program would take minutes longer); for ``precision='bfloat16'`` also the
    hoisting of XLA:CPU's float32 weight copies (``NO_HOISTED_UPCASTS``)."""
    if n < 1:
        raise ConfigError(f"--devices {n}: expected a number of devices >= 1.")
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_backend_optimization_level" not in flags:
        flags = f"{flags} --xla_backend_optimization_level=0"
    if precision == "bfloat16":  # XLA adds each --xla_disable_hlo_passes list to those before it
        flags = f"{flags} {NO_HOISTED_UPCASTS}"
    os.environ["XLA_FLAGS"] = flags.strip()
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", n)


def use_host_for_tracing() -> None:
    """A TPU target: JAX's own backend is one CPU device that traces the program (the target's compiler
    compiles it), started before JAX starts anything else."""
    jax.config.update("jax_platforms", "cpu")


def parse_mesh(text: str) -> tuple[int, int, int]:
    """'d,f,t' -> (data, fsdp, tensor), each >= 1."""
    parts = text.split(",")
    try:
        sizes = tuple(int(x) for x in parts)
    except ValueError:
        sizes = ()
    if len(sizes) != 3 or min(sizes) < 1:
        raise ConfigError(f"--mesh {text!r}: expected three sizes 'data,fsdp,tensor' >= 1, e.g. --mesh 1,8,1.")
    return sizes
