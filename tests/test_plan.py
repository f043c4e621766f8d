"""`ppojax plan`: ahead-of-time memory / FLOP plan on virtual CPU devices (ppojax/trainer/plan.py).

The plans run the CLI in subprocesses (it sets up its own N virtual devices before JAX starts) on a tiny
one-layer Llama whose config.json is written to a temporary directory (no weights anywhere).
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import pytest

from ppojax.trainer.cli import main
from ppojax.trainer.plan import PRESETS, model_config_for, parse_mesh
from tests.xla_test_flags import CHEAP_COMPILES

REPO = Path(__file__).resolve().parents[1]
TINY = dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=8,
            num_key_value_heads=8, vocab_size=256, max_position_embeddings=64, eos_token_id=2, pad_token_id=0)
SETTINGS = ["batch_size=16", "max_prompt_length=8", "response_length=4", "num_ppo_epochs=1", "precision=float32",
            "remat=none", "stop_token=eos", "gradient_accumulation_steps=1", "logits_chunk_size=null"]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_plan")
    (path / "config.json").write_text(json.dumps(TINY))
    return path


def run_plan(model, out, *args):
    """The CLI in a subprocess -> (completed process, the plan's JSON)."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "XLA_FLAGS": CHEAP_COMPILES}
    done = subprocess.run([sys.executable, "-m", "ppojax.trainer.cli", "plan", str(REPO / "configs/plan.yaml"),
                           "--model", str(model), "--json", str(out), *args, *SETTINGS],
                          capture_output=True, text=True, env=env, cwd=REPO, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return done, json.loads(Path(out).read_text())


@pytest.fixture(scope="module")
def one_device(tiny_model, tmp_path_factory):
    return run_plan(tiny_model, tmp_path_factory.mktemp("p1") / "plan.json", "--programs", "train_step,update")


def test_fsdp8_holds_an_eighth_of_the_arguments(tiny_model, one_device, tmp_path):
    _, single = one_device
    _, split = run_plan(tiny_model, tmp_path / "plan.json", "--devices", "8", "--mesh", "1,8,1",
                        "--programs", "update")
    assert split["mesh"] == {"data": 1, "fsdp": 8, "tensor": 1} and split["devices"] == 8

    def update(plan):
        return next(p for p in plan["programs"] if p["name"] == "update")

    # XLA's own per-device argument bytes (state + experience) and the plan's state bytes: ~1/8 each
    ratio = update(split)["argument_bytes"] / update(single)["argument_bytes"]
    assert abs(ratio * 8 - 1) < 0.25, ratio
    assert abs(split["state_bytes"] * 8 / single["state_bytes"] - 1) < 0.25
    assert update(split)["peak_bytes"] < update(single)["peak_bytes"]
    # the cache's rows split over the 8 devices (its write index on each)
    assert split["kv_cache"]["bytes_per_device"] == (single["kv_cache"]["bytes"] - 4) // 8 + 4


def test_xla_flops_and_the_model_shape_count_agree_in_scale(one_device):
    # one layer, one epoch, one decode step: XLA's loop-bodies-once count sees nearly the whole update
    _, plan = one_device
    step = next(p for p in plan["programs"] if p["name"] == "train_step")
    ratio = step["flops"] * plan["devices"] / plan["model_flops"]["total"]
    assert 0.5 < ratio < 2.0, ratio


def test_cli_prints_the_table_and_the_fit(one_device):
    done, plan = one_device
    out = done.stdout
    assert "per device (GB)" in out and "train_step" in out and "update" in out and "temporaries" in out
    assert "fits a 80 GB device" in out and "reward ScoreModel" in out
    assert plan["fits"] is True and plan["peak_bytes"] > plan["state_bytes"] > 0
    # the rollout's KV cache: 16 rows x (8 + 4) slots of 1 layer x 8 kv heads x head_dim 8, float32 keys and values,
    # a bool slot mask per row and slot, an i32 write index
    kv_bytes = 2 * (1 * 16 * 12 * 8 * 8 * 4) + 16 * 12 + 4
    assert plan["kv_cache"] == {"rows": 16, "slots": 12, "dtype": "float32", "bytes": kv_bytes,
                                "bytes_per_device": kv_bytes}
    assert "rollout KV cache: 16 rows x 12 slots, float32" in out


def test_lora_plan_compiles_adapters_as_the_only_trained_weights(tiny_model, one_device, tmp_path):
    """--lora-rank compiles the LoRA program itself: the trained state is the adapters (+ the value head) and
    their two Adam moments, counted here from the model's shapes; the frozen base is also the reference."""
    r = 4
    done, lora = run_plan(tiny_model, tmp_path / "plan.json", "--lora-rank", str(r), "--programs", "train_step",
                          "value_head=policy")
    _, full = run_plan(tiny_model, tmp_path / "full.json", "--programs", "train_step", "value_head=policy")
    D, F, L, q = TINY["hidden_size"], TINY["intermediate_size"], TINY["num_hidden_layers"], TINY["hidden_size"]
    kv = TINY["num_key_value_heads"] * D // TINY["num_attention_heads"]
    in_out = [(D, q), (D, kv), (D, kv), (q, D), (D, F), (D, F), (F, D)]  # q, k, v, o, gate, up, down
    adapters = L * r * sum(i + o for i, o in in_out)
    value_head = D + 1
    expected = 3 * 4 * (adapters + value_head)  # params + Adam's mu and nu, float32
    assert 0 <= lora["trainable_bytes"] - expected < 64, (lora["trainable_bytes"], expected)
    assert full["trainable_bytes"] > 10 * lora["trainable_bytes"]
    # full: policy + its two moments + the reference copy + reward; LoRA: base (= reference) + reward + adapters'
    # state. So LoRA's state is the full one without the trained policy's state, plus the adapters' state.
    assert abs(lora["state_bytes"] - (full["state_bytes"] - full["trainable_bytes"] + lora["trainable_bytes"])) < 1024
    assert lora["lora_r"] == r and "rank-4 LoRA adapters" in done.stdout and "frozen base" in done.stdout


def test_a_grouped_estimators_program_gets_one_prompt_per_group(tiny_model):
    """GRPO samples each prompt num_generations times inside the program: the plan feeds batch / G prompts (it fed
    the whole batch, planning G times the rows)."""
    from ppojax import parallel
    from ppojax.trainer.config import PPOConfig
    from ppojax.trainer.plan import abstract_run

    config = PPOConfig.from_yaml(REPO / "configs/plan.yaml", [*SETTINGS, "advantage_estimator=grpo",
                                                             "num_generations=4"])
    model_cfg, _, _ = model_config_for(str(tiny_model))
    run = abstract_run(config, model_cfg, parallel.make_mesh(1, 1, 1, devices=jax.devices()[:1]))
    assert run.prompts.shape == (16 // 4, 8)


def test_a_dynamic_sampling_program_is_planned_with_its_rounds_prompts(tiny_model):
    """filter_groups: the step reads max_num_gen_batches rounds of gen_batch_size prompts; it compiles, the rounds
    judged by the reward filter_groups_metric names (the plan's stand-in reward model takes that name)."""

    from ppojax import parallel
    from ppojax.trainer.config import PPOConfig
    from ppojax.trainer.plan import abstract_run, compile_program

    config = PPOConfig.from_yaml(REPO / "configs/plan.yaml", [
        *SETTINGS, "advantage_estimator=grpo", "num_generations=4", "filter_groups=true", "gen_batch_size=8",
        "max_num_gen_batches=2", "filter_groups_metric=acc"])
    model_cfg, _, _ = model_config_for(str(tiny_model))
    run = abstract_run(config, model_cfg, parallel.make_mesh(1, 1, 1, devices=jax.devices()[:1]))
    assert run.prompts.shape == (2, 8, 8)
    assert compile_program(run, "train_step").temp_bytes > 0


def test_an_asynchronous_program_is_planned_with_its_batches_in_flight(tiny_model):
    """max_staleness: the state holds that many sampled batches (their tokens, log-probs, scores, versions): the
    plan's state has them, and the step compiles with them."""
    from ppojax import parallel
    from ppojax.trainer.config import PPOConfig
    from ppojax.trainer.plan import abstract_run, compile_program

    config = PPOConfig.from_yaml(REPO / "configs/plan.yaml", [*SETTINGS, "max_staleness=3",
                                                             "behaviour_logprobs=sampler"])
    model_cfg, _, _ = model_config_for(str(tiny_model))
    run = abstract_run(config, model_cfg, parallel.make_mesh(1, 1, 1, devices=jax.devices()[:1]))
    R = config.response_length
    assert run.state.in_flight.query_responses.shape == (3, 16, 8 + R)
    assert run.state.in_flight.behaviour_logprobs.shape == (3, 16, R)
    assert compile_program(run, "train_step").temp_bytes > 0


def test_in_flight_weight_updates_are_planned_with_their_caches_in_flight(tiny_model):
    """in_flight_weight_updates on the continuous sampler: the state holds each part-decoded batch's slots (their KV
    cache rows first) and rows, and the step compiles with them."""
    from ppojax import parallel
    from ppojax.trainer.config import PPOConfig
    from ppojax.trainer.plan import abstract_run, compile_program

    config = PPOConfig.from_yaml(REPO / "configs/plan.yaml", [*SETTINGS, "max_staleness=2", "rollout_slots=4",
                                                             "behaviour_logprobs=sampler",
                                                             "in_flight_weight_updates=true"])
    model_cfg, _, _ = model_config_for(str(tiny_model))
    run = abstract_run(config, model_cfg, parallel.make_mesh(1, 1, 1, devices=jax.devices()[:1]))
    R = config.response_length
    queue = run.state.in_flight.state
    assert queue.cache.keys.shape[:2] == (2, 4) and queue.cache.keys.shape[3] == 8 + R  # [k, slots, layers, P + R, ...]
    assert queue.responses.shape == (2, 16, R) and queue.versions.shape == (2, 16, R)
    assert compile_program(run, "train_step").temp_bytes > 0


def test_an_agent_program_is_planned_with_its_episode_buffers(tiny_model):
    """An agent run's step (tools / environment_factory) compiles without its environment: a stand-in ends every
    episode after one turn, the buffers and loops keep the config's shapes."""

    from ppojax import parallel
    from ppojax.trainer.config import PPOConfig
    from ppojax.trainer.plan import abstract_run, compile_program

    config = PPOConfig.from_yaml(REPO / "configs/plan.yaml", [
        *SETTINGS, "environment_factory=ppojax.tasks.guess_number:GuessNumber", "turn_length=4",
        "observation_length=3", "max_tool_calling_iterations=2", "chat_template=true"])
    model_cfg, _, _ = model_config_for(str(tiny_model))
    run = abstract_run(config, model_cfg, parallel.make_mesh(1, 1, 1, devices=jax.devices()[:1]))
    assert run.program.settings.sampling.episodes.max_turns == 3
    # a row holds the prompt, 3 turns of 4 tokens and 2 observations of 3 with the stop token before each
    from ppojax.trainer.plan import rollout_kv_cache
    kv = rollout_kv_cache(run, model_cfg, config)
    assert kv["slots"] == 8 + 3 * 4 + 2 * (1 + 3)
    # each prompt prefilled once (num_generations episodes each) on the prompts' own slots (the whole row's here:
    # fewer than the 128 a prefill's reads are rounded up to)
    sampling = run.program.settings.sampling
    prompts = run.program.settings.batch.batch_size // sampling.num_generations
    assert kv["prompt_bank"] == {
        "rows": prompts, "slots": kv["slots"], "bytes": (kv["bytes"] - 4) // kv["rows"] * prompts + 4}  # + the index
    assert compile_program(run, "train_step").temp_bytes > 0


def test_the_plan_counts_an_int8_kv_cache(tiny_model):
    """kv_cache_dtype: int8: 8-bit codes and a 4-byte scale per token and kv head (head_dim 8 -> 12 bytes)."""
    from ppojax import parallel
    from ppojax.trainer.config import PPOConfig
    from ppojax.trainer.plan import abstract_run, rollout_kv_cache

    config = PPOConfig.from_yaml(REPO / "configs/plan.yaml", [*SETTINGS, "kv_cache_dtype=int8"])
    model_cfg, _, _ = model_config_for(str(tiny_model))
    run = abstract_run(config, model_cfg, parallel.make_mesh(1, 1, 1, devices=jax.devices()[:1]))
    kv_bytes = 2 * (1 * 16 * 12 * 8 * (8 + 4)) + 16 * 12 + 4
    assert rollout_kv_cache(run, model_cfg, config) == {"rows": 16, "slots": 12, "dtype": "int8", "bytes": kv_bytes,
                                                        "bytes_per_device": kv_bytes}


def test_presets_read_through_the_family_code():
    cfg, _, _ = model_config_for("meta-llama/Llama-3.1-8B")
    assert (cfg.hidden_size, cfg.num_layers, cfg.num_kv_heads, cfg.vocab_size) == (4096, 32, 8, 128256)
    assert cfg.rope_scaling_dict["rope_type"] == "llama3" and not cfg.tie_word_embeddings
    qwen, _, _ = model_config_for("Qwen2.5-7B")
    assert qwen.qkv_bias and qwen.num_kv_heads == 4 and qwen.sliding_window is None
    assert model_config_for("llama-3.2-1b")[0].tie_word_embeddings
    assert set(PRESETS) >= {"llama-3.2-1b", "llama-3.1-8b", "qwen2.5-7b", "llama-3.1-70b"}


@pytest.mark.parametrize("args, message", [
    (["--model", "llama-9b"], "neither a preset"),
    (["--model", "llama-3.2-1b", "--devices", "8", "--mesh", "2,2,1"], "make data * fsdp * tensor == 8"),
    (["--model", "llama-3.2-1b", "--mesh", "2,x,1"], "expected three sizes"),
    (["--model", "llama-3.2-1b", "--programs", "sample"], "--programs"),
    (["--model", "llama-3.2-1b", "--target", "gpu:h100"], "expected 'cpu', 'tpu:<chip>:<topology>[:slices=K]' or"),
    (["--model", "llama-3.2-1b", "--target", "gpu:a100x8"], "unknown GPU 'a100'; expected one of h100, h200"),
    (["--model", "llama-3.2-1b", "--target", "gpu:h100x16"], "1 to 8 GPUs per host"),
    (["--model", "llama-3.2-1b", "--target", "tpu:v7:2x2"], "unknown TPU chip 'v7'; expected one of v5e, v5p, v6e"),
    (["--model", "llama-3.2-1b", "--target", "tpu:v5p:2x2"], "a v5p topology has 3 sizes"),
    (["--model", "llama-3.2-1b", "--target", "tpu:v5e:32x32"], "at most 256 chips"),
    (["--model", "llama-3.2-1b", "--target", "tpu:v5e:4x4", "--devices", "8"], "its 16 chips; leave --devices out"),
    (["--model", "llama-3.2-1b", "--target", "tpu:v5e:4x4", "--hbm-gb", "16"], "leave --hbm-gb out"),
    (["--model", "llama-3.2-1b", "--target", "tpu:v5e:4x4", "--mesh", "1,8,1"], "the target has 16"),
])
def test_bad_inputs_exit_2_with_a_message(args, message, capsys):
    code = main(["plan", str(REPO / "configs/plan.yaml"), *args])
    err = capsys.readouterr().err
    assert code == 2 and message in err and "Traceback" not in err, err


def test_a_tpu_target_without_libtpu_names_the_fix(monkeypatch, capsys):
    from ppojax.trainer import plan_targets
    monkeypatch.setattr(plan_targets, "tpu_compiler_installed", lambda: False)
    code = main(["plan", str(REPO / "configs/plan.yaml"), "--model", "llama-3.2-1b", "--target", "tpu:v5e:4x4"])
    err = capsys.readouterr().err
    assert code == 2 and "needs libtpu" in err and "pip install 'ppojax[tpu]'" in err and "Traceback" not in err, err


def test_a_gpu_target_without_the_cuda_plugin_names_the_fix(monkeypatch, capsys):
    from ppojax.trainer import plan_targets
    monkeypatch.setattr(plan_targets, "cuda_plugin", lambda: None)
    code = main(["plan", str(REPO / "configs/plan.yaml"), "--model", "llama-3.2-1b", "--target", "gpu:h100x8"])
    err = capsys.readouterr().err
    assert code == 2 and "needs JAX's CUDA plugin" in err and "pip install 'ppojax[cuda]'" in err, err


def test_parse_mesh():
    assert parse_mesh("1,8,1") == (1, 8, 1)


def test_a_bfloat16_plan_turns_off_its_pass_beside_passes_already_turned_off(monkeypatch):
    """The plan's pass is added where XLA_FLAGS already lists disabled passes (the suite's own, a user's): XLA adds
    each --xla_disable_hlo_passes list to those before it."""
    from ppojax.trainer import plan

    monkeypatch.setattr(plan.jax.config, "update", lambda *args: None)  # this process's backend has started
    monkeypatch.setenv("XLA_FLAGS", "--xla_disable_hlo_passes=hlo-verifier")
    plan.use_virtual_devices(8, "bfloat16")
    assert os.environ["XLA_FLAGS"].split() == ["--xla_disable_hlo_passes=hlo-verifier",
                                               "--xla_backend_optimization_level=0", plan.NO_HOISTED_UPCASTS]
