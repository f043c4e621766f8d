"""Lowering bugs found before users find them: a tiny Llama's whole ``train_step`` (rollout with the KV-cache sampler,
the reward model, the update) compiled by the TPU compiler (libtpu) for a TPU v5e slice on a data x fsdp x tensor
mesh, without any TPU (``ppojax plan --target tpu:...``, ppojax/trainer/plan_targets.py).

Skipped where libtpu is not installed (pip install 'ppojax[tpu]').
"""
import dataclasses
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ppojax.trainer.plan_targets import TPU_CHIPS, tpu_compiler_installed

pytestmark = pytest.mark.skipif(not tpu_compiler_installed(),
                                reason="libtpu, the TPU compiler, is not installed: pip install 'ppojax[tpu]'")

#: GQA (8 query heads over 4 kv heads) with every split axis divisible by 2, so the mesh splits every weight
TINY = dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=8,
            num_key_value_heads=4, vocab_size=256, max_position_embeddings=64, eos_token_id=2, pad_token_id=0)
SETTINGS = dict(batch_size=16, max_prompt_length=8, response_length=4, num_ppo_epochs=1, precision="bfloat16",
                remat="full", stop_token="eos", gradient_accumulation_steps=2, logits_chunk_size=None)
MESH = (2, 2, 2)  # data, fsdp, tensor over the 8 chips of a v5e-8


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_tpu")
    (path / "config.json").write_text(json.dumps(TINY))
    return str(path)


@pytest.fixture(scope="module")
def target():
    from ppojax.trainer import plan_targets
    return plan_targets.load_target(plan_targets.parse_target("tpu:v5e:2x4"))


@pytest.fixture(scope="module")
def config():
    from ppojax.trainer.config import PPOConfig
    return PPOConfig.from_dict({**SETTINGS, "model_name_or_path": "tiny"})


@pytest.fixture(scope="module")
def compiled(tiny_model, target, config):
    from ppojax.trainer import plan
    return plan.plan(config, tiny_model, mesh_shape=MESH, target=target, programs=("train_step",))


def test_the_slice_is_what_the_target_names(target):
    assert len(target.devices) == 8 and {d.device_kind for d in target.devices} == {"TPU v5 lite"}
    assert target.hbm_bytes == TPU_CHIPS["v5e"].hbm_gib * 2 ** 30 and target.compiler.startswith("libtpu")


def test_train_step_compiles_on_a_data_fsdp_tensor_mesh(compiled):
    (step,) = compiled.programs
    assert step.name == "train_step" and step.out_of_memory is None
    assert compiled.mesh == {"data": 2, "fsdp": 2, "tensor": 2} and compiled.devices == 8
    assert step.flops > 0 and step.bytes_accessed > 0
    assert compiled.fits and compiled.peak_bytes < compiled.hbm_bytes
    # the compiler's own peak of what is live at once: the inputs at least
    assert step.compiler_peak_bytes >= step.argument_bytes
    assert compiled.peak_bytes == step.compiler_peak_bytes  # train_step reads the whole state
    # the state is donated: the new state is written over the old one
    assert step.alias_bytes > 0.9 * compiled.state_bytes


def test_memory_analysis_against_an_independent_count(compiled, tiny_model, config):
    """The compiler's per-chip argument bytes against the state counted from the model's shapes: at least the
    whole state over the 8 chips (no chip holds less than its share), at most the whole state (tensor and fsdp
    split every large weight), beyond the shards' own bytes only by the TPU's tile padding."""
    from ppojax.models import CausalLM, count_params
    from ppojax.trainer.plan import model_config_for

    model_cfg, _, _ = model_config_for(tiny_model)
    n = count_params(nnx.eval_shape(lambda: CausalLM(model_cfg, rngs=nnx.Rngs(0))))
    bf16 = 2
    # TRL's layout: policy and value model (score head: D + 1 instead of the LM head, tied here) with Adam's mu
    # and nu in the parameters' dtype, frozen reference and reward model: 8 model-sized arrays
    whole_state = 8 * n * bf16
    (step,) = compiled.programs
    assert whole_state / 8 * 0.9 <= compiled.state_bytes <= whole_state * 1.1
    assert compiled.state_bytes * 0.99 <= step.argument_bytes <= 4 * compiled.state_bytes


