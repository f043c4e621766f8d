"""LoRA: adapters on the stacked projections, the reference = base weights with adapters off, adapters-only
optimizer state, checkpoints of the adapters, and the two exports (merged HF checkpoint, PEFT adapter directory)
checked against transformers / peft (torch)."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx

from ppojax.models import CausalLM, ModelConfig, save_pretrained
from ppojax.models.lora import LoraSpec, merge_lora, resolve_target_modules, with_lora
from ppojax.models.peft_io import save_peft_adapter

PAD = 0
LLAMA = dict(model_type="llama", vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, intermediate_size=48, max_position_embeddings=64, rms_norm_eps=1e-6,
             rope_theta=10000.0, tie_word_embeddings=False, attention_bias=True, bos_token_id=1, eos_token_id=1,
             pad_token_id=0)
GPT2 = dict(model_type="gpt2", vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=64, bos_token_id=1,
            eos_token_id=1)
ALL_LLAMA = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _batch(seed=0, b=3, s=9):
    rng = np.random.default_rng(seed)
    ids = rng.integers(2, 64, (b, s)).astype(np.int32)
    mask = np.ones((b, s), bool)
    mask[1, :3] = False  # left padding
    mask[2, :1] = False
    ids[~mask] = PAD
    return ids, mask


def _randomise_adapters(adapters, seed=1):
    """B is zero at init (the adapted model = the base); random A and B make the adapters matter."""
    leaves, treedef = jax.tree.flatten(adapters)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    return jax.tree.unflatten(treedef, [0.05 * jax.random.normal(k, x.shape, x.dtype) for k, x in zip(keys, leaves)])


def _adapted(hf: dict, targets, rank=4, alpha=8.0):
    cfg = ModelConfig.from_hf(hf)
    spec = LoraSpec(rank, alpha, resolve_target_modules(cfg, targets))
    model = CausalLM(cfg, rngs=nnx.Rngs(0))
    base_gd, lora_gd, adapters, base = with_lora(model, spec, jax.random.key(3))
    return cfg, spec, base_gd, lora_gd, _randomise_adapters(adapters), base


def _logits(graphdef, *states, ids, mask):
    model = nnx.merge(graphdef, *states)
    hidden, _ = model(jnp.asarray(ids), jnp.asarray(mask))
    return np.asarray(model.logits(hidden))


def _torch_logits(model, ids, mask):
    positions = np.maximum(np.cumsum(mask, -1) - 1, 0)  # ppojax's positions of left-padded rows
    with torch.no_grad():
        out = model(input_ids=torch.as_tensor(ids, dtype=torch.long), attention_mask=torch.as_tensor(mask).long(),
                    position_ids=torch.as_tensor(positions, dtype=torch.long))
    return out.logits.float().numpy()


@pytest.mark.parametrize("hf, targets", [(LLAMA, "all-linear"), (GPT2, ["c_proj", "c_fc"])], ids=["llama", "gpt2"])
def test_exports_reproduce_ppojax_logits_in_transformers_and_peft(tmp_path, hf, targets):
    """The merged HF checkpoint (transformers) and the PEFT adapter directory on the base checkpoint (peft) give
    ppojax's adapted logits (<= 1e-4); the adapters change the logits, and B = 0 gives the base exactly."""
    from peft import PeftModel

    cfg, spec, base_gd, lora_gd, adapters, base = _adapted(hf, targets)
    ids, mask = _batch()
    ours = _logits(lora_gd, base, adapters, ids=ids, mask=mask)
    base_logits = _logits(base_gd, base, ids=ids, mask=mask)
    live = mask
    assert np.abs(ours - base_logits)[live].max() > 1e-2  # the adapters matter

    save_pretrained(nnx.merge(base_gd, base), cfg, tmp_path / "base")
    save_pretrained(nnx.merge(base_gd, merge_lora(base, adapters, spec.scale)), cfg, tmp_path / "merged")
    save_peft_adapter(adapters, cfg, spec, tmp_path / "adapter", base_model_name_or_path=str(tmp_path / "base"))

    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
    np.testing.assert_allclose(_torch_logits(merged, ids, mask)[live], ours[live], atol=1e-4)

    base_torch = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32).eval()
    np.testing.assert_allclose(_torch_logits(base_torch, ids, mask)[live], base_logits[live], atol=1e-4)
    peft_model = PeftModel.from_pretrained(base_torch, tmp_path / "adapter").eval()
    np.testing.assert_allclose(_torch_logits(peft_model, ids, mask)[live], ours[live], atol=1e-4)
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["peft_type"]) == (4, 8.0, "LORA")
    assert config["fan_in_fan_out"] == (hf["model_type"] == "gpt2")  # GPT-2's Conv1D weights are [in, out]

    zero_b = jax.tree.map(lambda x: x, adapters)
    zero_b = jax.tree.map_with_path(lambda p, x: jnp.zeros_like(x) if "lora_b" in jax.tree_util.keystr(p) else x,
                                    zero_b)
    np.testing.assert_array_equal(_logits(lora_gd, base, zero_b, ids=ids, mask=mask), base_logits)


