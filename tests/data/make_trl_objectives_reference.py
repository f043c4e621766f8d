"""Generate reference numbers for the policy objectives with TRL 1.12's OWN code.

Run once (CPU only, about a minute, no network / hub access) with the benchmark venv that has TRL 1.12.0:

    .venv-bench/bin/python tests/data/make_trl_objectives_reference.py  (from the repository root)

It writes ``tests/data/trl_objectives_reference.json`` next to this file. It reuses the tiny model, tokenizer,
dataset and patching helpers of ``make_trl_grpo_rloo_reference.py`` (same directory).

What is executed
----------------
* ``objective_loss`` cases: a real ``trl.GRPOTrainer`` per configuration (``trl.experimental.gmpo.GMPOTrainer`` for
  GMPO), then ``_compute_loss(model, inputs)`` with ``_get_per_token_logps_and_entropies`` patched to return our
  fixed NEW per-token log-probs and entropies as leaf tensors that require grad. After ``loss.backward()`` their
  ``.grad`` are the gradients recorded. ``current_gradient_accumulation_steps`` = 1, model in train mode.
  Configurations: every ``loss_type`` (grpo, dr_grpo, dapo, bnpo, cispo, sapo, luspo, vespo) x
  ``importance_sampling_level`` (token, sequence; not luspo/token nor vespo/sequence, which TRL warns against and
  ppojax refuses) x one option at a time: plain, ``epsilon_high``, ``delta`` (the clipped types), ``beta`` with
  and without ``use_bias_correction_kl``, ``top_entropy_quantile`` (0.5 and 0.0), ``mask_truncated_completions``,
  ``entropy_coef`` with ``top_entropy_quantile``, the sapo temperatures / vespo parameters, and all of them at
  once; GMPO (``epsilon`` 0.4, its default) plain, with ``epsilon_high``, ``beta``, ``top_entropy_quantile`` and
  ``mask_truncated_completions``.
* ``mask_truncated_completions``: the completion mask and ``num_items_in_batch`` those cases use are TRL's own,
  from ``GRPOTrainer._generate_and_score_completions`` with ``mask_truncated_completions=True`` (generation patched
  to return our fixed completion ids, as in the other generator).
* ``multi_objective`` cases: ``GRPOTrainer._generate_and_score_completions`` with two reward functions
  (``_calculate_rewards`` patched to return our fixed [N, 2] rewards, NaN where a function does not apply),
  ``multi_objective_aggregation`` in {sum_then_normalize, normalize_then_sum} x ``reward_weights``.
* ``soft_overlong_punishment``: ``trl.rewards.get_soft_overlong_punishment(max_completion_len, soft_punish_cache)``
  on completions of every length 1..max_completion_len + 2.

Inputs (N = 12 rollouts = 3 groups of G = 4, completion width T = 6, right-padded masks; rows 0, 3, 6, 9 end
without EOS, i.e. truncated): log-ratio new - old ~ N(0, 0.3^2) so that every clip is active on some valid tokens
(counts in ``diagnostics``); padded positions hold finite garbage that must be masked out. Every case runs twice:
float64 tensors (``outputs``) and float32 (``outputs_float32``), on the same float32-representable inputs.
"""

from __future__ import annotations

import json
import math
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import make_trl_grpo_rloo_reference as base  # noqa: E402 - sets the offline environment and import stubs

import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
import trl  # noqa: E402
from trl.experimental.gmpo import GMPOConfig, GMPOTrainer  # noqa: E402
from trl.rewards import get_soft_overlong_punishment  # noqa: E402

OUT_PATH = os.path.join(HERE, "trl_objectives_reference.json")
SEED = 20260301
N, G, T, EOS_ID, PAD_ID = base.N, base.G, base.T, base.EOS_ID, base.PAD_ID
f32, tolist = base.f32, base.tolist

LOSS_TYPES = ["grpo", "dr_grpo", "dapo", "bnpo", "cispo", "sapo", "luspo", "vespo"]
CLIPPED = {"grpo", "dr_grpo", "dapo", "bnpo", "luspo"}
LEVELS = {"luspo": ["sequence"], "vespo": ["token"]}  # the rest: both


