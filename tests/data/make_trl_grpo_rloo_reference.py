"""Generate reference numbers for GRPO / RLOO advantages and the GRPO loss with TRL's OWN code.

Run once (CPU only, a few seconds, no network / hub access) with the benchmark venv that has TRL 1.12.0:

    .venv-bench/bin/python tests/data/make_trl_grpo_rloo_reference.py  (from the repository root)

It writes ``tests/data/trl_grpo_rloo_reference.json`` next to this file.

What is executed
----------------
A real ``trl.GRPOTrainer`` / ``trl.RLOOTrainer`` is instantiated on a tiny random Llama model (saved to a temp
dir so that TRL can build its reference model from the path when ``beta > 0``) with a tiny local word-level
tokenizer, a dummy dataset and a dummy reward function.  Then TRL's own methods are driven on crafted inputs:

* GRPO advantages: ``GRPOTrainer._generate_and_score_completions(inputs)`` (which itself runs the real
  ``GRPOTrainer._generate``, padding, masking, reward normalisation ...).  Patched (instance attributes, so
  only on that trainer object):
    - ``_tokenize_prompts``      -> returns our fixed prompt token ids (variable lengths);
    - ``_generate_single_turn``  -> returns our fixed completion token ids (variable lengths), logprobs=None;
    - ``_calculate_rewards``     -> returns our fixed rewards as ``rewards_per_func`` of shape [N, 1];
    - ``_get_per_token_logps_and_entropies`` -> fixed tensor (it is not called for these configs:
      beta=0 and gradient_accumulation_steps % steps_per_generation == 0, i.e. no old/ref log-probs).
  ``advantages`` is read from the returned dict.
* RLOO advantages: ``RLOOTrainer._generate_and_score_completions(inputs)`` (runs the real ``RLOOTrainer._generate``)
  with the same ``_tokenize_prompts`` / ``_generate_single_turn`` / ``_calculate_rewards`` patches and
  ``_get_per_token_logps_and_entropies`` patched to return our fixed per-token OLD log-probs when called with the
  policy and our fixed per-token REF log-probs when called with ``trainer.ref_model``.
  The completion mask is built by TRL from the completion-id list lengths (right padding).
* GRPO loss: ``GRPOTrainer._compute_loss(model, inputs)`` with ``_get_per_token_logps_and_entropies`` patched to
  return our fixed NEW per-token log-probs and entropies; ``inputs`` holds fixed ``prompt_ids``, ``prompt_mask``,
  ``completion_ids``, ``completion_mask``, ``advantages``, ``old_per_token_logps`` (and ``ref_per_token_logps``
  when beta > 0).  ``current_gradient_accumulation_steps`` is set to 1 and the model is in train mode, so the
  gradient-accumulation normaliser is 1.

Cases (N = 12 rollouts = 3 groups of G = 4, completion width T = 6, right-padded completion masks):

* ``grpo_advantages`` (3): ``scale_rewards`` in {"group", "batch", "none"}; rewards ~ N(0, 1) except group 1
  whose 4 rewards are all equal (zero std);
* ``rloo_advantages`` (4): ``beta`` in {0.0, 0.05} x ``normalize_advantages`` in {False, True}; same kind of
  rewards, fixed old/ref per-token log-probs (garbage at padded positions);
* ``grpo_loss`` (36): ``loss_type`` in {"grpo", "bnpo", "dr_grpo"} x ``epsilon_high`` in {None (-> 0.2), 0.28}
  (``epsilon`` = 0.2) x ``delta`` in {None, 1.5} x (``beta``, ``use_bias_correction_kl``) in
  {(0.0, True), (0.04, True), (0.04, False)}; ``max_completion_length`` = T; log-ratio new-old ~ N(0, 0.3^2)
  so that low/high clipping and the delta clamp are active on some valid tokens (counts in ``diagnostics``).
  NOTE: TRL 1.12 defaults ``use_bias_correction_kl=True`` (the k3 KL term is multiplied by the unclipped ratio).

Every case is run twice: once with float64 tensors injected (TRL's arithmetic then runs in float64:
``outputs``) and once with float32 tensors (TRL's natural dtype: ``outputs_float32``).  All random inputs are
rounded to float32 first, so both runs see exactly the same input values (stored as float64 in the JSON).
"""

from __future__ import annotations