def test_the_chip_memory_table_is_the_compilers(target):
    """TPU_CHIPS' HBM is what the TPU compiler allows a program: its refusal of a larger one names it."""
    from ppojax.trainer.plan import out_of_memory

    mesh = Mesh(np.array(target.devices[:1]), ("x",))
    too_big = jax.ShapeDtypeStruct((20 * 2 ** 30,), jnp.float32, sharding=NamedSharding(mesh, PartitionSpec()))
    with pytest.raises(Exception) as refused:
        jax.jit(lambda x: x * 2).lower(too_big).compile()
    needed, available = out_of_memory(refused.value)
    assert needed >= 80 * 2 ** 30 and available == pytest.approx(TPU_CHIPS["v5e"].hbm_gib * 2 ** 30, rel=1e-3)


def test_the_attention_a_tpu_user_gets_is_the_one_compiled(tiny_model, target, config):
    """The plan chooses the models' kernels for the target's chips (``backends.kernels_for`` on the mesh's
    devices), as a user's run on the TPU chooses them for its own: the TPU's kernels (the Pallas decode attention,
    per shard of the mesh; cuDNN is an NVIDIA GPU's), so the program the plan compiles is the one a user runs."""
    from ppojax import backends
    from ppojax.backends.tpu.kernels import TpuKernels
    from ppojax.models import XLA
    from ppojax import parallel
    from ppojax.rl.program import make_train_step
    from ppojax.trainer.plan import abstract_run, model_config_for

    model_cfg, _, _ = model_config_for(tiny_model)
    mesh = parallel.make_mesh(*MESH, devices=target.devices)
    assert mesh.devices.flat[0].platform == "tpu"
    run = abstract_run(config, model_cfg, mesh)
    assert run.program.actor_critic.kernels == TpuKernels(mesh=mesh)
    assert backends.kernels_for([], mesh=mesh) == TpuKernels(mesh=mesh)  # what build_run takes on the slice itself
    assert backends.kernels_for([], mesh=mesh, attention_implementation="xla") is XLA
    # a run packing rows longer than a padded row: splash skips the blocks of other sequences
    longer = dataclasses.replace(config, padding_free=True,
                                 packed_row_length=2 * (config.max_prompt_length + config.response_length))
    assert abstract_run(longer, model_cfg, mesh).program.actor_critic.kernels == \
        TpuKernels(mesh=mesh, skip_other_sequences=True)
    as_planned = make_train_step(run.program, run.state_shardings).jitted.lower(run.state, run.prompts,
                                                                                run.key).as_text()
    assert "cudnn" not in as_planned and "CustomSPMDPartitioning" not in as_planned
    assert "ppojax_decode_attention" in as_planned


def test_several_slices_put_data_across_the_slices():
    """Multi-slice: data spans the slices (their data-center network carries only the gradients' reduction)."""
    from ppojax import parallel
    from ppojax.trainer import plan_targets

    devices = plan_targets.tpu_devices(plan_targets.parse_target("tpu:v5e:2x2:slices=2"))
    assert len(devices) == 8 and parallel.slice_count(devices) == 2
    mesh = parallel.make_mesh(2, 2, 2, devices=devices)
    assert [{d.slice_index for d in mesh.devices[i].flat} for i in range(2)] == [{0}, {1}]
    with pytest.raises(ValueError, match="must be a multiple of 2"):
        parallel.make_mesh(1, 4, 2, devices=devices)


def test_a_topology_libtpu_refuses_is_a_one_line_error(capsys):
    from pathlib import Path

    from ppojax.trainer.cli import main

    config = Path(__file__).resolve().parents[1] / "configs/plan.yaml"
    code = main(["plan", str(config), "--model", "llama-3.2-1b", "--target", "tpu:v5e:3x3"])
    err = capsys.readouterr().err
    assert code == 2 and "libtpu refused the topology 'v5e:3x3'" in err and "e.g. tpu:v5e:4x4" in err, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err


def test_a_mesh_axis_across_two_torus_sides_still_makes_a_mesh():
    """tensor=8 on a 4x4x4 v5p is no product of the torus sides: the axis spans parts of two (a warning), not a
    crash of jax.make_mesh."""
    from ppojax import parallel
    from ppojax.trainer import plan_targets

    devices = plan_targets.tpu_devices(plan_targets.parse_target("tpu:v5p:4x4x4"))
    mesh = parallel.make_mesh(1, 8, 8, devices=devices)
    assert dict(mesh.shape) == {"data": 1, "fsdp": 8, "tensor": 8} and len(set(mesh.devices.flat)) == 64


#: (query heads, key heads, head_dim) -> the layout the TPU kernel reads the cache in (decode_attention.cache_layout;
#: "merged": the TPU's kernels store a slot's key heads side by side, decode_attention.merged_slots)
HEADS = {"slots_minor": (8, 4, 8), "rows_major": (8, 2, 128), "heads_major": (6, 3, 128), "merged": (4, 2, 64)}


