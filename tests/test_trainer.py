"""PPOTrainer end to end on a tiny random Llama: learning, the legacy API, adaptive KL, recompilation."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ppojax import core as ppo
from ppojax.models import XLA
from ppojax.trainer.config import ConfigError, PPOConfig
from ppojax.trainer.ppo_trainer import PPOTrainer
from tests.tiny_setup import PROMPTS, tiny_policy, tiny_tokenizer


def good_fraction(prompts, completions):
    """Reward: the fraction of completion words that are 'good'."""
    return [sum(w == "good" for w in c.split()) / max(1, len(c.split())) for c in completions]


def make_trainer(tmp_path, **overrides):
    values = dict(output_dir=str(tmp_path / "run"), report_to="none", batch_size=16, response_length=8,
                  max_prompt_length=6, learning_rate=1e-2, temperature=1.0, kl_coef=0.01, total_episodes=16 * 30,
                  num_sample_generations=0, seed=0)
    values.update(overrides)
    if "init_kl_coef" in overrides:  # the legacy name for kl_coef
        values.pop("kl_coef")
    config = PPOConfig.from_dict(values)
    from ppojax.trainer.build import model_kwargs
    options = {k: v for k, v in model_kwargs(config).items() if k in ("dtype", "param_dtype")}  # the precision
    return PPOTrainer(config, processing_class=tiny_tokenizer(),
                      model=tiny_policy(value_head=config.value_head == "policy", **options),
                      reward_model=good_fraction, train_dataset=PROMPTS)


def test_learning_raises_the_score_without_recompiling(tmp_path):
    trainer = make_trainer(tmp_path)
    history = trainer.train(progress=False)
    scores = [m["objective/scores"] for m in history]
    first, last = np.mean(scores[:3]), np.mean(scores[-3:])
    assert last > first + 0.3, (first, last)
    assert trainer.train_step.jitted._cache_size() == 1
    assert all(np.isfinite(m["objective/kl"]) for m in history)
    for name in ("objective/kl", "objective/entropy", "objective/non_score_reward", "objective/rlhf_reward",
                 "policy/approxkl_avg", "policy/clipfrac_avg", "loss/policy_avg", "loss/value_avg",
                 "val/clipfrac_avg", "policy/entropy_avg", "val/ratio", "val/ratio_var", "val/num_eos_tokens",
                 "lr", "episode", "eps"):
        assert name in history[-1], name
    assert history[-1]["episode"] == 16 * 30
    assert history[0]["lr"] == pytest.approx(1e-2) and history[-1]["lr"] < history[0]["lr"]


def test_value_head_on_policy_backbone_trains(tmp_path):
    trainer = make_trainer(tmp_path, value_head="policy", total_episodes=16 * 2)
    history = trainer.train(progress=False)
    assert set(trainer.state.params) == {"policy"}
    assert np.isfinite(history[-1]["loss/value_avg"])


def test_legacy_generate_and_step_with_adaptive_kl(tmp_path):
    trainer = make_trainer(tmp_path, adap_kl_ctrl=True, init_kl_coef=0.2, target=6.0, horizon=10000,
                           stop_token="eos", use_score_scaling=True, use_score_norm=True, score_clip=2.0)
    tok = trainer.tokenizer
    queries = [tok(p)["input_ids"] for p in PROMPTS[:16]]
    responses = trainer.generate(queries)
    assert len(responses) == 16 and all(len(r) <= 8 for r in responses)
    assert all(1 not in r[:-1].tolist() for r in responses)  # nothing after the stop token
    scores = np.linspace(0, 3, 16)  # mean 1.5
    coef_before = trainer.kl_coef
    stats = trainer.step(queries, responses, scores)
    kl = stats["objective/kl"]
    expected = ppo.adaptive_kl_update(coef_before, kl, 16, 6.0, 10000)
    assert trainer.kl_coef == pytest.approx(float(expected), rel=1e-6)
    assert trainer.kl_coef != coef_before
    # logged raw (TRL's objective/scores) AND as the update used them: normalised by the running moments
    # (the first batch's mean and unbiased std: (s - 1.5) / std lies within the clip of 2, mean 0)
    assert stats["objective/scores"] == pytest.approx(1.5, abs=1e-6)
    assert abs(stats["objective/scores_processed"]) < 1e-5
    assert int(trainer.state.optimizer_steps) == 4
    with pytest.raises(ConfigError, match="same length"):
        trainer.step(queries, responses[:3], scores)
    with pytest.raises(ValueError, match="index 2"):
        trainer.step(queries, responses, np.where(np.arange(16) == 2, np.nan, scores))


def test_save_model_round_trips_in_transformers(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM
    trainer = make_trainer(tmp_path, total_episodes=16)
    trainer.train(progress=False)
    # the weights go to the file from the host, never back to a device (the gather to the host is allowed:
    # on a GPU it is a transfer)
    with (jax.transfer_guard_host_to_device("disallow_explicit"),
          jax.transfer_guard_device_to_device("disallow_explicit")):
        trainer.save_model(tmp_path / "policy")
    torch_model = AutoModelForCausalLM.from_pretrained(tmp_path / "policy").eval()
    ids = np.array([[5, 4, 6, 2, 3]])
    from ppojax.rl.forward import sequence_inputs
    policy = nnx.merge(trainer.run.program.actor_critic.policy_graphdef, trainer.policy_params)
    hidden, _ = policy(*sequence_inputs(ids, 0))
    ours = np.asarray(policy.logits(hidden))
    with torch.no_grad():
        theirs = torch_model(torch.tensor(ids)).logits.numpy()
    np.testing.assert_allclose(ours, theirs, atol=1e-4)


def test_resume_continues_exactly(tmp_path):
    straight = make_trainer(tmp_path / "a", total_episodes=16 * 4, adap_kl_ctrl=True, init_kl_coef=0.1)
    expected = straight.train(progress=False)
    first = make_trainer(tmp_path / "b", total_episodes=16 * 4, adap_kl_ctrl=True, init_kl_coef=0.1, save_steps=2)
    first.train(num_updates=2, progress=False)
    resumed = make_trainer(tmp_path / "b", total_episodes=16 * 4, adap_kl_ctrl=True, init_kl_coef=0.1,
                           resume="auto")
    got = resumed.train(progress=False)
    assert int(resumed.state.update_count) == 4 and len(got) == 2
    for a, b in zip(expected[2:], got):
        for name in ("objective/scores", "objective/kl", "loss/policy_avg", "loss/value_avg", "lr"):
            assert a[name] == b[name], name
    jax.tree.map(np.testing.assert_array_equal, straight.state.params, resumed.state.params)
    assert resumed.kl_coef == straight.kl_coef


def test_logits_chunk_size_is_sized_from_the_memory_budget(tmp_path, monkeypatch):
    from ppojax.rl import forward

    trainer = make_trainer(tmp_path, num_mini_batches=2, gradient_accumulation_steps=2)
    # tiny vocabulary: a micro-batch's logits fit easily, so no chunking in the update or the rollout
    settings = trainer.run.settings.batch
    assert settings.update_logits_chunk is None and settings.rollout_logits_chunk is None
    vocab = trainer.run.model_config.vocab_size
    # a budget of 3 response steps of one micro-batch (4 rows) -> chunks of 3 in the update;
    # the rollout forwards all 16 rows at once, so less than one step of them fits -> 1
    monkeypatch.setattr(forward, "LOGITS_MEMORY_BUDGET", 4 * 4 * 3 * vocab)
    monkeypatch.setattr(forward.auto_chunk_size, "__defaults__", (forward.LOGITS_MEMORY_BUDGET,))
    small = make_trainer(tmp_path / "small", num_mini_batches=2, gradient_accumulation_steps=2)
    assert small.run.settings.batch.micro_batch_size == 4
    assert small.run.settings.batch.update_logits_chunk == 3 and small.run.settings.batch.rollout_logits_chunk == 1
    fixed = make_trainer(tmp_path / "fixed", logits_chunk_size=5)
    assert fixed.run.settings.batch.update_logits_chunk == 5 and fixed.run.settings.batch.rollout_logits_chunk == 5


def test_precision_and_remat_policies_reach_every_model(tmp_path):
    """precision: mixed keeps float32 parameters (and Adam moments) with bfloat16 compute in the policy, the
    reference and the value model; remat and the attention choice reach the model graphs; a step trains."""
    from tests.tiny_setup import write_tiny_run_inputs

    dirs = write_tiny_run_inputs(tmp_path / "inputs")
    config = PPOConfig.from_dict(dict(
        model_name_or_path=str(dirs / "model"), dataset=str(dirs / "prompts.jsonl"),
        reward_function="tests.test_cli:good_fraction",
        output_dir=str(tmp_path / "run"), report_to="none", batch_size=16, response_length=8, max_prompt_length=6,
        total_episodes=16, num_sample_generations=0, precision="mixed", remat="dots", attention_implementation="xla"))
    trainer = PPOTrainer(config)
    state = trainer.state
    for tree in (state.params, state.opt_state, state.frozen["ref"]):
        floating = {x.dtype for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.floating)}
        assert floating == {np.dtype("float32")}
    ac = trainer.run.program.actor_critic
    for graphdef, params in ((ac.policy_graphdef, state.params["policy"]), (ac.value_graphdef, state.params["value"])):
        model = nnx.merge(graphdef, params)
        backbone = model.backbone
        assert model.dtype == jnp.bfloat16 and backbone.remat == "dots"
    history = trainer.train(progress=False)
    assert np.isfinite(history[-1]["loss/policy_avg"]) and int(trainer.state.optimizer_steps) == 4


def test_evaluation_and_sample_tables_are_scored_by_a_reward_model(tmp_path):
    """With a reward ScoreModel (no Python function), the held-out evaluation and the sample table carry its
    scores: the head at each prompt + completion's last non-pad token, recomputed here with a plain loop."""
    from ppojax.models import ScoreModel
    from tests.tiny_setup import tiny_config

    reward = ScoreModel(tiny_config(), rngs=nnx.Rngs(7))
    config = PPOConfig.from_dict(dict(output_dir=str(tmp_path / "run"), report_to="none", batch_size=8,
                                      response_length=6, max_prompt_length=6, total_episodes=8, num_eval_prompts=12,
                                      num_sample_generations=0, stop_token="eos", seed=0))
    trainer = PPOTrainer(config, processing_class=tiny_tokenizer(), model=tiny_policy(), reward_model=reward,
                         train_dataset=PROMPTS)
    result = trainer.evaluate(step=0)
    assert result is not None and len(result["scores"]) == len(result["completions"]) == 12

    expected = []
    for start in (0, 8):  # the evaluation's two sampler batches (the second padded to 8 rows)
        queries = np.asarray(trainer.eval_queries[start:start + 8])
        queries = np.concatenate([queries, np.repeat(queries[-1:], 8 - len(queries), 0)])
        _, _, responses, _ = trainer._sample(queries, step=0)
        tokens = np.concatenate([queries, responses], axis=1)
        mask = tokens != 0
        per_position = np.asarray(reward(jnp.asarray(tokens), jnp.asarray(mask),
                                         jnp.asarray(np.cumsum(mask, 1) - mask)))
        expected += [float(per_position[i, np.flatnonzero(mask[i]).max()]) for i in range(len(tokens))][:12 - start]
    np.testing.assert_allclose(result["scores"], expected, atol=1e-5)
    assert np.isclose(result["mean_score"], np.mean(expected))
    assert len(set(np.round(expected, 6))) > 1  # the scores differ between completions: a real check

    class Recorder:
        def log_samples(self, step, prompts, completions, scores):
            self.logged = (step, prompts, completions, scores)

    trainer.logger = Recorder()
    trainer.log_samples(step=0, num=3)
    step, prompts, completions, scores = trainer.logger.logged
    assert (prompts, completions) == (result["prompts"][:3], result["completions"][:3])
    np.testing.assert_allclose(scores, expected[:3], atol=1e-5)