import json
import math
import os
import sys
import tempfile
import warnings

os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("WANDB_DISABLED", "true")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)
warnings.filterwarnings("ignore")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")


def _stub_missing_http_modules():
    """TRL 1.12's grpo/rloo trainer modules import ``trl.generation.vllm_client``, which does
    ``from requests.adapters import HTTPAdapter`` / ``from urllib3.util.retry import Retry`` at import time although
    neither is a declared TRL dependency (and .venv-bench, made by benchmarks/install.sh, has neither).  They are
    only used by the vLLM client, which is never used here (use_vllm=False), so when missing we register inert
    stand-ins instead of touching the venv.  Returns the names that were stubbed (recorded in the JSON header)."""
    import importlib.machinery
    import importlib.util
    import types

    stubbed = []

    def add(name, **attrs):
        mod = types.ModuleType(name)
        mod.__spec__ = importlib.machinery.ModuleSpec(name, None)
        mod.__dict__.update(attrs)
        sys.modules[name] = mod
        stubbed.append(name)
        return mod

    class _Unavailable:
        def __init__(self, *a, **k):
            raise RuntimeError("stub: the real package is not installed")

    if importlib.util.find_spec("requests") is None:
        req = add("requests", ConnectionError=ConnectionError, Session=_Unavailable)
        req.adapters = add("requests.adapters", HTTPAdapter=_Unavailable)
    if importlib.util.find_spec("urllib3") is None:
        u = add("urllib3")
        u.util = add("urllib3.util")
        u.util.retry = add("urllib3.util.retry", Retry=_Unavailable)
    return stubbed


STUBBED_MODULES = _stub_missing_http_modules()

import datasets  # noqa: E402
import transformers  # noqa: E402
import trl  # noqa: E402
from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast  # noqa: E402

transformers.utils.logging.set_verbosity_error()
transformers.utils.logging.disable_progress_bar()
datasets.disable_progress_bars()

HERE = os.path.dirname(os.path.abspath(__file__))
OUT_PATH = os.path.join(HERE, "trl_grpo_rloo_reference.json")

SEED = 20240611
G = 4  # num_generations
N = 12  # rollouts (3 groups of G)
T = 6  # completion width (= max_completion_length)
VOCAB = 64
PAD_ID, EOS_ID = 0, 1

TRL_GRPO_ADV_FN = "trl.GRPOTrainer._generate_and_score_completions (-> GRPOTrainer._generate)"
TRL_RLOO_ADV_FN = "trl.RLOOTrainer._generate_and_score_completions (-> RLOOTrainer._generate)"
TRL_GRPO_LOSS_FN = "trl.GRPOTrainer._compute_loss"


# ----------------------------------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------------------------------
def f32(x):
    """Round to float32 and come back to float64 (so float32 and float64 runs see identical values)."""
    return np.asarray(x, dtype=np.float32).astype(np.float64)


def tolist(x):
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu().numpy()
    x = np.asarray(x)
    if x.dtype.kind == "f":
        return x.astype(np.float64).tolist()
    return x.tolist()


def build_tokenizer():
    vocab = {"<pad>": PAD_ID, "<eos>": EOS_ID}
    for i in range(2, VOCAB):
        vocab[f"t{i}"] = i
    tk = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t2"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", eos_token="<eos>", unk_token="t2")


def build_model_dir(root):
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=32,
        pad_token_id=PAD_ID,
        eos_token_id=EOS_ID,
        bos_token_id=None,
    )
    model = LlamaForCausalLM(cfg)
    path = os.path.join(root, "tiny-llama")
    model.save_pretrained(path)
    tok = build_tokenizer()
    tok.save_pretrained(path)
    return path, tok


def reward_dummy(completions, **kwargs):  # never called: _calculate_rewards is patched
    return [0.0 for _ in completions]


def dummy_dataset():
    return datasets.Dataset.from_dict({"prompt": [f"t{3 + i} t{4 + i}" for i in range(N)]})


def common_args(out_dir):
    return dict(
        output_dir=out_dir,
        report_to="none",
        use_cpu=True,
        per_device_train_batch_size=N,
        gradient_accumulation_steps=1,
        num_generations=G,
        max_completion_length=T,
        logging_steps=1,
        save_strategy="no",
        bf16=False,
        fp16=False,
        seed=0,
    )


