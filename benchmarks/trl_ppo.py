"""TRL 1.12.0's PPO trainer (``trl.experimental.ppo``) on the benchmark's work, timed per phase.

Runs in the benchmark interpreter (``.venv-bench``: torch 2.13 CPU + trl 1.12.0), never in the library's:

    .venv-bench/bin/python -m benchmarks.trl_ppo --size tiny --threads 2 --json out.json
    .venv-bench/bin/python -m benchmarks.trl_ppo --size smollm2 --model-dir .cache/ppojax/<converted-dir>

Models: policy = ``LlamaForCausalLM``; reference = TRL's own frozen deep copy of it (``ref_model=None``);
reward and value = ``LlamaForSequenceClassification(num_labels=1)`` of the same shape (the backbone plus a
random score head; with ``--model-dir`` the backbone weights come from the checkpoint). All float32, eager
PyTorch (TRL's defaults: SDPA attention, AdamW, linear LR decay), no gradient checkpointing, no bf16.

Fixed-length responses: ``stop_token=None, stop_token_id=None`` makes TRL set the policy's
``generation_config.eos_token_id = None``, so generation always runs ``response_length`` tokens (checked).

Phases are timed without touching TRL's algorithm, by wrapping module-level functions the trainer calls:
``batch_generation`` (generation), ``forward`` (its first call on the policy+value wrapper marks the end of
the rollout and the start of the update) and an ``on_step_end`` callback (the end of an update).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

# Before torch is imported: thread count for OpenMP/MKL, no hub access, no telemetry.
_threads_arg = None
for _i, _a in enumerate(sys.argv):
    if _a == "--threads" and _i + 1 < len(sys.argv):
        _threads_arg = sys.argv[_i + 1]
    elif _a.startswith("--threads="):
        _threads_arg = _a.split("=", 1)[1]
if _threads_arg:
    os.environ["OMP_NUM_THREADS"] = _threads_arg
    os.environ["MKL_NUM_THREADS"] = _threads_arg
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("ACCELERATE_MIXED_PRECISION", "bf16" if "--bf16" in sys.argv else "no")

from benchmarks.common import Turns, make_config, peak_rss_mb, summarize  # noqa: E402
from ppojax.io.strict_json import write_json  # noqa: E402


def _tokenizer(vocab_size: int, pad_id: int, bos_id: int, eos_id: int):
    """A word-level tokenizer over ``vocab_size`` ids: TRL needs ``pad``/``eos`` ids and a collator; the
    benchmark feeds token ids directly, so real merges are not needed (and none are used for timing)."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast

    special = {pad_id: "<pad>", bos_id: "<bos>", eos_id: "<eos>"}
    vocab = {special.get(i, f"t{i}"): i for i in range(vocab_size)}
    tok = Tokenizer(WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>",
                                   eos_token="<eos>", unk_token="<pad>", padding_side="left")


def _models(config: dict):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification

    torch.manual_seed(config["seed"])
    if config.get("model_dir"):
        d = config["model_dir"]
        policy = LlamaForCausalLM.from_pretrained(d, dtype=torch.float32)
        kw = dict(dtype=torch.float32, num_labels=1)
        reward = LlamaForSequenceClassification.from_pretrained(d, **kw)
        value = LlamaForSequenceClassification.from_pretrained(d, **kw)
        for m in (policy, reward, value):
            m.config.pad_token_id = config["pad_token_id"]
    else:
        mc = LlamaConfig(**config["model"])
        policy = LlamaForCausalLM(mc)
        rc = LlamaConfig(**config["model"], num_labels=1)
        reward = LlamaForSequenceClassification(rc)
        value = LlamaForSequenceClassification(rc)
    for m in (policy, reward, value):
        m.to(torch.float32)
    return policy, reward, value


