"""Generate reference numbers for the off-policy corrections with TRL 1.12's OWN code.

Run once (CPU only, under a minute, no network / hub access) with the benchmark venv that has TRL 1.12.0:

    .venv-bench/bin/python tests/data/make_trl_offpolicy_reference.py  (from the repository root)

It writes ``tests/data/trl_offpolicy_reference.json`` next to this file. It reuses the tiny model, tokenizer,
dataset and patching helpers of ``make_trl_grpo_rloo_reference.py`` (same directory).

What is executed
----------------
* ``importance_sampling`` cases: a real ``trl.GRPOTrainer`` per configuration with
  ``vllm_importance_sampling_correction=True``, ``vllm_importance_sampling_mode`` in TRL's four modes x bounds
  (``vllm_importance_sampling_clip_max`` / ``_clip_min``: TRL's default 3.0 / None, 2.0 / 0.5, None / 0.5), then
  ``GRPOTrainer._generate_and_score_completions``. The trainer is built without vLLM (none is installed) and its
  ``use_vllm`` set to True afterwards, which is all that method reads of vLLM; ``_generate_single_turn`` is
  patched to return our fixed completion ids with our fixed SAMPLING log-probs (what vLLM would return), and
  ``_get_per_token_logps_and_entropies`` to return our fixed OLD (proximal) log-probs, so that TRL computes the
  importance sampling ratio and logs its ``sampling/*`` metrics with its own code. Two of them again with
  ``mask_truncated_completions`` (TRL's mask: the weights of the emptied rows).
* ``loss`` cases: ``GRPOTrainer._compute_loss(model, inputs)`` with ``inputs`` holding the fixed old and sampling
  log-probs, the importance sampling ratio TRL computed above and fixed advantages, and
  ``_get_per_token_logps_and_entropies`` patched to return our fixed NEW log-probs and entropies as leaf tensors
  that require grad; after ``loss.backward()`` their ``.grad`` are the gradients recorded
  (``current_gradient_accumulation_steps`` = 1, model in train mode). Configurations: loss_type grpo and dapo x
  the four modes; vespo x the two token modes; ``off_policy_mask_threshold`` without vLLM (TRL then reads the old
  log-probs as the sampling ones), with ``token_truncate`` and with ``sequence_mask`` and ``beta``; grpo with
  ``beta`` (the KL term is not weighted).

Inputs (N = 12 rollouts = 3 groups of G = 4, completion width T = 6, right-padded masks; rows 0, 3, 6, 9 end
without EOS): log(old / sampling) ~ N(0, 0.6^2) with a few tokens set to +-1.3 so that every bound is crossed by
some tokens and sequences (counts in ``diagnostics``); log(new / old) ~ N(0, 0.3^2). Padded positions hold finite
garbage that must be masked out. Every case runs in float64 (``outputs``) and float32 (``outputs_float32``) on the
same float32-representable inputs.
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

OUT_PATH = os.path.join(HERE, "trl_offpolicy_reference.json")
SEED = 20260402
N, G, T, EOS_ID, PAD_ID = base.N, base.G, base.T, base.EOS_ID, base.PAD_ID
f32, tolist = base.f32, base.tolist

MODES = ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"]
BOUNDS = {"default": {}, "both": {"vllm_importance_sampling_clip_max": 2.0, "vllm_importance_sampling_clip_min": 0.5},
          "minonly": {"vllm_importance_sampling_clip_max": None, "vllm_importance_sampling_clip_min": 0.5}}
DTYPES = [("float64", torch.float64), ("float32", torch.float32)]


def make_inputs(rng):
    """The fixed rollout (float32-representable float64 arrays)."""
    prompt_ids, completion_ids, comp_lens = base.make_rollout_ids(rng)
    P = max(len(p) for p in prompt_ids)
    mask = base.right_pad([[1] * n for n in comp_lens], T, 0)
    sampling = f32(-rng.uniform(0.05, 3.0, size=(N, T)))
    drift = rng.normal(scale=0.6, size=(N, T))
    drift[1, 1], drift[4, 2], drift[7, 0], drift[10, 3] = 1.3, -1.3, 1.3, -1.3  # past every bound
    old = f32(sampling + drift)
    new = f32(old + rng.normal(scale=0.3, size=(N, T)))
    ref = f32(new + rng.normal(scale=0.3, size=(N, T)))
    entropies = f32(rng.uniform(0.5, 3.0, size=(N, T)))
    advantages = f32(rng.normal(size=N))
    for arr in (sampling, old, new, ref):
        arr[mask == 0] = f32(-rng.uniform(4.0, 8.0, size=int((mask == 0).sum())))
    entropies[mask == 0] = f32(rng.uniform(4.0, 8.0, size=int((mask == 0).sum())))
    return dict(prompt_ids=prompt_ids, completion_ids=completion_ids, comp_lens=comp_lens, P=P,
                prompt_ids_arr=base.left_pad(prompt_ids, P, PAD_ID),
                prompt_mask=base.left_pad([[1] * len(p) for p in prompt_ids], P, 0),
                completion_ids_arr=base.right_pad(completion_ids, T, PAD_ID), mask=mask, sampling=sampling, old=old,
                new=new, ref=ref, entropies=entropies, advantages=advantages)


def diagnostics(x):
    m = x["mask"] > 0
    token = np.exp(x["old"] - x["sampling"])
    sequence = np.exp(((x["old"] - x["sampling"]) * m).sum(1))
    behaviour_kl = ((x["sampling"] - x["new"]) * m).sum(1) / m.sum(1)
    out = {
        "n_valid_tokens": int(m.sum()),
        "n_token_ratio_gt_3": int((m & (token > 3.0)).sum()),
        "n_token_ratio_gt_2": int((m & (token > 2.0)).sum()),
        "n_token_ratio_lt_0.5": int((m & (token < 0.5)).sum()),
        "n_sequence_ratio_gt_3": int((sequence > 3.0).sum()),
        "n_sequence_ratio_gt_2": int((sequence > 2.0).sum()),
        "n_sequence_ratio_lt_0.5": int((sequence < 0.5).sum()),
        "n_sequences_kl_gt_0.1_and_A_neg": int(((behaviour_kl > 0.1) & (x["advantages"] < 0)).sum()),
        "n_sequences_kl_le_0.1_and_A_neg": int(((behaviour_kl <= 0.1) & (x["advantages"] < 0)).sum()),
    }
    assert all(v > 0 for v in out.values()), out
    return out


def grpo_trainer(tmp, name, options):
    args = trl.GRPOConfig(**base.common_args(os.path.join(tmp, name)), **options)
    trainer = trl.GRPOTrainer(model=MODEL[0], reward_funcs=base.reward_dummy, args=args,
                              train_dataset=base.dummy_dataset(), processing_class=MODEL[1])
    assert not trainer.use_vllm and trainer.max_completion_length == T
    return trainer


MODEL = []  # (model path, tokenizer), set by main


def run_importance_sampling(trainer, x, dt):
    """TRL's importance sampling ratio and sampling/* metrics from _generate_and_score_completions, in dtype dt."""
    trainer.use_vllm = True  # all _generate_and_score_completions reads of vLLM (generation is patched)
    sampling_lists = [list(map(float, x["sampling"][i, :n])) for i, n in enumerate(x["comp_lens"])]
    old_t = torch.tensor(x["old"], dtype=dt)
    patcher = base.Patcher(trainer, x["prompt_ids"], x["completion_ids"], torch.zeros(N, dtype=dt),
                           old_logps=old_t, grpo=True)

    def generate_with_logprobs(p_ids, images, multimodal_fields, *a, **k):
        patcher.calls["_generate_single_turn"] = patcher.calls.get("_generate_single_turn", 0) + 1
        return [list(c) for c in x["completion_ids"]], [list(s) for s in sampling_lists]

    trainer._generate_single_turn = generate_with_logprobs
    for mode in trainer._metrics:
        trainer._metrics[mode].clear()
    trainer.model.train()
    out = trainer._generate_and_score_completions([{"prompt": f"t{3 + i // G} t{4 + i // G}"} for i in range(N)])
    assert patcher.calls["_generate_single_turn"] == 1 and patcher.calls["_get_per_token_logps_and_entropies"] == 1
    assert out["completion_ids"].shape[1] == T
    metrics = {k: v[-1] for k, v in trainer._metrics["train"].items() if k.startswith("sampling/")}
    return out, metrics