def test_logging_steps_logs_every_n_updates_and_the_last(tmp_path):
    """logging_steps=2 over 5 updates: metrics.jsonl holds updates 2, 4 and the last one, 5 (train() still
    returns every update's metrics)."""
    import json

    trainer = make_trainer(tmp_path, logging_steps=2, total_episodes=16 * 5)
    history = trainer.train(progress=False)
    assert len(history) == 5
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [2, 4, 5]
    for row in rows:
        assert row["objective/kl"] == pytest.approx(history[row["step"] - 1]["objective/kl"], rel=1e-6)


def test_a_mixed_precision_update_moves_the_parameters_as_float32s_does(tmp_path):
    """One legacy step() (4 epochs of Adam on the same queries, responses and scores) under `mixed` (float32
    weights and moments, bfloat16 matmuls) and under `float32`: the parameters stay float32 and their change is
    float32's up to bfloat16 rounding (same direction and size), yet not identical (the matmuls did change)."""
    changes = {}
    for precision in ("float32", "mixed"):
        trainer = make_trainer(tmp_path / precision, precision=precision, stop_token="eos")
        queries = [trainer.tokenizer(p)["input_ids"] for p in PROMPTS[:16]]
        responses = [np.random.default_rng(i).integers(2, 16, size=8) for i in range(16)]
        before = [np.asarray(x, np.float64) for x in jax.tree.leaves(trainer.state.params)]
        trainer.step(queries, responses, np.linspace(-1, 1, 16))
        after = jax.tree.leaves(trainer.state.params)
        assert all(x.dtype == np.float32 for x in after), precision
        changes[precision] = np.concatenate([np.ravel(np.asarray(a, np.float64) - b) for a, b in zip(after, before)])
    f32, mixed = changes["float32"], changes["mixed"]
    cosine = f32 @ mixed / (np.linalg.norm(f32) * np.linalg.norm(mixed))
    assert cosine > 0.95, cosine
    assert 0.9 < np.linalg.norm(mixed) / np.linalg.norm(f32) < 1.1
    assert not np.array_equal(f32, mixed)