def variants(loss_type):
    """(name, GRPOConfig options) for one loss type: one option at a time, then all of them."""
    eps_high = 1.1 if loss_type == "cispo" else 0.28  # cispo: epsilon_high is the weight's cap itself
    out = [("plain", {}), ("eh", {"epsilon_high": eps_high}),
           ("beta", {"beta": 0.04, "use_bias_correction_kl": True}),
           ("beta_nobiascorr", {"beta": 0.04, "use_bias_correction_kl": False}),
           ("topent0.5", {"top_entropy_quantile": 0.5}), ("topent0.0", {"top_entropy_quantile": 0.0}),
           ("masktrunc", {"mask_truncated_completions": True}),
           ("entcoef", {"entropy_coef": 0.01, "top_entropy_quantile": 0.5})]
    everything = {"epsilon_high": eps_high, "beta": 0.04, "use_bias_correction_kl": True,
                  "top_entropy_quantile": 0.5, "mask_truncated_completions": True, "entropy_coef": 0.01}
    if loss_type in CLIPPED:
        out.append(("delta", {"delta": 1.5}))
        everything["delta"] = 1.5
    if loss_type == "sapo":
        out.append(("temps", {"sapo_temperature_pos": 1.5, "sapo_temperature_neg": 0.5}))
        everything.update(sapo_temperature_pos=1.5, sapo_temperature_neg=0.5)
    if loss_type == "vespo":
        out.append(("params", {"vespo_k_pos": 1.5, "vespo_lambda_pos": 2.0, "vespo_k_neg": 2.5,
                               "vespo_lambda_neg": 1.5}))
        everything.update(vespo_k_pos=1.5, vespo_lambda_pos=2.0, vespo_k_neg=2.5, vespo_lambda_neg=1.5)
    out.append(("all", everything))
    return out


GMPO_VARIANTS = [("plain", {}), ("eh", {"epsilon_high": 0.3}), ("beta", {"beta": 0.04}),
                 ("topent0.5", {"top_entropy_quantile": 0.5}), ("masktrunc", {"mask_truncated_completions": True})]


def loss_inputs(rng):
    """The fixed rollout of every loss case (float32-representable float64 arrays)."""
    prompt_ids, completion_ids, comp_lens = base.make_rollout_ids(rng)
    P = max(len(p) for p in prompt_ids)
    mask = base.right_pad([[1] * n for n in comp_lens], T, 0)
    old = f32(-rng.uniform(0.05, 3.0, size=(N, T)))
    new = f32(old + rng.normal(scale=0.3, size=(N, T)))
    ref = f32(new + rng.normal(scale=0.3, size=(N, T)))
    entropies = f32(rng.uniform(0.5, 3.0, size=(N, T)))
    advantages = f32(rng.normal(size=N))
    for arr in (old, new, ref):
        arr[mask == 0] = f32(-rng.uniform(4.0, 8.0, size=int((mask == 0).sum())))
    entropies[mask == 0] = f32(rng.uniform(4.0, 8.0, size=int((mask == 0).sum())))  # above every live one
    return dict(prompt_ids=prompt_ids, completion_ids=completion_ids, comp_lens=comp_lens, P=P,
                prompt_ids_arr=base.left_pad(prompt_ids, P, PAD_ID),
                prompt_mask=base.left_pad([[1] * len(p) for p in prompt_ids], P, 0),
                completion_ids_arr=base.right_pad(completion_ids, T, PAD_ID), mask=mask, old=old, new=new, ref=ref,
                entropies=entropies, advantages=advantages)


def diagnostics(x):
    ratio = np.exp(x["new"] - x["old"])
    m = x["mask"] > 0
    A = np.broadcast_to(x["advantages"][:, None], (N, T))
    seq_ratio = np.exp(((x["new"] - x["old"]) * m).sum(1) / m.sum(1))
    out = {
        "n_valid_tokens": int(m.sum()),
        "n_ratio_gt_1.28_and_A_pos": int((m & (ratio > 1.28) & (A > 0)).sum()),
        "n_ratio_lt_0.8_and_A_neg": int((m & (ratio < 0.8) & (A < 0)).sum()),
        "n_ratio_gt_1.5_and_A_neg": int((m & (ratio > 1.5) & (A < 0)).sum()),
        "n_ratio_gt_1.1_and_A_pos": int((m & (ratio > 1.1) & (A > 0)).sum()),
        "n_log_ratio_outside_0.4": int((m & (np.abs(x["new"] - x["old"]) > 0.4)).sum()),
        "n_sequences_ratio_outside_0.8_1.2": int(((seq_ratio < 0.8) | (seq_ratio > 1.2)).sum()),
    }
    assert all(v > 0 for v in out.values()), out
    return out


