"""A tiny Llama's whole ``train_step`` compiled by XLA's GPU compiler for a host of 8 H100s, without any GPU
(``ppojax plan --target gpu:h100x8``, ppojax/trainer/plan_targets.py), with the attention a GPU user gets (cuDNN's
fused kernel, which `ppojax.backends.kernels_for` chooses for the target's GPUs, as for a run on them).

Skipped where JAX's CUDA plugin is not installed (pip install 'ppojax[cuda]', about 3.8 GB: not part of `make test`).
"""
import json
import re

import pytest

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