def make_rollout_ids(rng):
    """Fixed prompt ids (variable length, 2..4) and completion ids (variable length 1..T; some end in EOS)."""
    prompt_lens = rng.integers(2, 5, size=N)
    prompt_ids = [rng.integers(2, VOCAB, size=int(n)).tolist() for n in prompt_lens]
    comp_lens = np.array([6, 3, 5, 1, 6, 4, 2, 6, 5, 3, 6, 4])
    completion_ids = []
    for i, n in enumerate(comp_lens):
        ids = rng.integers(2, VOCAB, size=int(n)).tolist()
        if i % 3 != 0:  # rows 0, 3, 6, 9 are "truncated" (no EOS); the others terminate with EOS
            ids[-1] = EOS_ID
        completion_ids.append(ids)
    return prompt_ids, completion_ids, comp_lens


def right_pad(rows, width, value):
    return np.array([r + [value] * (width - len(r)) for r in rows])


def left_pad(rows, width, value):
    return np.array([[value] * (width - len(r)) + r for r in rows])


class Patcher:
    """Instance-level patches of the TRL methods that produce model outputs (generation, log-probs, rewards)."""

    def __init__(self, trainer, prompt_ids, completion_ids, rewards, old_logps=None, ref_logps=None, grpo=True):
        self.trainer = trainer
        self.calls = {}

        def count(name):
            self.calls[name] = self.calls.get(name, 0) + 1

        def _tokenize_prompts(prompts):
            count("_tokenize_prompts")
            assert len(prompts) == len(prompt_ids)
            return [list(p) for p in prompt_ids], None, {}

        def _generate_single_turn(p_ids, images, multimodal_fields, *a, **k):
            count("_generate_single_turn")
            assert [list(p) for p in p_ids] == [list(p) for p in prompt_ids]
            c = [list(x) for x in completion_ids]
            return (c, None) if grpo else c  # GRPO returns (completion_ids, logprobs); RLOO only completion_ids

        def _calculate_rewards(inputs, prompts, completions, completion_ids_list):
            count("_calculate_rewards")
            assert [list(x) for x in completion_ids_list] == [list(x) for x in completion_ids]
            return rewards.clone().reshape(-1, 1)

        def _get_per_token_logps_and_entropies(model, input_ids, attention_mask, logits_to_keep, *a, **k):
            count("_get_per_token_logps_and_entropies")
            assert logits_to_keep == T and input_ids.shape[0] == N
            if model is trainer.ref_model and trainer.ref_model is not None:
                assert ref_logps is not None
                return ref_logps.clone(), None, None
            assert old_logps is not None, "old log-probs requested unexpectedly"
            return old_logps.clone(), None, None

        trainer._tokenize_prompts = _tokenize_prompts
        trainer._generate_single_turn = _generate_single_turn
        trainer._calculate_rewards = _calculate_rewards
        trainer._get_per_token_logps_and_entropies = _get_per_token_logps_and_entropies


def run_generate_and_score(trainer, prompt_ids, completion_ids, rewards, old_logps=None, ref_logps=None, grpo=True):
    p = Patcher(trainer, prompt_ids, completion_ids, rewards, old_logps, ref_logps, grpo=grpo)
    trainer.model.train()
    inputs = [{"prompt": f"t{3 + i // G} t{4 + i // G}"} for i in range(N)]  # G consecutive rollouts per prompt
    out = trainer._generate_and_score_completions(inputs)
    # sanity: TRL's own padding/masking reproduces what we store
    T_out = out["completion_ids"].shape[1]
    assert T_out == T, T_out
    return out, p.calls


