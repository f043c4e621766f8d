"""Compiling ``train_step`` while the weights load (``ppojax.trainer.compile_ahead``): the abstract models equal
the loaded ones' structure, the first call of the step compiled ahead compiles nothing and computes what the
plain step computes, and a wrong structure guess falls back to compiling at the first call."""
import contextlib
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ppojax.trainer.config import PPOConfig
from ppojax.models import ScoreModel, abstract_pretrained, load_pretrained, save_pretrained
from ppojax.models.lora import _initial_adapters
from ppojax.trainer import build as build_module
from ppojax.trainer.build import build_run
from ppojax.trainer.loop import step_key
from ppojax.rl.program import make_train_step
from ppojax.trainer.ppo_trainer import PPOTrainer
from tests.tiny_setup import PROMPTS, tiny_config, tiny_policy, tiny_tokenizer

_jax_monitoring = pytest.importorskip("jax._src.monitoring")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """A causal LM checkpoint (with its tokenizer) and a reward model checkpoint whose score head has a bias."""
    root = tmp_path_factory.mktemp("ahead")
    save_pretrained(tiny_policy(), tiny_config(), root / "policy", tokenizer=tiny_tokenizer())
    save_pretrained(ScoreModel(tiny_config(), rngs=nnx.Rngs(5), bias=True), tiny_config(), root / "reward")
    return root


def _shapes(module):
    return jax.tree.map(lambda x: (x.shape, jnp.dtype(x.dtype)), nnx.state(module))


@pytest.mark.parametrize("kind, directory", [("causal_lm", "policy"), ("value_head", "policy"), ("score", "policy"),
                                             ("score", "reward")])
def test_abstract_pretrained_has_the_loaded_models_structure(checkpoints, kind, directory):
    options = dict(kind=kind, param_dtype=jnp.bfloat16, dtype=jnp.bfloat16, remat="dots", seed=3)
    loaded, cfg = load_pretrained(checkpoints / directory, **options)
    abstract, abstract_cfg = abstract_pretrained(checkpoints / directory, **options)
    assert nnx.graphdef(abstract) == nnx.graphdef(loaded)
    assert abstract_cfg == cfg
    assert _shapes(abstract) == _shapes(loaded)
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(nnx.state(abstract)))
    if directory == "reward":  # the bias comes from the tensor names
        assert "bias" in nnx.state(abstract)["score"]


def test_lora_adapters_drawn_in_one_program_equal_a_draw_per_kernel():
    shapes = (((2, 32, 64), 1, jnp.dtype(jnp.float32)), ((2, 32, 4, 8), 1, jnp.dtype(jnp.bfloat16)),
              ((2, 4, 8, 32), 2, jnp.dtype(jnp.float32)))
    key = jax.random.key(7)
    for (shape, n_in, dtype), k, (a, b) in zip(shapes, jax.random.split(key, len(shapes)),
                                               _initial_adapters(key, shapes, 4)):
        in_shape = shape[1:1 + n_in]
        bound = 1.0 / np.sqrt(np.prod(in_shape))
        expected = jax.random.uniform(k, (shape[0], *in_shape, 4), dtype, -bound, bound)
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(expected, np.float32))
        assert a.dtype == dtype and b.shape == (shape[0], 4, *shape[1 + n_in:]) and not np.any(np.asarray(b))


@contextlib.contextmanager
def backend_compiles():
    """The XLA compiles (seconds each) of this thread's and every other thread's jit calls within the block."""
    seconds = []

    def listen(event, duration, **kwargs):
        if event.endswith("backend_compile_duration"):
            seconds.append(duration)

    _jax_monitoring.register_event_duration_secs_listener(listen)
    try:
        yield seconds
    finally:
        _jax_monitoring.unregister_event_duration_listener(listen)