def importance_sampling_cases(tmp, x):
    cases = []
    variants = [(mode, bname, False) for mode in MODES for bname in BOUNDS]
    variants += [("sequence_mask", "default", True), ("token_truncate", "both", True)]
    for mode, bname, masktrunc in variants:
        options = {"vllm_importance_sampling_correction": True, "vllm_importance_sampling_mode": mode,
                   **BOUNDS[bname], "beta": 0.0, "mask_truncated_completions": masktrunc}
        trainer = grpo_trainer(tmp, "is", options)
        results, mask = {}, None
        for dname, dt in DTYPES:
            out, metrics = run_importance_sampling(trainer, x, dt)
            ratio = out["importance_sampling_ratio"]
            assert ratio.dtype == dt or dname == "float64", ratio.dtype  # TRL's own arithmetic in dt
            results[dname] = {"importance_sampling_ratio": tolist(ratio), "metrics": metrics}
            mask = tolist(out["completion_mask"])
        cases.append({
            "name": f"{mode}_{bname}{'_masktrunc' if masktrunc else ''}",
            "config": {"vllm_importance_sampling_correction": True,
                       "vllm_importance_sampling_mode": trainer.vllm_importance_sampling_mode,
                       "vllm_importance_sampling_clip_max": trainer.vllm_importance_sampling_clip_max,
                       "vllm_importance_sampling_clip_min": trainer.vllm_importance_sampling_clip_min,
                       "mask_truncated_completions": masktrunc},
            "options_set": {k: v for k, v in options.items() if k != "beta"},
            "completion_mask_used": mask,
            "outputs": results["float64"],
            "outputs_float32": results["float32"],
        })
        del trainer
    return cases