# ----------------------------------------------------------------------------------------------------------------
# cases
# ----------------------------------------------------------------------------------------------------------------
def grpo_advantage_cases(model_path, tok, rng, tmp):
    prompt_ids, completion_ids, comp_lens = make_rollout_ids(rng)
    rewards = f32(rng.normal(size=N))
    rewards[G : 2 * G] = 0.75  # group 1: all-equal rewards (zero std)
    cases = []
    for scale in ["group", "batch", "none"]:
        args = trl.GRPOConfig(**common_args(os.path.join(tmp, f"grpo_adv_{scale}")), scale_rewards=scale, beta=0.0)
        trainer = trl.GRPOTrainer(
            model=model_path,
            reward_funcs=reward_dummy,
            args=args,
            train_dataset=dummy_dataset(),
            processing_class=tok,
        )
        outs, calls_all = {}, {}
        for name, dt in [("float64", torch.float64), ("float32", torch.float32)]:
            out, calls = run_generate_and_score(
                trainer, prompt_ids, completion_ids, torch.tensor(rewards, dtype=dt), grpo=True
            )
            assert out["advantages"].dtype == dt, out["advantages"].dtype
            assert out.get("old_per_token_logps") is None and out.get("ref_per_token_logps") is None
            assert torch.equal(out["completion_mask"], torch.tensor(right_pad([[1] * n for n in comp_lens], T, 0)))
            outs[name] = out
            calls_all[name] = calls
        cases.append(
            {
                "name": f"grpo_adv_scale_{scale}",
                "config": {
                    "num_generations": G,
                    "scale_rewards": scale,
                    "multi_objective_aggregation": trainer.multi_objective_aggregation,
                    "beta": 0.0,
                    "reward_weights": tolist(trainer.reward_weights),
                },
                "inputs": {
                    "rewards": tolist(rewards),
                    "prompt_ids": tolist(outs["float64"]["prompt_ids"]),
                    "prompt_mask": tolist(outs["float64"]["prompt_mask"]),
                    "completion_ids": tolist(outs["float64"]["completion_ids"]),
                    "completion_mask": tolist(outs["float64"]["completion_mask"]),
                },
                "outputs": {"advantages": tolist(outs["float64"]["advantages"])},
                "outputs_float32": {"advantages": tolist(outs["float32"]["advantages"])},
                "trl_calls_to_patched_methods": calls_all["float64"],
            }
        )
        del trainer
    return cases


def rloo_advantage_cases(model_path, tok, rng, tmp):
    prompt_ids, completion_ids, comp_lens = make_rollout_ids(rng)
    rewards = f32(rng.normal(size=N))
    rewards[G : 2 * G] = 0.75  # group 1: all-equal rewards
    mask = right_pad([[1] * n for n in comp_lens], T, 0).astype(np.float64)
    old = f32(-rng.uniform(0.05, 3.0, size=(N, T)))
    ref = f32(old + rng.normal(scale=0.5, size=(N, T)))
    # padded positions carry garbage: TRL must mask them out of the KL sum
    old = np.where(mask > 0, old, f32(-rng.uniform(5.0, 9.0, size=(N, T))))
    ref = np.where(mask > 0, ref, f32(-rng.uniform(5.0, 9.0, size=(N, T))))
    cases = []
    for beta in [0.0, 0.05]:
        for norm in [False, True]:
            args = trl.RLOOConfig(
                **common_args(os.path.join(tmp, f"rloo_{beta}_{norm}")), beta=beta, normalize_advantages=norm
            )
            trainer = trl.RLOOTrainer(
                model=model_path,
                reward_funcs=reward_dummy,
                args=args,
                train_dataset=dummy_dataset(),
                processing_class=tok,
            )
            assert (trainer.ref_model is not None) == (beta != 0.0)
            outs, calls_all = {}, {}
            for name, dt in [("float64", torch.float64), ("float32", torch.float32)]:
                out, calls = run_generate_and_score(
                    trainer,
                    prompt_ids,
                    completion_ids,
                    torch.tensor(rewards, dtype=dt),
                    old_logps=torch.tensor(old, dtype=dt),
                    ref_logps=torch.tensor(ref, dtype=dt),
                    grpo=False,
                )
                assert out["advantages"].dtype == dt
                assert torch.equal(out["completion_mask"], torch.tensor(mask, dtype=torch.long))
                assert calls["_get_per_token_logps_and_entropies"] == (2 if beta else 1)
                outs[name] = out
                calls_all[name] = calls
            cases.append(
                {
                    "name": f"rloo_adv_beta{beta}_norm{int(norm)}",
                    "config": {
                        "num_generations": G,
                        "beta": beta,
                        "normalize_advantages": norm,
                        "reward_clip_range": trainer.reward_clip_range,
                        "reward_weights": tolist(trainer.reward_weights),
                    },
                    "inputs": {
                        "rewards": tolist(rewards),
                        "old_per_token_logps": tolist(old),
                        "ref_per_token_logps": tolist(ref),
                        "prompt_ids": tolist(outs["float64"]["prompt_ids"]),
                        "prompt_mask": tolist(outs["float64"]["prompt_mask"]),
                        "completion_ids": tolist(outs["float64"]["completion_ids"]),
                        "completion_mask": tolist(outs["float64"]["completion_mask"]),
                    },
                    "outputs": {
                        "advantages": tolist(outs["float64"]["advantages"]),
                        "old_logps": tolist(outs["float64"]["old_logps"]),  # TRL's (old * mask).sum(1)
                    },
                    "outputs_float32": {
                        "advantages": tolist(outs["float32"]["advantages"]),
                        "old_logps": tolist(outs["float32"]["old_logps"]),
                    },
                    "trl_calls_to_patched_methods": calls_all["float64"],
                }
            )
            del trainer
    return cases