def _config(checkpoints, tmp_path, **fields):
    values = dict(model_name_or_path=str(checkpoints / "policy"), output_dir=str(tmp_path / "out"),
                  reward_function="tests.test_cli:good_fraction", max_prompt_length=6, response_length=4,
                  batch_size=8, num_ppo_epochs=1, total_episodes=16, num_eval_prompts=0, learning_rate=1e-2,
                  compilation_cache_dir="none", seed=1)
    return PPOConfig.from_dict({**values, **fields})


def _first_update(run, train_step):
    prompts, key = next(run.batches).input_ids, step_key(run.config.seed, 0)
    jax.block_until_ready(key)
    with backend_compiles() as compiles:
        state, metrics = jax.block_until_ready(train_step(run.state, prompts, key))
    return state, jax.device_get(metrics), compiles


@pytest.mark.parametrize("fields", [
    dict(value_head="policy", lora_r=4, lora_alpha=8),  # the demo's kind of run: LoRA, a value head, a function
    dict(reward_function=None, reward_model_path="REWARD"),  # a reward model (with a bias); the value its copy
    dict(max_staleness=2, behaviour_logprobs="sampler"),  # the state's queue of batches in flight
], ids=["lora-value-head", "reward-model", "asynchronous"])
def test_the_step_compiled_ahead_compiles_nothing_at_its_first_call_and_equals_the_plain_step(
        checkpoints, tmp_path, fields):
    fields = {k: str(checkpoints / "reward") if v == "REWARD" else v for k, v in fields.items()}
    if fields.get("lora_r"):  # through the trainer, as `ppojax train` with compile_ahead: true
        trainer = PPOTrainer(_config(checkpoints, tmp_path, compile_ahead=True, **fields), train_dataset=PROMPTS)
        run = trainer.run
        assert trainer.train_step is run.train_step is not None
    else:
        run = build_run(_config(checkpoints, tmp_path, **fields), train_dataset=PROMPTS, compile_ahead=True)
        assert run.train_step is not None
    ahead = run.train_step.compile_ahead.wait()
    assert ahead.error is None and ahead.seconds > 0
    state, metrics, compiles = _first_update(run, run.train_step)
    assert compiles == [], f"the first call compiled {len(compiles)} program(s) again"

    if fields.get("lora_r"):  # the same run built without compiling ahead computes the same update
        plain = build_run(_config(checkpoints, tmp_path, **fields), train_dataset=PROMPTS)
        assert plain.train_step is None
        plain_state, plain_metrics, compiles = _first_update(plain, make_train_step(plain.program,
                                                                                    plain.state_shardings))
        assert compiles, "the plain step compiles at its first call"
        assert metrics.keys() == plain_metrics.keys()
        for name in metrics:
            np.testing.assert_array_equal(metrics[name], plain_metrics[name], err_msg=name)
        for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(plain_state.params)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_wrong_structure_guess_falls_back_to_the_loaded_models_program(checkpoints, tmp_path, monkeypatch):
    from ppojax.trainer import compile_ahead
    started = []

    def wrong_guess(**sources):  # a structure other than the loaded models' (here: another remat in the graphdefs)
        return real(**{**sources, "config": dataclasses.replace(sources["config"], remat="full")})

    def start_without_compiling(program, params, frozen, **kwargs):  # the guess's program, not compiled here
        started.append(program)
        return compile_ahead.CompileAhead(program, train_step=lambda *args: pytest.fail("the guess's step ran"))

    real = build_module.abstract_models
    monkeypatch.setattr(build_module, "abstract_models", wrong_guess)
    monkeypatch.setattr(build_module, "start_train_step", start_without_compiling)
    run = build_run(_config(checkpoints, tmp_path), train_dataset=PROMPTS, compile_ahead=True)
    assert started and run.train_step is None and run.program is not started[0]
    # the run's program is the loaded models' (remat 'dots'), not the guess's ('full')
    assert run.program.actor_critic.policy_graphdef != started[0].actor_critic.policy_graphdef