@pytest.mark.parametrize("segments,kernels,layout", [(1, "xla", "slots_minor"), (4, "xla", "slots_minor"),
                                                     (1, "tpu", "slots_minor"), (4, "tpu", "slots_minor"),
                                                     (1, "tpu", "rows_major"), (1, "tpu", "heads_major"),
                                                     (4, "tpu", "merged")])
def test_the_decode_loop_writes_the_kv_cache_in_place(target, segments, kernels, layout):
    """The whole sampler (prefill, then the decode loop with the layer loop inside) compiled for one v5e chip: no
    instruction inside the decode loop copies the KV cache; each step writes its new keys and values into the cache
    it carries. (Outside the loop the cache may be copied once per call: the TPU compiler gives the loop's cache
    its own layout.) With decode segments, each loop's attention reads its first slots where they lie: no
    instruction of a loop makes a layer's slots into an array of their own. Both with XLA's attention and with the
    TPU's kernels (the Pallas decode attention, which reads each layer's slots from the cache the loop carries, in
    each of the layouts the compiler gives caches of different head counts and sizes, and over a cache the TPU's
    kernels store with a slot's key heads side by side)."""

    from benchmarks import hlo_text
    from ppojax.backends.tpu.decode_attention import cache_layout, merged_slots
    from ppojax.backends.tpu.kernels import TpuKernels
    from ppojax.models import XLA, ModelConfig
    from ppojax.rl.sampler import decode_segments
    from tests.compiled_sampler import sampler_hlo

    heads, kv_heads, head_dim = HEADS[layout]
    cfg = ModelConfig.from_hf({**TINY, "num_hidden_layers": 4, "max_position_embeddings": 256,
                               "num_attention_heads": heads, "num_key_value_heads": kv_heads,
                               "hidden_size": heads * head_dim})
    merged = merged_slots(kv_heads, head_dim) and kernels == "tpu"
    assert ("merged" if merged else cache_layout(kv_heads, head_dim)) == layout
    chosen = XLA if kernels == "xla" else TpuKernels()
    hlo = sampler_hlo(cfg, chosen, target.devices[0], segments=segments)
    slot = f"{kv_heads * head_dim}" if merged else f"{kv_heads},{head_dim}"  # how one slot's keys are stored
    cache_shape = f"bf16[4,8,192,{slot}]"  # [layers, rows, prompt + response slots, one slot's keys]
    module = hlo_text.computations(hlo)
    loops = [name for lines in module.values() for line in lines if " while(" in line
             for name in hlo_text.called(line)]
    assert len(loops) >= 4  # the decode loop and the layer loop inside it: a body and a condition each
    loop_lines = [line for name in hlo_text.reachable(module, loops) for line in module[name]]
    assert any(cache_shape in line and "dynamic-update-slice" in line for line in loop_lines)  # the cache's write
    copies = [line.strip()[:160] for line in loop_lines if re.search(re.escape(cache_shape) + r"\S* copy\(", line)]
    assert copies == [], copies
    # the decode loops (a loop whose body runs the layer loop) and the layer loops in them, their own instructions:
    # one token a step, so a [rows, N > 1 slots, kv heads, head dim] result is a layer's slots made an array
    def body_of(line):
        return re.search(r"body=%?([\w.\-]+)", line).group(1)

    bodies = {name: [body_of(line) for line in module[name] if " while(" in line] for name in module}
    decode_bodies = [body_of(line) for lines in module.values() for line in lines
                     if " while(" in line and bodies.get(body_of(line))]
    assert len(decode_bodies) == segments
    decode_lines = [line for body in decode_bodies for name in [body, *bodies[body]] for line in module[name]]
    kernel_calls = [line for line in decode_lines if "tpu_custom_call" in line and "ppojax_decode_attention" in line]
    # the kernel takes a loop whose slots read split into blocks of 128 lanes, or the whole cache in one block
    reads = [read for _, read in decode_segments(64, 128, segments, alignment=8)]
    taken = [read for read in reads if read % 128 == 0 or read == 192]
    assert len(kernel_calls) == (len(taken) if kernels == "tpu" else 0) and len(taken) >= 1, (reads, kernel_calls)
    layer_slots = [line.strip()[:160] for line in decode_lines
                   if re.match(rf"\s+(ROOT )?%?[\w.\-]+ = bf16\[8,([2-9]|\d\d+),{slot}\]", line)]
    assert layer_slots == [], layer_slots