def trl_truncation_mask(model_path, tok, tmp, x):
    """TRL's completion mask and num_items_in_batch with mask_truncated_completions=True."""
    args = trl.GRPOConfig(**base.common_args(os.path.join(tmp, "masktrunc")), mask_truncated_completions=True,
                          beta=0.0)
    trainer = trl.GRPOTrainer(model=model_path, reward_funcs=base.reward_dummy, args=args,
                              train_dataset=base.dummy_dataset(), processing_class=tok)
    out, _ = base.run_generate_and_score(trainer, x["prompt_ids"], x["completion_ids"],
                                         torch.zeros(N, dtype=torch.float64), grpo=True)
    mask = out["completion_mask"].numpy()
    truncated = np.array([ids[-1] not in (EOS_ID, PAD_ID) for ids in x["completion_ids"]])
    assert (mask.sum(1)[truncated] == 0).all() and (mask.sum(1)[~truncated] > 0).all()
    return mask, int(out["num_items_in_batch"])


def run_loss(trainer, x, mask, num_items, dt, with_ref):
    """TRL's _compute_loss on the fixed inputs in dtype ``dt``: (loss, metrics, d loss / d new, d loss / d entropy)."""
    new_t = torch.tensor(x["new"], dtype=dt, requires_grad=True)
    ent_t = torch.tensor(x["entropies"], dtype=dt, requires_grad=True)
    calls = {"n": 0}

    def patched(model, input_ids, attention_mask, logits_to_keep, *a, **k):
        calls["n"] += 1
        assert logits_to_keep == T and input_ids.shape == (N, x["P"] + T)
        return new_t.clone(), ent_t.clone(), None

    trainer._get_per_token_logps_and_entropies = patched
    inputs = {
        "prompt_ids": torch.tensor(x["prompt_ids_arr"]),
        "prompt_mask": torch.tensor(x["prompt_mask"]),
        "completion_ids": torch.tensor(x["completion_ids_arr"]),
        "completion_mask": torch.tensor(mask),
        "advantages": torch.tensor(x["advantages"], dtype=dt),
        "old_per_token_logps": torch.tensor(x["old"], dtype=dt),
        "num_items_in_batch": torch.tensor(num_items),
    }
    if with_ref:
        inputs["ref_per_token_logps"] = torch.tensor(x["ref"], dtype=dt)
    for mode in trainer._metrics:
        trainer._metrics[mode].clear()
    loss = trainer._compute_loss(trainer.model, inputs)
    assert loss.dtype == dt and loss.ndim == 0 and calls["n"] == 1
    loss.backward()
    grad_new = new_t.grad if new_t.grad is not None else torch.zeros_like(new_t)
    grad_ent = ent_t.grad if ent_t.grad is not None else torch.zeros_like(ent_t)
    metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    return float(loss), metrics, tolist(grad_new), tolist(grad_ent)