def grpo_loss_cases(model_path, tok, rng, tmp):
    prompt_ids, completion_ids, comp_lens = make_rollout_ids(rng)
    P = max(len(p) for p in prompt_ids)
    prompt_ids_arr = left_pad(prompt_ids, P, PAD_ID)
    prompt_mask = left_pad([[1] * len(p) for p in prompt_ids], P, 0)
    completion_ids_arr = right_pad(completion_ids, T, PAD_ID)
    mask = right_pad([[1] * n for n in comp_lens], T, 0)
    old = f32(-rng.uniform(0.05, 3.0, size=(N, T)))
    new = f32(old + rng.normal(scale=0.3, size=(N, T)))
    ref = f32(new + rng.normal(scale=0.3, size=(N, T)))
    entropies = f32(rng.uniform(0.5, 3.0, size=(N, T)))
    advantages = f32(rng.normal(size=N))
    # padded positions carry (finite) garbage: TRL must mask them out
    for arr in (old, new, ref):
        arr[mask == 0] = f32(-rng.uniform(4.0, 8.0, size=int((mask == 0).sum())))

    # diagnostics (numpy) so that we know clipping / delta are exercised on valid tokens
    ratio = np.exp(new - old)
    m = mask > 0
    A = np.broadcast_to(advantages[:, None], (N, T))
    diag = {
        "n_valid_tokens": int(m.sum()),
        "n_ratio_gt_1.2_and_A_pos": int((m & (ratio > 1.2) & (A > 0)).sum()),
        "n_ratio_gt_1.28_and_A_pos": int((m & (ratio > 1.28) & (A > 0)).sum()),
        "n_ratio_lt_0.8_and_A_neg": int((m & (ratio < 0.8) & (A < 0)).sum()),
        "n_ratio_gt_1.5_and_A_neg": int((m & (ratio > 1.5) & (A < 0)).sum()),
    }
    assert all(v > 0 for v in diag.values()), diag

    cases = []
    for loss_type in ["grpo", "bnpo", "dr_grpo"]:
        for eps_high in [None, 0.28]:
            for delta in [None, 1.5]:
                for beta, bias_kl in [(0.0, True), (0.04, True), (0.04, False)]:
                    args = trl.GRPOConfig(
                        **common_args(os.path.join(tmp, "grpo_loss")),
                        loss_type=loss_type,
                        epsilon=0.2,
                        epsilon_high=eps_high,
                        delta=delta,
                        beta=beta,
                        use_bias_correction_kl=bias_kl,
                    )
                    trainer = trl.GRPOTrainer(
                        model=model_path,
                        reward_funcs=reward_dummy,
                        args=args,
                        train_dataset=dummy_dataset(),
                        processing_class=tok,
                    )
                    trainer.model.train()
                    trainer.current_gradient_accumulation_steps = 1
                    assert trainer.max_completion_length == T
                    assert not trainer._entropy_bonus_enabled and trainer.top_entropy_quantile == 1.0
                    assert trainer.off_policy_mask_threshold is None and not trainer.use_vllm
                    assert trainer.importance_sampling_level == "token"
                    res, res_metrics, calls = {}, {}, {}
                    for name, dt in [("float64", torch.float64), ("float32", torch.float32)]:
                        new_t = torch.tensor(new, dtype=dt)
                        ent_t = torch.tensor(entropies, dtype=dt)
                        ncalls = {"n": 0}

                        def patched(model, input_ids, attention_mask, logits_to_keep, *a, _n=new_t, _e=ent_t, **k):
                            ncalls["n"] += 1
                            assert logits_to_keep == T and input_ids.shape == (N, P + T)
                            return _n.clone(), _e.clone(), None

                        trainer._get_per_token_logps_and_entropies = patched
                        inputs = {
                            "prompt_ids": torch.tensor(prompt_ids_arr),
                            "prompt_mask": torch.tensor(prompt_mask),
                            "completion_ids": torch.tensor(completion_ids_arr),
                            "completion_mask": torch.tensor(mask),
                            "advantages": torch.tensor(advantages, dtype=dt),
                            "old_per_token_logps": torch.tensor(old, dtype=dt),
                            "num_items_in_batch": torch.tensor(mask.sum()),
                        }
                        if beta != 0.0:
                            inputs["ref_per_token_logps"] = torch.tensor(ref, dtype=dt)
                        for mode in trainer._metrics:
                            trainer._metrics[mode].clear()
                        loss = trainer._compute_loss(trainer.model, inputs)
                        assert loss.dtype == dt and loss.ndim == 0
                        res[name] = float(loss)
                        res_metrics[name] = {k: v[-1] for k, v in trainer._metrics["train"].items()}
                        calls[name] = ncalls["n"]
                    cases.append(
                        {
                            "name": f"grpo_loss_{loss_type}_eh{eps_high}_delta{delta}_beta{beta}"
                            + ("" if (beta == 0.0 or bias_kl) else "_nobiascorr"),
                            "config": {
                                "loss_type": loss_type,
                                "epsilon": 0.2,
                                "epsilon_high_arg": eps_high,
                                "epsilon_low_used": trainer.epsilon_low,
                                "epsilon_high_used": trainer.epsilon_high,
                                "delta": delta,
                                "beta": beta,
                                "max_completion_length": trainer.max_completion_length,
                                "importance_sampling_level": trainer.importance_sampling_level,
                                "use_bias_correction_kl": trainer.args.use_bias_correction_kl,
                                "current_gradient_accumulation_steps": trainer.current_gradient_accumulation_steps,
                            },
                            "inputs": {
                                "prompt_ids": tolist(prompt_ids_arr),
                                "prompt_mask": tolist(prompt_mask),
                                "completion_ids": tolist(completion_ids_arr),
                                "completion_mask": tolist(mask),
                                "advantages": tolist(advantages),
                                "per_token_logps": tolist(new),
                                "entropies": tolist(entropies),
                                "old_per_token_logps": tolist(old),
                                "ref_per_token_logps": tolist(ref) if beta != 0.0 else None,
                            },
                            "outputs": {"loss": res["float64"], "metrics": res_metrics["float64"]},
                            "outputs_float32": {"loss": res["float32"], "metrics": res_metrics["float32"]},
                            "trl_calls_to_patched_methods": {"_get_per_token_logps_and_entropies": calls["float64"]},
                            "diagnostics": diag,
                        }
                    )
                    del trainer
    return cases