def test_adapters_only_where_targeted_with_logical_axes():
    cfg, spec, base_gd, lora_gd, adapters, base = _adapted(LLAMA, ["q_proj", "o_proj", "down_proj"], rank=4)
    pure = nnx.to_pure_dict(adapters)["backbone"]["layers"]
    assert set(pure) == {"attn", "mlp"} and set(pure["attn"]) == {"q", "o"} and set(pure["mlp"]) == {"down"}
    L, D, H, hd, F = 2, 32, 4, 8, 48
    shapes = jax.tree.map(jnp.shape, pure)
    assert shapes["attn"]["q"] == {"lora_a": (L, D, 4), "lora_b": (L, 4, H, hd)}
    assert shapes["attn"]["o"] == {"lora_a": (L, H, hd, 4), "lora_b": (L, 4, D)}
    assert shapes["mlp"]["down"] == {"lora_a": (L, F, 4), "lora_b": (L, 4, D)}
    from ppojax.models import logical_axes
    axes = nnx.to_pure_dict(logical_axes(adapters))["backbone"]["layers"]
    assert axes["attn"]["q"] == {"lora_a": ("layers", "embed", None), "lora_b": ("layers", None, "heads", "head_dim")}
    assert axes["mlp"]["down"] == {"lora_a": ("layers", "mlp", None), "lora_b": ("layers", None, "embed")}
    # the base State is exactly the model's weights: no adapter in it
    assert not any("lora" in jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(base))


@pytest.mark.parametrize("hf, targets, words", [
    (LLAMA, ["q_proj", "qproj"], ["'qproj' is not a projection of a llama model", "'q_proj'", "'all-linear'"]),
    (GPT2, ["c_attn"], ["'c_attn' is a fused q|k|v projection in gpt2", "['c_fc', 'c_proj']"]),
    (GPT2, "all-linear", ["includes the fused c_attn", "list the modules"]),
])
def test_bad_target_modules_are_named(hf, targets, words):
    with pytest.raises(ValueError) as err:
        resolve_target_modules(ModelConfig.from_hf(hf), targets)
    for w in words:
        assert w in str(err.value)


def test_all_linear_is_every_projection_of_the_family():
    assert set(resolve_target_modules(ModelConfig.from_hf(LLAMA), "all-linear")) == set(ALL_LLAMA)


# ------------------------------------------------------------------------------------------- a LoRA PPO run


def _lora_policy():
    """The tiny Llama with a 20x LM head: its logits span a few nats, so adapters on the blocks (never the head)
    can move the distribution; with the default 0.02 init no change of the hidden states can."""
    from tests.tiny_setup import tiny_policy
    model = tiny_policy()
    model.lm_head["kernel"][...] = 20 * model.lm_head["kernel"][...]
    return model


def _lora_trainer(tmp_path, **overrides):
    from ppojax.trainer.config import PPOConfig
    from ppojax.trainer.ppo_trainer import PPOTrainer
    from tests.test_trainer import good_fraction
    from tests.tiny_setup import PROMPTS, tiny_tokenizer
    values = dict(output_dir=str(tmp_path / "run"), report_to="none", batch_size=16, response_length=8,
                  max_prompt_length=6, learning_rate=3e-3, temperature=1.0, kl_coef=0.01, total_episodes=16 * 20,
                  num_sample_generations=0, seed=0, lora_r=8, lora_alpha=16)
    values.update(overrides)
    return PPOTrainer(PPOConfig.from_dict(values), processing_class=tiny_tokenizer(), model=_lora_policy(),
                      reward_model=good_fraction, train_dataset=PROMPTS)


def _count(tree) -> int:
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.floating))


def _policy_logits(module, ids, mask):
    hidden, _ = module(jnp.asarray(ids), jnp.asarray(mask))
    return np.asarray(module.logits(hidden))