def test_a_given_model_follows_the_configs_compute_choices(tmp_path):
    """A model passed to PPOTrainer runs with the config's remat and the backend's kernels chosen for the run (as a
    loaded one does); a precision it was not built with is refused before anything runs, naming the fix."""
    trainer = make_trainer(tmp_path, remat="full", attention_implementation="xla", total_episodes=16)
    model = nnx.merge(trainer.run.program.actor_critic.policy_graphdef, trainer.state.params["policy"])
    assert (model.backbone.remat, model.backbone.kernels) == ("full", XLA)
    config = PPOConfig.from_dict(dict(output_dir=str(tmp_path / "mixed"), report_to="none", batch_size=16,
                                      response_length=8, max_prompt_length=6, precision="mixed"))
    with pytest.raises(ConfigError, match=r"policy passed to PPOTrainer computes in float32 with float32 weights, "
                                          r"but precision='mixed' means bfloat16 compute over float32 weights"):
        PPOTrainer(config, processing_class=tiny_tokenizer(), model=tiny_policy(), reward_model=good_fraction,
                   train_dataset=PROMPTS)


def test_a_two_label_classifier_rewards_with_the_chosen_label(tmp_path):
    """reward_model_path = a 2-label transformers classifier with reward_model_label=1: the run's scores (here
    the held-out evaluation's) are transformers' logit 1 at the last non-pad token of prompt + completion."""
    import torch
    import transformers

    from tests.tiny_setup import tiny_config

    hf_config = transformers.AutoConfig.for_model(**tiny_config().to_hf())
    hf_config.num_labels = 2
    torch.manual_seed(0)
    classifier = transformers.AutoModelForSequenceClassification.from_config(hf_config).eval()
    classifier.save_pretrained(tmp_path / "classifier")
    config = PPOConfig.from_dict(dict(output_dir=str(tmp_path / "run"), report_to="none", batch_size=8,
                                      response_length=6, max_prompt_length=6, total_episodes=8, num_eval_prompts=8,
                                      num_sample_generations=0, stop_token="eos", seed=0,
                                      reward_model_path=str(tmp_path / "classifier"), reward_model_label=1))
    trainer = PPOTrainer(config, processing_class=tiny_tokenizer(), model=tiny_policy(), train_dataset=PROMPTS)
    result = trainer.evaluate(step=0)
    queries = np.asarray(trainer.eval_queries)
    _, _, responses, _ = trainer._sample(queries, step=0)
    tokens = np.concatenate([queries, responses], axis=1)
    mask = tokens != 0
    with torch.no_grad():
        ids, attention = torch.tensor(tokens, dtype=torch.long), torch.tensor(mask, dtype=torch.long)
        logits = classifier(input_ids=ids, attention_mask=attention,
                            position_ids=attention.cumsum(-1) - attention).logits.numpy()
    np.testing.assert_allclose(result["scores"], logits[:, 1], atol=1e-4)
    assert not np.allclose(logits[:, 0], logits[:, 1], atol=1e-3)  # the label matters