def main():
    rng = np.random.default_rng(SEED)
    with tempfile.TemporaryDirectory(prefix="trl_ref_") as tmp:
        model_path, tok = build_model_dir(tmp)
        grpo_adv = grpo_advantage_cases(model_path, tok, rng, tmp)
        rloo_adv = rloo_advantage_cases(model_path, tok, rng, tmp)
        grpo_loss = grpo_loss_cases(model_path, tok, rng, tmp)

    doc = {
        "header": {
            "generator": "tests/data/make_trl_grpo_rloo_reference.py",
            "command": ".venv-bench/bin/python tests/data/make_trl_grpo_rloo_reference.py  (from the repository root)",
            "trl_version": trl.__version__,
            "torch_version": torch.__version__,
            "transformers_version": transformers.__version__,
            "python_version": sys.version.split()[0],
            "import_stubs_for_missing_packages": STUBBED_MODULES,
            "seed": SEED,
            "N": N,
            "G": G,
            "T": T,
            "trl_functions_executed": {
                "grpo_advantages": [
                    "trl.GRPOTrainer.__init__ (tiny random LlamaForCausalLM from a local dir, local tokenizer)",
                    TRL_GRPO_ADV_FN,
                    "trl.trainer.utils.nanstd (via the above)",
                ],
                "rloo_advantages": [
                    "trl.RLOOTrainer.__init__ (ref model built by TRL from the local dir when beta > 0)",
                    TRL_RLOO_ADV_FN,
                    "trl.trainer.utils.nanstd (via the above)",
                ],
                "grpo_loss": [
                    "trl.GRPOTrainer.__init__",
                    TRL_GRPO_LOSS_FN,
                ],
            },
            "patched_methods (instance attributes on the trainer)": {
                "grpo_advantages": {
                    "_tokenize_prompts": "returns fixed prompt ids",
                    "_generate_single_turn": "returns (fixed completion ids, None)",
                    "_calculate_rewards": "returns inputs.rewards as rewards_per_func [N, 1]",
                    "_get_per_token_logps_and_entropies": "patched but never called (beta=0, no old logps)",
                },
                "rloo_advantages": {
                    "_tokenize_prompts": "returns fixed prompt ids",
                    "_generate_single_turn": "returns fixed completion ids",
                    "_calculate_rewards": "returns inputs.rewards as rewards_per_func [N, 1]",
                    "_get_per_token_logps_and_entropies": (
                        "returns inputs.old_per_token_logps for the policy, inputs.ref_per_token_logps for "
                        "trainer.ref_model (entropies None)"
                    ),
                },
                "grpo_loss": {
                    "_get_per_token_logps_and_entropies": (
                        "returns (inputs.per_token_logps, inputs.entropies, None); "
                        "trainer.current_gradient_accumulation_steps = 1; model.train()"
                    ),
                },
            },
            "dtypes": (
                "'outputs': TRL run with float64 tensors injected (rewards / log-probs / advantages), so TRL's "
                "arithmetic ran in float64; 'outputs_float32': same inputs as float32 tensors. All float inputs "
                "are exactly float32-representable."
            ),
            "conventions": {
                "grouping": "rollout i belongs to group i // G (G consecutive rollouts per prompt)",
                "completion_mask": "right padded: 1 for the first len_i tokens, 0 after; padded positions of "
                "the log-prob inputs hold finite garbage that must be masked out",
                "prompt": "left padded with pad id 0",
                "grpo_std": "trl.trainer.utils.nanstd: unbiased (Bessel, /(n-1)), NaN-ignoring; adv = "
                "(r - group_mean) / (std + 1e-4) ('group': per-group std; 'batch': std over the whole batch "
                "of N, mean still per group; 'none': no division)",
                "rloo": "reward -= beta * sum_t mask*(old - ref) (k1, before the baseline); adv = r - "
                "mean of the other G-1 rewards of the group; if normalize_advantages: (adv - mean(adv)) / "
                "(unbiased std(adv) + 1e-4) over the whole batch",
                "grpo_loss": "ratio = exp(new - old); coef_2 = clamp(ratio, 1-eps_low, 1+eps_high); "
                "if delta: coef_1 = min(ratio, delta); per_token = -min(coef_1*A, coef_2*A) + beta*(exp(ref-new) "
                "- (ref-new) - 1) * (ratio if use_bias_correction_kl (TRL default True; the UNclipped, un-delta'd "
                "ratio) else 1); grpo: mean_i(sum_t m*l / max(sum_t m, 1)); bnpo: sum m*l / max(sum m, 1); "
                "dr_grpo: sum m*l / (N * max_completion_length)",
            },
        },
        "grpo_advantages": grpo_adv,
        "rloo_advantages": rloo_adv,
        "grpo_loss": grpo_loss,
    }

    # Sanity: everything finite, float32 and float64 runs agree.
    for sec in ("grpo_advantages", "rloo_advantages"):
        for c in doc[sec]:
            a64, a32 = np.array(c["outputs"]["advantages"]), np.array(c["outputs_float32"]["advantages"])
            assert np.all(np.isfinite(a64)), c["name"]
            assert np.allclose(a64, a32, rtol=1e-4, atol=1e-4), (c["name"], a64, a32)
    for c in doc["grpo_loss"]:
        assert math.isfinite(c["outputs"]["loss"]), c["name"]
        assert abs(c["outputs"]["loss"] - c["outputs_float32"]["loss"]) < 1e-5, c["name"]

    with open(OUT_PATH, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
    print(f"wrote {OUT_PATH}: {len(grpo_adv)} GRPO adv, {len(rloo_adv)} RLOO adv, {len(grpo_loss)} GRPO loss cases")


if __name__ == "__main__":
    main()
