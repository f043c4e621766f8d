"""A tiny Llama's whole ``train_step`` compiled by XLA's GPU compiler for a host of 8 H100s, without any GPU
(``ppojax plan --target gpu:h100x8``, ppojax/trainer/plan_targets.py), with the attention a GPU user gets (cuDNN's
fused kernel, which `ppojax.backends.kernels_for` chooses for the target's GPUs, as for a run on them).

Skipped where JAX's CUDA plugin is not installed (pip install 'ppojax[cuda]', about 3.8 GB: not part of `make test`).
"""
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ppojax.trainer.plan_targets import cuda_plugin

pytestmark = pytest.mark.skipif(cuda_plugin() is None,
                                reason="JAX's CUDA plugin is not installed: pip install 'ppojax[cuda]'")

TINY = dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=8,
            num_key_value_heads=4, vocab_size=256, max_position_embeddings=64, eos_token_id=2, pad_token_id=0)
SETTINGS = dict(batch_size=16, max_prompt_length=8, response_length=4, num_ppo_epochs=1, precision="bfloat16",
                remat="full", stop_token="eos", gradient_accumulation_steps=2, logits_chunk_size=None)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_gpu")
    (path / "config.json").write_text(json.dumps(TINY))
    return str(path)


@pytest.fixture(scope="module")
def target():
    from ppojax.trainer import plan_targets
    return plan_targets.load_target(plan_targets.parse_target("gpu:h100x8"))


def _config(**changes):
    from ppojax.trainer.config import PPOConfig
    return PPOConfig.from_dict({**SETTINGS, "model_name_or_path": "tiny", **changes})


def test_the_host_is_eight_h100s(target):
    assert len(target.devices) == 8 and {d.device_kind for d in target.devices} == {"NVIDIA H100 80GB HBM3"}
    assert {d.compute_capability for d in target.devices} == {"9.0"} and target.compiler.startswith("XLA:GPU")


def test_train_step_compiles_with_cudnn_attention_on_a_data_tensor_mesh(tiny_model, target):
    from ppojax import parallel
    from ppojax.rl.program import make_train_step
    from ppojax.trainer import plan

    model_cfg, _, _ = plan.model_config_for(tiny_model)
    run = plan.abstract_run(_config(), model_cfg, parallel.make_mesh(2, 1, 4, devices=target.devices))
    lowered = make_train_step(run.program, run.state_shardings).jitted.lower(run.state, run.prompts, run.key)
    compiled = lowered.compile()
    assert compiled.memory_analysis().argument_size_in_bytes > 0
    assert "__cudnn$fmha" in compiled.as_text()  # "auto" took cuDNN's fused attention, as on the GPUs themselves


@pytest.mark.parametrize("mesh_shape", [(1, 8, 1), (2, 2, 2)])
def test_train_step_compiles_with_cudnn_attention_on_an_fsdp_mesh(tiny_model, target, mesh_shape):
    # cuDNN's partitioner takes q, k and v only when sharded alike, which XLA's propagation does not give on an fsdp
    # mesh: without parallel.attention_operand_placement this compile raises "Query, key and value should have
    # same sharding"
    from ppojax import parallel
    from ppojax.rl.program import make_train_step
    from ppojax.trainer import plan

    model_cfg, _, _ = plan.model_config_for(tiny_model)
    run = plan.abstract_run(_config(), model_cfg, parallel.make_mesh(*mesh_shape, devices=target.devices))
    lowered = make_train_step(run.program, run.state_shardings).jitted.lower(run.state, run.prompts, run.key)
    kernels = set(re.findall(r'custom_call_target="(__cudnn[^"]*)"', lowered.compile().as_text()))
    assert kernels == {"__cudnn$fmhaScaleBiasSoftmax", "__cudnn$fmhaScaleBiasSoftmaxBackward"}  # rollout and update


def test_xla_attention_compiles_on_an_fsdp_mesh(tiny_model, target):
    from ppojax.trainer import plan
    result = plan.plan(_config(attention_implementation="xla"), tiny_model, mesh_shape=(2, 2, 2), target=target,
                       programs=("train_step",))
    assert result.fits and result.programs[0].out_of_memory is None


def test_the_pallas_decode_kernel_compiles_in_the_decode_loop(target):
    """With attention_implementation 'pallas', the whole sampler compiled for one H100: the decode loop's attention
    is the Pallas (Triton) kernel, reading the cache the loop carries (no cache-sized copy inside the loop)."""
    from benchmarks import hlo_text
    from ppojax import backends
    from ppojax.models import ModelConfig
    from tests.compiled_sampler import sampler_hlo

    cfg = ModelConfig.from_hf({**TINY, "hidden_size": 128, "max_position_embeddings": 256})  # head_dim 16
    kernels = backends.kernels_for([], devices=target.devices[:1], attention_implementation="pallas")
    hlo = sampler_hlo(cfg, kernels, target.devices[0], slot_alignment=64)
    module = hlo_text.computations(hlo)
    loops = [name for lines in module.values() for line in lines if " while(" in line
             for name in hlo_text.called(line)]
    loop_lines = [line for name in hlo_text.reachable(module, loops) for line in module[name]]
    kernel_lines = [line for line in loop_lines if "ppojax_decode_attention" in line and "custom-call(" in line]
    assert len(kernel_lines) == 1 and "triton" in kernel_lines[0], kernel_lines  # in the scanned layer loop
    cache_shape = "bf16[2,8,192,4,16]"  # [layers, rows, prompt + response slots, kv heads, head dim]
    assert [line for line in loop_lines if re.search(re.escape(cache_shape) + r"\S* copy\(", line)] == []


def test_the_pallas_decode_kernel_compiles_for_a_sweep_of_models(target):
    """Under vmap (two models of a sweep) the Triton kernel compiles for an H100 as ONE kernel over both caches."""
    from ppojax.backends.gpu.decode_attention import decode_attention

    chip = NamedSharding(Mesh(np.array(target.devices[:1]), ("gpu",)), PartitionSpec())

    def shaped(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=chip)

    cache = shaped((2, 4, 8, 1536, 8, 64), jnp.bfloat16)
    fn = jax.jit(jax.vmap(lambda q, k, v, layer, m: decode_attention(q, k, v, layer, m, scale=0.125,
                                                                      slots_read=1536)))
    text = fn.lower(shaped((2, 8, 32, 64), jnp.bfloat16), cache, cache, shaped((2,), jnp.int32),
                    shaped((2, 8, 1536), jnp.bool_)).compile().as_text()
    calls = [line for line in text.splitlines() if "ppojax_decode_attention" in line and "custom-call(" in line]
    assert len(calls) == 1, calls