def run(config: dict, threads: int, device: str = "cpu", bf16: bool = False) -> dict:
    import torch

    torch.set_num_threads(threads)
    import transformers
    import trl
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl.experimental.ppo import PPOConfig, PPOTrainer
    from trl.experimental.ppo import ppo_trainer as ppo_mod

    transformers.logging.set_verbosity_error()
    t_setup = time.perf_counter()
    B, P, R, n = config["batch_size"], config["prompt_length"], config["response_length"], config["num_updates"]
    tokenizer = _tokenizer(config["model"]["vocab_size"], config["pad_token_id"], config["bos_token_id"],
                           config["eos_token_id"])
    policy, reward, value = _models(config)
    dataset = Dataset.from_dict({"input_ids": config["prompts"]})
    assert all(len(p) == P for p in config["prompts"])

    out_dir = tempfile.mkdtemp(prefix="trl-ppo-bench-")
    args = PPOConfig(
        output_dir=out_dir,
        per_device_train_batch_size=B,
        gradient_accumulation_steps=1,
        num_mini_batches=config["num_mini_batches"],
        num_ppo_epochs=config["num_ppo_epochs"],
        total_episodes=B * n,
        local_rollout_forward_batch_size=B,
        response_length=R,
        stop_token=None,
        stop_token_id=None,
        temperature=config["temperature"],
        learning_rate=config["learning_rate"],
        seed=config["seed"],
        num_sample_generations=0,
        bf16=bf16,  # autocast: float32 master weights, bfloat16 matmuls (ppojax's precision: mixed)
        fp16=False,
        gradient_checkpointing=False,
        use_cpu=device == "cpu",
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    trainer = PPOTrainer(
        args=args,
        processing_class=tokenizer,
        model=policy,
        ref_model=None,
        reward_model=reward,
        train_dataset=dataset,
        value_model=value,
        eval_dataset=dataset,
    )

    # --- timing hooks (wrappers around TRL's module-level helpers; the algorithm is untouched) ---
    marks: dict = {"gen": [], "update_start": None}
    records: list[dict] = []
    orig_batch_generation, orig_forward = ppo_mod.batch_generation, ppo_mod.forward

    def timed_batch_generation(*a, **k):
        t0 = time.perf_counter()
        out = orig_batch_generation(*a, **k)
        marks["gen"].append(time.perf_counter() - t0)
        got = out[0].shape[1] - P
        if got != R:
            raise RuntimeError(f"TRL generated {got} tokens, expected a fixed {R}: generation stopped early")
        return out

    def timed_forward(model, *a, **k):
        if marks["update_start"] is None and model is trainer.model:
            marks["update_start"] = time.perf_counter()
        return orig_forward(model, *a, **k)

    class StepTimer(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            now, cpu_now = time.perf_counter(), time.process_time()
            start = marks["prev_end"]
            records.append({
                "total_s": now - start,
                "cpu_s": cpu_now - marks["prev_cpu"],
                "generation_s": sum(marks["gen"]),
                "rollout_s": marks["update_start"] - start,
                "update_s": now - marks["update_start"],
            })
            turns.done(len(records) - 1)
            if turns.active and len(records) < n:  # the next update starts its clock when its turn comes
                turns.wait(len(records))
                now, cpu_now = time.perf_counter(), time.process_time()
            marks.update(gen=[], update_start=None, prev_end=now, prev_cpu=cpu_now)

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "eps" in logs:
                marks["trl_eps"] = logs["eps"]

    ppo_mod.batch_generation, ppo_mod.forward = timed_batch_generation, timed_forward
    trainer.add_callback(StepTimer())
    setup_s = time.perf_counter() - t_setup
    turns = Turns(config, "trl")
    try:
        turns.wait(0)
        marks["prev_end"], marks["prev_cpu"] = time.perf_counter(), time.process_time()
        trainer.train()
    finally:
        ppo_mod.batch_generation, ppo_mod.forward = orig_batch_generation, orig_forward
    if len(records) != n:
        raise RuntimeError(f"expected {n} updates, timed {len(records)}")

    result = summarize(config, records, setup_s)
    result.update(
        side="trl",
        threads=threads,
        trl_reported_eps_last=marks.get("trl_eps"),
        peak_rss_mb=peak_rss_mb(),
        versions={"trl": trl.__version__, "torch": torch.__version__,
                  "transformers": transformers.__version__},
        device=device,
        settings=(f"{'bf16 autocast' if bf16 else 'float32'} on {device}, SDPA attention, no gradient checkpointing, "
                  "ref model = TRL's deep copy, "
                  f"optimizer {getattr(args.optim, 'value', args.optim)} (TrainingArguments default)"),
    )
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="tiny", choices=["tiny", "smollm2"])
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads (also OMP/MKL)")
    p.add_argument("--updates", type=int, default=None, help="PPO updates, the first excluded (>= 2)")
    p.add_argument("--quick", action="store_true", help="the --quick number of updates")
    p.add_argument("--model-dir", default=None, help="converted HF checkpoint directory (else random init)")
    p.add_argument("--config", default=None, help="a make_config() JSON file (overrides the above)")
    p.add_argument("--json", default=None, help="write the result here (default: stdout)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where TRL runs")
    p.add_argument("--bf16", action="store_true", help="TRL's bf16 (autocast over float32 weights)")
    a = p.parse_args(argv)
    if a.config:
        with open(a.config) as f:
            config = json.load(f)
    else:
        config = make_config(a.size, quick=a.quick, num_updates=a.updates, model_dir=a.model_dir)
    result = run(config, a.threads, a.device, a.bf16)
    if a.json:
        write_json(a.json, result, indent=1)
    else:
        print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