def loss_case(name, trainer_cls, config_cls, options, model_path, tok, tmp, x, trunc):
    args = config_cls(**base.common_args(os.path.join(tmp, "loss")), **options)
    trainer = trainer_cls(model=model_path, reward_funcs=base.reward_dummy, args=args,
                          train_dataset=base.dummy_dataset(), processing_class=tok)
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    assert trainer.max_completion_length == T and trainer.args.steps_per_generation == 1
    assert trainer.off_policy_mask_threshold is None and not trainer.use_vllm
    mask, num_items = trunc if options.get("mask_truncated_completions") else (x["mask"], int(x["mask"].sum()))
    results = {}
    for dname, dt in [("float64", torch.float64), ("float32", torch.float32)]:
        loss, metrics, grad_new, grad_ent = run_loss(trainer, x, mask, num_items, dt, options.get("beta", 0.0) != 0)
        results[dname] = {"loss": loss, "metrics": metrics, "grad_logps": grad_new, "grad_entropies": grad_ent}
    case = {
        "name": name,
        "trainer": f"{trainer_cls.__module__}.{trainer_cls.__name__}",
        # the options as a GRPOConfig (GMPOConfig) user writes them, with the defaults TRL used
        "config": {"loss_type": trainer.loss_type if trainer_cls is not GMPOTrainer else "gmpo",
                   "importance_sampling_level": trainer.importance_sampling_level,
                   "epsilon": trainer.args.epsilon, "epsilon_high": trainer.args.epsilon_high,
                   "epsilon_low_used": trainer.epsilon_low, "epsilon_high_used": trainer.epsilon_high,
                   "delta": trainer.args.delta, "beta": trainer.beta,
                   "use_bias_correction_kl": trainer.args.use_bias_correction_kl,
                   "top_entropy_quantile": trainer.top_entropy_quantile,
                   "mask_truncated_completions": trainer.mask_truncated_completions,
                   "entropy_coef": trainer.entropy_coef,
                   "sapo_temperature_pos": trainer.args.sapo_temperature_pos,
                   "sapo_temperature_neg": trainer.args.sapo_temperature_neg,
                   "vespo_k_pos": trainer.args.vespo_k_pos, "vespo_lambda_pos": trainer.args.vespo_lambda_pos,
                   "vespo_k_neg": trainer.args.vespo_k_neg, "vespo_lambda_neg": trainer.args.vespo_lambda_neg,
                   "max_completion_length": trainer.max_completion_length, "num_generations": G},
        "options_set": options,
        "completion_mask_used": tolist(mask),
        "num_items_in_batch": num_items,
        "outputs": results["float64"],
        "outputs_float32": results["float32"],
    }
    del trainer
    return case


def objective_cases(model_path, tok, tmp, x, trunc):
    cases = []
    for loss_type in LOSS_TYPES:
        for level in LEVELS.get(loss_type, ["token", "sequence"]):
            for vname, options in variants(loss_type):
                cases.append(loss_case(f"{loss_type}_{level}_{vname}", trl.GRPOTrainer, trl.GRPOConfig,
                                       {"loss_type": loss_type, "importance_sampling_level": level, **options},
                                       model_path, tok, tmp, x, trunc))
    for vname, options in GMPO_VARIANTS:
        cases.append(loss_case(f"gmpo_token_{vname}", GMPOTrainer, GMPOConfig, options, model_path, tok, tmp, x,
                               trunc))
    return cases


def reward_a(completions, **kwargs):  # never called: _calculate_rewards is patched
    return [0.0 for _ in completions]


def reward_b(completions, **kwargs):  # never called: _calculate_rewards is patched
    return [0.0 for _ in completions]


def multi_objective_cases(model_path, tok, tmp, rng):
    prompt_ids, completion_ids, comp_lens = base.make_rollout_ids(rng)
    rewards = f32(np.stack([rng.normal(size=N), rng.integers(0, 2, size=N).astype(float)], axis=1))
    rewards[5, 1] = np.nan      # reward_b does not apply to row 5
    rewards[9, 0] = np.nan      # reward_a does not apply to row 9
    rewards[4:8, 1] = 1.0       # group 1: reward_b all equal where it applies
    cases = []
    for aggregation in ["sum_then_normalize", "normalize_then_sum"]:
        for weights in [None, [0.7, 2.0]]:
            args = trl.GRPOConfig(**base.common_args(os.path.join(tmp, "multi")), beta=0.0,
                                  multi_objective_aggregation=aggregation, reward_weights=weights)
            trainer = trl.GRPOTrainer(model=model_path, reward_funcs=[reward_a, reward_b], args=args,
                                      train_dataset=base.dummy_dataset(), processing_class=tok)
            outs = {}
            for dname, dt in [("float64", torch.float64), ("float32", torch.float32)]:
                given = torch.tensor(rewards, dtype=dt)
                patcher = base.Patcher(trainer, prompt_ids, completion_ids, given[:, 0], grpo=True)
                trainer._calculate_rewards = lambda *a, _r=given: _r.clone()
                trainer.model.train()
                inputs = [{"prompt": f"t{3 + i // G} t{4 + i // G}"} for i in range(N)]
                out = trainer._generate_and_score_completions(inputs)
                assert patcher.calls.get("_generate_single_turn") == 1
                outs[dname] = tolist(out["advantages"])
            cases.append({"name": f"multi_{aggregation}_w{'none' if weights is None else 'set'}",
                          "config": {"multi_objective_aggregation": aggregation, "scale_rewards": trainer.scale_rewards,
                                     "reward_weights": tolist(trainer.reward_weights), "num_generations": G},
                          "inputs": {"rewards_per_func": tolist(rewards),
                                     "completion_mask": tolist(base.right_pad([[1] * n for n in comp_lens], T, 0))},
                          "outputs": {"advantages": outs["float64"]},
                          "outputs_float32": {"advantages": outs["float32"]}})
            del trainer
    return cases