def run_loss(trainer, x, is_ratio, dt, with_ref, with_sampling):
    new_t = torch.tensor(x["new"], dtype=dt, requires_grad=True)
    ent_t = torch.tensor(x["entropies"], dtype=dt, requires_grad=True)
    calls = {"n": 0}

    def patched(model, input_ids, attention_mask, logits_to_keep, *a, **k):
        calls["n"] += 1
        assert logits_to_keep == T and input_ids.shape == (N, x["P"] + T)
        return new_t.clone(), ent_t.clone(), None

    trainer._get_per_token_logps_and_entropies = patched
    inputs = {
        "prompt_ids": torch.tensor(x["prompt_ids_arr"]), "prompt_mask": torch.tensor(x["prompt_mask"]),
        "completion_ids": torch.tensor(x["completion_ids_arr"]), "completion_mask": torch.tensor(x["mask"]),
        "advantages": torch.tensor(x["advantages"], dtype=dt),
        "old_per_token_logps": torch.tensor(x["old"], dtype=dt),
        "num_items_in_batch": torch.tensor(int(x["mask"].sum())),
    }
    if with_sampling:
        inputs["sampling_per_token_logps"] = torch.tensor(x["sampling"], dtype=dt)
    if is_ratio is not None:
        inputs["importance_sampling_ratio"] = torch.tensor(np.asarray(is_ratio), dtype=dt)
    if with_ref:
        inputs["ref_per_token_logps"] = torch.tensor(x["ref"], dtype=dt)
    for mode in trainer._metrics:
        trainer._metrics[mode].clear()
    loss = trainer._compute_loss(trainer.model, inputs)
    assert loss.dtype == dt and loss.ndim == 0 and calls["n"] == 1
    loss.backward()
    grad_new = new_t.grad if new_t.grad is not None else torch.zeros_like(new_t)
    metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    return {"loss": float(loss), "metrics": metrics, "grad_logps": tolist(grad_new)}