def test_lora_run_learns_trains_only_adapters_and_exports(tmp_path):
    from peft import PeftModel

    trainer = _lora_trainer(tmp_path)
    state, ac = trainer.state, trainer.run.program.actor_critic
    ids, mask = _batch()
    ids = ids % 16  # the tiny vocabulary

    # the reference forward is the base model's forward (adapters off), with no copy of the policy
    assert state.frozen["ref"] is None and set(state.frozen) == {"base", "ref", "reward"}
    base_model = _lora_policy()  # an independent instance of the initial policy
    np.testing.assert_array_equal(_policy_logits(ac.reference(state.frozen, state.params), ids, mask),
                                  _policy_logits(base_model, ids, mask))
    assert _count(state.frozen["base"]) == _count(nnx.state(base_model))

    history = trainer.train(progress=False)
    scores = [m["objective/scores"] for m in history]
    assert np.mean(scores[-3:]) > np.mean(scores[:3]) + 0.3, scores
    state = trainer.state

    # trainable = the adapters (+ the value model); the optimizer state (Adam's mu and nu) = 2x that, counted
    L, D, H, K, hd, F, r = 2, 32, 4, 2, 8, 64, 8
    per_layer = ((D * r + r * H * hd) * 2 + (D * r + r * K * hd) * 2  # q, o; k, v
                 + (D * r + r * F) * 2 + (F * r + r * D))            # gate, up; down
    leaves = jax.tree_util.tree_leaves_with_path(state.params["policy"])
    assert all("lora_" in jax.tree_util.keystr(p) for p, _ in leaves)
    assert _count(state.params["policy"]) == L * per_layer
    assert _count(state.opt_state) == 2 * (L * per_layer + _count(state.params["value"]))
    # the base weights did not move; the reference is still the initial policy
    np.testing.assert_array_equal(_policy_logits(ac.reference(state.frozen, state.params), ids, mask),
                                  _policy_logits(base_model, ids, mask))

    # exports: policy/ (merged) in transformers, policy_adapter/ (PEFT) on the base checkpoint in peft
    ours = _policy_logits(ac.policy(state.params, state.frozen), ids, mask)
    # the merged weights reach the file without a trip to a device (the gather to the host is allowed: on a
    # GPU it is a transfer)
    with (jax.transfer_guard_host_to_device("disallow_explicit"),
          jax.transfer_guard_device_to_device("disallow_explicit")):
        trainer.save_model(tmp_path / "policy")
    save_pretrained(base_model, base_model.cfg, tmp_path / "base")
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "policy", dtype=torch.float32).eval()
    np.testing.assert_allclose(_torch_logits(merged, ids, mask)[mask], ours[mask], atol=1e-4)
    base_torch = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32).eval()
    peft_model = PeftModel.from_pretrained(base_torch, tmp_path / "policy_adapter").eval()
    np.testing.assert_allclose(_torch_logits(peft_model, ids, mask)[mask], ours[mask], atol=1e-4)

    # checkpoints hold the adapters (+ value model, optimizer, counters); the base comes back from the config
    trainer.save_checkpoint()
    resumed = _lora_trainer(tmp_path, resume="auto")
    resumed.resume("auto")
    jax.tree.map(np.testing.assert_array_equal, resumed.state.params, state.params)
    jax.tree.map(np.testing.assert_array_equal, resumed.state.opt_state, state.opt_state)
    np.testing.assert_array_equal(
        _policy_logits(resumed.run.program.actor_critic.policy(resumed.state.params, resumed.state.frozen), ids,
                       mask), ours)


def test_lora_target_modules_are_checked_before_any_weights_load(tmp_path):
    from ppojax.trainer.config import ConfigError, PPOConfig
    from ppojax.trainer.build import preflight
    (tmp_path / "config.json").write_text(  # no weights
        json.dumps({**GPT2, "n_positions": 128, "architectures": ["GPT2LMHeadModel"]}))
    config = PPOConfig(model_name_or_path=str(tmp_path), reward_function="vader", lora_r=8,
                       lora_target_modules=["q_proj", "c_fc"])
    with pytest.raises(ConfigError, match=r"'q_proj' is not a projection of a gpt2 model.*\['c_fc', 'c_proj'\]"):
        preflight(config)


def test_lora_with_the_legacy_value_head_trains_adapters_and_the_head(tmp_path):
    """value_head='policy' (TRL <= 0.11's value-head model with a peft_config): the new v_head trains with the
    adapters (PEFT's modules_to_save); every other weight stays frozen and is the reference."""
    from ppojax.trainer.config import PPOConfig
    from ppojax.trainer.ppo_trainer import PPOTrainer
    from tests.test_trainer import good_fraction
    from tests.tiny_setup import PROMPTS, tiny_policy, tiny_tokenizer
    config = PPOConfig(output_dir=str(tmp_path / "run"), report_to="none", batch_size=16, response_length=8,
                       max_prompt_length=6, learning_rate=3e-3, total_episodes=32, num_sample_generations=0,
                       value_head="policy", lora_r=4, lora_target_modules=["q_proj", "v_proj"])
    trainer = PPOTrainer(config, processing_class=tiny_tokenizer(), model=tiny_policy(value_head=True),
                         reward_model=good_fraction, train_dataset=PROMPTS)
    before = jax.tree.map(np.asarray, nnx.to_pure_dict(trainer.state.params["policy"]))
    base_before = jax.tree.map(np.asarray, nnx.to_pure_dict(trainer.state.frozen["base"]))
    history = trainer.train(progress=False)
    after = nnx.to_pure_dict(trainer.state.params["policy"])
    assert set(after) == {"backbone", "v_head"} and np.isfinite(history[-1]["loss/value_avg"])
    assert not np.array_equal(before["v_head"]["kernel"], after["v_head"]["kernel"])
    assert not np.array_equal(before["backbone"]["layers"]["attn"]["q"]["lora_b"],
                              after["backbone"]["layers"]["attn"]["q"]["lora_b"])
    jax.tree.map(np.testing.assert_array_equal, base_before, nnx.to_pure_dict(trainer.state.frozen["base"]))
    ids, mask = _batch()
    ac, state = trainer.run.program.actor_critic, trainer.state
    np.testing.assert_array_equal(_policy_logits(ac.reference(state.frozen, state.params), ids % 16, mask),
                                  _policy_logits(tiny_policy(value_head=True), ids % 16, mask))