def test_the_callers_modules_stay_intact_while_the_run_trains_its_own_arrays(tmp_path):
    """The train state takes over the arrays it is built from (so the build never holds the weights twice), but
    never the caller's: the modules given to PPOTrainer (one module in two roles included) keep their arrays
    and values through donated updates, while the run's own policy and value model move."""
    from ppojax.models import ScoreModel
    from tests.tiny_setup import tiny_config

    policy, reward = tiny_policy(), ScoreModel(tiny_config(), rngs=nnx.Rngs(7))
    given = {"policy": policy, "reward": reward}
    before = {name: [np.array(x) for x in jax.tree.leaves(nnx.state(m))] for name, m in given.items()}
    config = PPOConfig.from_dict(dict(output_dir=str(tmp_path / "run"), report_to="none", batch_size=8,
                                      response_length=6, max_prompt_length=6, total_episodes=8, learning_rate=1e-2,
                                      num_sample_generations=0, seed=0))
    trainer = PPOTrainer(config, processing_class=tiny_tokenizer(), model=policy, ref_model=policy,
                         reward_model=reward, value_model=reward, train_dataset=PROMPTS)
    trainer.train(progress=False)
    for name, module in given.items():
        for leaf, old in zip(jax.tree.leaves(nnx.state(module)), before[name], strict=True):
            assert not leaf.is_deleted(), name
            np.testing.assert_array_equal(np.asarray(leaf), old, err_msg=name)
    for name, role in (("policy", "policy"), ("reward", "value")):
        trained = jax.tree.leaves(trainer.state.params[role])
        assert max(float(np.abs(np.asarray(a) - b).max()) for a, b in zip(trained, before[name])) > 1e-4, role


def test_sample_tables_and_evaluations_show_the_prompt_the_user_wrote(tmp_path):
    """With chat_template on, the model reads (and reward functions receive) the template's rendering, preamble
    included; what the sample tables and eval_*.json show is the prompt as the dataset gave it."""
    from tests.tiny_setup import PROMPTS, tiny_policy, tiny_tokenizer

    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = "it is {% for m in messages %}{{ m['content'] }} {% endfor %}"  # a preamble
    config = PPOConfig.from_dict(dict(output_dir=str(tmp_path / "run"), report_to="none", batch_size=8,
                                      response_length=4, max_prompt_length=10, total_episodes=8, num_eval_prompts=4,
                                      chat_template=True, reward_function="tests.test_cli:good_fraction"))
    trainer = PPOTrainer(config, processing_class=tokenizer, model=tiny_policy(), train_dataset=PROMPTS[:40])
    result = trainer.evaluate(step=0)
    assert result["prompts"] == PROMPTS[36:40]  # the held-out rows, as written
    decoded, _ = trainer.sample_completions(trainer.eval_queries[:4])
    assert all(d.startswith("it is ") and d.endswith(p) for d, p in zip(decoded, PROMPTS[36:40]))  # as read