def loss_cases(tmp, x, is_cases):
    ratios = {c["name"]: c for c in is_cases}
    variants = []
    for loss_type in ("grpo", "dapo"):
        variants += [(f"{loss_type}_{mode}", {"loss_type": loss_type}, f"{mode}_both") for mode in MODES]
    variants += [(f"vespo_{mode}", {"loss_type": "vespo"}, f"{mode}_both") for mode in ("token_truncate", "token_mask")]
    variants += [
        ("grpo_token_truncate_beta", {"loss_type": "grpo", "beta": 0.04}, "token_truncate_both"),
        ("grpo_opsm_novllm", {"loss_type": "grpo", "off_policy_mask_threshold": 0.1}, None),
        ("grpo_opsm_token_truncate", {"loss_type": "grpo", "off_policy_mask_threshold": 0.1}, "token_truncate_both"),
        ("dapo_opsm_sequence_mask_beta", {"loss_type": "dapo", "off_policy_mask_threshold": 0.1, "beta": 0.04},
         "sequence_mask_both"),
    ]
    cases = []
    for name, options, is_name in variants:
        vllm = is_name is not None
        config_options = dict(options)
        if vllm:
            config_options.update(ratios[is_name]["options_set"])
        config_options.setdefault("beta", 0.0)
        trainer = grpo_trainer(tmp, "loss", config_options)
        trainer.use_vllm = vllm  # _compute_loss applies the ratio only with vLLM
        trainer.model.train()
        trainer.current_gradient_accumulation_steps = 1
        results = {}
        for dname, dt in DTYPES:
            ratio = None if not vllm else ratios[is_name][f"outputs{'' if dname == 'float64' else '_float32'}"][
                "importance_sampling_ratio"]
            results[dname] = run_loss(trainer, x, ratio, dt, config_options["beta"] != 0.0, vllm)
        cases.append({
            "name": name,
            "importance_sampling_case": is_name,
            "config": {"loss_type": trainer.loss_type, "beta": trainer.beta,
                       "use_bias_correction_kl": trainer.args.use_bias_correction_kl,
                       "epsilon_low_used": trainer.epsilon_low, "epsilon_high_used": trainer.epsilon_high,
                       "off_policy_mask_threshold": trainer.off_policy_mask_threshold, "use_vllm": vllm,
                       "vllm_importance_sampling_correction": vllm and trainer.vllm_importance_sampling_correction,
                       "vllm_importance_sampling_mode": trainer.vllm_importance_sampling_mode if vllm else None},
            "options_set": config_options,
            "outputs": results["float64"],
            "outputs_float32": results["float32"],
        })
        del trainer
    return cases


def main():
    import tempfile

    rng = np.random.default_rng(SEED)
    with tempfile.TemporaryDirectory(prefix="trl_offpolicy_") as tmp:
        MODEL[:] = base.build_model_dir(tmp)
        x = make_inputs(rng)
        is_cases = importance_sampling_cases(tmp, x)
        losses = loss_cases(tmp, x, is_cases)
    doc = {
        "header": {
            "generator": "tests/data/make_trl_offpolicy_reference.py",
            "command": ".venv-bench/bin/python tests/data/make_trl_offpolicy_reference.py  (from the repository root)",
            "trl_version": trl.__version__,
            "torch_version": torch.__version__,
            "transformers_version": transformers.__version__,
            "python_version": sys.version.split()[0],
            "import_stubs_for_missing_packages": base.STUBBED_MODULES,
            "seed": SEED, "N": N, "G": G, "T": T, "eos_id": EOS_ID, "pad_id": PAD_ID,
            "trl_functions_executed": {
                "importance_sampling": ["trl.GRPOTrainer.__init__", "trl.GRPOTrainer._generate_and_score_completions"],
                "loss": ["trl.GRPOTrainer._compute_loss", "trl.GRPOTrainer.get_off_policy_mask",
                         "torch.Tensor.backward"],
            },
            "conventions": {
                "inputs": "sampling_per_token_logps: the behaviour policy's (vLLM's); old_per_token_logps: the "
                          "training forward's (proximal); per_token_logps: the current policy's; padded slots hold "
                          "garbage; rows i // G form the groups",
                "importance_sampling_ratio": "TRL's: [N, T] for the token modes, [N, 1] for the sequence modes",
                "gradients": "grad_logps: d loss / d (the new per-token log-probs _compute_loss received)",
            },
            "diagnostics": diagnostics(x),
        },
        "inputs": {
            "prompt_ids": tolist(x["prompt_ids_arr"]), "prompt_mask": tolist(x["prompt_mask"]),
            "completion_ids": tolist(x["completion_ids_arr"]), "completion_mask": tolist(x["mask"]),
            "advantages": tolist(x["advantages"]), "per_token_logps": tolist(x["new"]),
            "old_per_token_logps": tolist(x["old"]), "sampling_per_token_logps": tolist(x["sampling"]),
            "ref_per_token_logps": tolist(x["ref"]), "entropies": tolist(x["entropies"]),
        },
        "importance_sampling": is_cases,
        "loss": losses,
    }
    for c in losses:
        assert math.isfinite(c["outputs"]["loss"]), c["name"]
        assert abs(c["outputs"]["loss"] - c["outputs_float32"]["loss"]) < 1e-5, c["name"]
    with open(OUT_PATH, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
    print(f"wrote {OUT_PATH}: {len(is_cases)} importance sampling cases, {len(losses)} loss cases")


if __name__ == "__main__":
    main()