def overlong_cases():
    cases = []
    for max_len, cache in [(6, 3), (6, 1), (20, 8)]:
        lengths = list(range(1, max_len + 3))
        fn = get_soft_overlong_punishment(max_completion_len=max_len, soft_punish_cache=cache)
        cases.append({"max_completion_len": max_len, "soft_punish_cache": cache, "lengths": lengths,
                      "rewards": fn([[7] * n for n in lengths])})
    return cases


def main():
    import tempfile

    rng = np.random.default_rng(SEED)
    with tempfile.TemporaryDirectory(prefix="trl_objectives_") as tmp:
        model_path, tok = base.build_model_dir(tmp)
        x = loss_inputs(rng)
        trunc = trl_truncation_mask(model_path, tok, tmp, x)
        objectives = objective_cases(model_path, tok, tmp, x, trunc)
        multi = multi_objective_cases(model_path, tok, tmp, rng)
    doc = {
        "header": {
            "generator": "tests/data/make_trl_objectives_reference.py",
            "command": ".venv-bench/bin/python tests/data/make_trl_objectives_reference.py  (from the repository root)",
            "trl_version": trl.__version__,
            "torch_version": torch.__version__,
            "transformers_version": transformers.__version__,
            "python_version": sys.version.split()[0],
            "import_stubs_for_missing_packages": base.STUBBED_MODULES,
            "seed": SEED, "N": N, "G": G, "T": T, "eos_id": EOS_ID, "pad_id": PAD_ID,
            "trl_functions_executed": {
                "objective_loss": ["trl.GRPOTrainer.__init__", "trl.GRPOTrainer._compute_loss",
                                   "trl.experimental.gmpo.GMPOTrainer._compute_loss", "torch.Tensor.backward"],
                "mask_truncated_completions": ["trl.GRPOTrainer._generate_and_score_completions"],
                "multi_objective": ["trl.GRPOTrainer._generate_and_score_completions"],
                "soft_overlong_punishment": ["trl.rewards.get_soft_overlong_punishment"],
            },
            "conventions": {
                "inputs": "prompt_ids left padded, completion masks right padded; padded log-prob / entropy slots "
                          "hold garbage; rows i // G form the groups",
                "gradients": "grad_logps / grad_entropies: d loss / d (the new per-token log-probs / entropies "
                             "_compute_loss received), padding slots included",
                "completion_mask_used": "the mask _compute_loss got: the lengths' mask, or TRL's own with "
                                        "mask_truncated_completions",
            },
            "diagnostics": diagnostics(x),
        },
        "inputs": {
            "prompt_ids": tolist(x["prompt_ids_arr"]), "prompt_mask": tolist(x["prompt_mask"]),
            "completion_ids": tolist(x["completion_ids_arr"]), "completion_mask": tolist(x["mask"]),
            "advantages": tolist(x["advantages"]), "per_token_logps": tolist(x["new"]),
            "old_per_token_logps": tolist(x["old"]), "ref_per_token_logps": tolist(x["ref"]),
            "entropies": tolist(x["entropies"]),
        },
        "objective_loss": objectives,
        "multi_objective": multi,
        "soft_overlong_punishment": overlong_cases(),
    }
    for c in objectives:
        assert math.isfinite(c["outputs"]["loss"]), c["name"]
        assert abs(c["outputs"]["loss"] - c["outputs_float32"]["loss"]) < 1e-5, c["name"]
    with open(OUT_PATH, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
    print(f"wrote {OUT_PATH}: {len(objectives)} objective cases, {len(multi)} multi-objective cases")


if __name__ == "__main__":
    main()