def test_a_sweep_of_models_reads_each_cache_once(target):
    """The decode kernel under vmap (two models of a sweep, each its own cache and layer) compiled for one v5e chip:
    one kernel over the stacked caches, no copy of a model's cache; the compiler counts the bytes of each model's
    slots read once (the caches are 96 % of the operands)."""
    from ppojax.backends.tpu.decode_attention import decode_attention

    chip = NamedSharding(Mesh(np.array(target.devices[:1]), ("chip",)), PartitionSpec())

    def shaped(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=chip)

    models, layers, rows, slots, kv_heads, head_dim = 2, 4, 8, 1536, 8, 64
    cache = shaped((models, layers, rows, slots, kv_heads, head_dim), jnp.bfloat16)
    fn = jax.jit(jax.vmap(lambda q, k, v, layer, m: decode_attention(q, k, v, layer, m, scale=0.125,
                                                                      slots_read=slots, bt=768)))
    compiled = fn.lower(shaped((models, rows, 32, head_dim), jnp.bfloat16), cache, cache,
                        shaped((models,), jnp.int32), shaped((models, rows, slots), jnp.bool_)).compile()
    text = compiled.as_text()
    assert len(re.findall(r"ppojax_decode_attention[.\d]* = ", text)) == 1
    assert not re.search(r"bf16\[(2,)?4,8,(1536,8,64|8,64,1536)\]\S* (copy|fusion)\(", text)
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    slots_read_bytes = 2 * models * rows * slots * kv_heads * head_dim * 2
    assert cost["bytes accessed"] < 1.05 * slots_read_bytes


def test_a_forward_without_a_cache_takes_splash_attention_per_shard(target):
    """A model's forward and backward on packed rows of 1024 tokens (bfloat16, GQA 4 over 2 heads of 64) compiled
    for a v5e-8 on a data x fsdp x tensor mesh with TPUs' kernels: splash attention's forward, dq and dkv kernels
    (segmented), run per shard; no [G * 1024, 1024] scores anywhere in the program, which XLA's attention writes (its
    forward shows them). The same with the kernels made from each row's mask (`skip_other_sequences`, for rows
    packed longer)."""
    from ppojax import parallel
    from ppojax.backends.tpu.kernels import TpuKernels
    from ppojax.models import XLA, CausalLM, ModelConfig

    mesh = parallel.make_mesh(*MESH, devices=target.devices)
    length, rows = 1024, 8
    # 256 wide (4 query heads over 2 key heads of 64): quicker for libtpu than a wider model, and narrow enough that
    # only the scores end in [4-digit rows, 1024], the pattern the assertions below look for
    cfg = ModelConfig.from_hf({**TINY, "hidden_size": 256, "intermediate_size": 256, "num_attention_heads": 4,
                               "num_key_value_heads": 2, "head_dim": 64, "max_position_embeddings": length})
    by_rows = NamedSharding(mesh, PartitionSpec(("data", "fsdp")))
    tokens = jax.ShapeDtypeStruct((rows, length), jnp.int32, sharding=by_rows)
    mask = jax.ShapeDtypeStruct((rows, length), jnp.bool_, sharding=by_rows)
    texts = {}
    for name, kernels in (("xla", XLA), ("tpu", TpuKernels(mesh=mesh)),
                          ("skipping", TpuKernels(mesh=mesh, skip_other_sequences=True))):
        graphdef, params = nnx.split(nnx.eval_shape(lambda: CausalLM(
            cfg, rngs=nnx.Rngs(0), dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, kernels=kernels)))
        params = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), params,
                              parallel.param_shardings(params, mesh))

        def loss(p, ids, mask, segments):
            hidden, _ = nnx.merge(graphdef, p)(ids, mask, None, segment_ids=segments)
            return jnp.sum(jnp.where(mask[..., None], hidden.astype(jnp.float32), 0) ** 2)

        # XLA's program only shows that the pattern finds its scores: its forward has them
        program = loss if kernels is XLA else jax.grad(loss)
        texts[name] = jax.jit(program).lower(params, tokens, mask, tokens).compile().as_text()
    kernels = set(re.findall(r"splash_mha_\w+", texts["tpu"]))
    assert kernels == {"splash_mha_fwd_segmented_residuals", "splash_mha_dq_segmented_no_residuals",
                       "splash_mha_dkv_segmented_no_residuals"}, kernels
    scores = re.compile(r"(f32|bf16)\[[\d,]*\d{4},1024\]")  # [.., G * S, S]: a key head's query rows
    assert scores.search(texts["xla"]) and not scores.search(texts["tpu"])
    # rows packed longer (TpuKernels' skip_other_sequences): the kernels made from each row's mask, no scores either
    assert set(re.findall(r"splash_mha_\w+", texts["skipping"])) == {
        "splash_mha_fwd_residuals", "splash_mha_dq_no_residuals", "splash_mha_dkv_no_residuals"}
    assert not scores.search(texts["skipping"])
