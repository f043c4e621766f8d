"""Bad configs, one table, run two ways: in-process (``PPOConfig.from_yaml`` raises a ConfigError with the
expected words) and through the real CLI (``python -m ppojax.trainer.cli train BAD.yaml``: exit code 2, the message on
stderr, no traceback, and no heavy library imported before the error)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ppojax.trainer.config import ConfigError, PPOConfig

REPO = Path(__file__).resolve().parents[1]

# (id, the config file's text (bytes: written as is), substrings the message must contain)
BAD_CONFIGS = [
    # ---- the file itself
    ("malformed-indent", "learning_rate: 1.0e-5\n  batch_size: 16\n",
     [".yaml:2:13: not valid YAML", "mapping values are not allowed here", "Fix the line"]),
    ("malformed-tab", "learning_rate: 1.0e-5\n\tbatch_size: 16\n",
     [".yaml:2:1: not valid YAML", "cannot start any token", "spaces not tabs"]),
    ("malformed-bracket", "batch_size: [16\n", [".yaml:2:1: not valid YAML", "expected ',' or ']'"]),
    ("duplicate-key", "learning_rate: 1.0e-5\nbatch_size: 16\nlearning_rate: 2.0e-5\n",
     [".yaml:3: key 'learning_rate' is given twice (lines 1 and 3)", "Keep one of them"]),
    ("not-a-mapping", "- learning_rate\n- batch_size\n", ["expected a mapping of field: value", "got a list"]),
    ("not-utf8", b"run_name: caf\xe9\n", [".yaml:1: not UTF-8 text", "byte 0xe9", "save the config as UTF-8"]),
    # ---- keys
    ("trl-keys-and-typo", "bf16: true\nfp16: false\nper_device_eval_batch_size: 8\ngradient_checkpointing: true\n"
     "log_with: wandb\ntracker_project_name: x\npush_to_hub: false\nsave_strategy: steps\neval_strategy: 'no'\n"
     "logging_dir: logs\nlearning_rte: 1.0e-5\n",
     ["11 unknown config keys:", "'bf16' (TRL / transformers): use precision: mixed",
      "'fp16' (TRL / transformers): ppojax has no float16", "'per_device_eval_batch_size' (TRL / transformers)",
      "num_eval_prompts", "'gradient_checkpointing' (TRL / transformers): no such knob",
      "'log_with' (TRL / transformers): use report_to", "WANDB_PROJECT", "'push_to_hub' (TRL / transformers)",
      "'save_strategy' (TRL / transformers): use save_steps", "'logging_dir' (TRL / transformers)",
      "'learning_rte': Did you mean 'learning_rate'?", "ppojax train --help"]),
    ("alias-conflict", "ppo_epochs: 2\nnum_ppo_epochs: 3\n",
     ["ppo_epochs=2 and num_ppo_epochs=3 both set 'num_ppo_epochs'", "keep one"]),
    ("legacy-mini-batch", "batch_size: 10\nmini_batch_size: 3\n", ["mini_batch_size=3 (legacy)", "multiple"]),
    # ---- types
    ("list-for-number", "learning_rate: [1.0e-5, 2.0e-5]\n",
     ["learning_rate=[1e-05, 2e-05]: expected a number >= 0, got a list", "Fix: set learning_rate"]),
    ("string-for-number", "learning_rate: fast\n", ["learning_rate='fast'", "not a number"]),
    ("bool-for-number", "batch_size: true\n", ["batch_size=True: expected null or an integer >= 1, got a boolean"]),
    ("nan", "gamma: .nan\n", ["gamma=nan: expected a number in [0, 1], got a non-finite number"]),
    ("inf", "learning_rate: .inf\n", ["learning_rate=inf", "non-finite"]),
    ("fraction-for-int", "num_ppo_epochs: 2.5\n", ["num_ppo_epochs=2.5", "not a whole number"]),
    ("null-for-number", "learning_rate: null\n", ["learning_rate=None: expected a number >= 0, got null"]),
    ("mapping-for-string", "dataset:\n  path: x.jsonl\n", ["dataset={'path': 'x.jsonl'}", "got a mapping"]),
    ("string-for-bool", "whiten_rewards: maybe\n", ["whiten_rewards='maybe': expected true or false"]),
    # ---- values
    ("temperature-zero", "temperature: 0\n",
     ["temperature=0: expected a number > 0", "sampling temperature > 0", "0.01"]),
    ("report-to-unknown", "report_to: mlflow\n",
     ["report_to='mlflow'", "'tensorboard', 'wandb', 'none', 'all'"]),
    ("report-to-none-and-more", "report_to: [tensorboard, none]\n", ["report_to=['tensorboard', 'none']"]),
    ("total-episodes-zero", "total_episodes: 0\n", ["total_episodes=0: expected null or an integer >= 1"]),
    ("total-episodes-negative", "total_episodes: -16\n", ["total_episodes=-16"]),
    ("negative-coefficients", "kl_coef: -0.1\nvf_coef: -1\nentropy_coef: -0.01\n",
     ["3 config values are not valid", "kl_coef=-0.1: expected a number >= 0", "vf_coef=-1", "entropy_coef=-0.01"]),
    ("negative-sizes", "response_length: -5\nmax_prompt_length: 0\nper_device_train_batch_size: 0\n"
     "num_mini_batches: 0\nlogits_chunk_size: 0\nlocal_rollout_forward_batch_size: -1\n",
     ["6 config values are not valid", "response_length=-5: expected an integer >= 1", "max_prompt_length=0",
      "per_device_train_batch_size=0", "num_mini_batches=0", "logits_chunk_size=0",
      "local_rollout_forward_batch_size=-1"]),
    ("ranges", "top_p: 0\ntop_k: -1\ngamma: 1.5\nlam: -0.1\ncliprange: 0\nadam_beta2: 1.0\nscore_clip: 0\n"
     "horizon: 0\nwarmup_steps: -1\nsave_total_limit: 0\nnum_eval_prompts: -1\ntarget_kl: 0\n",
     ["12 config values are not valid", "top_p=0: expected a number in (0, 1]", "top_k=-1", "gamma=1.5",
      "lam=-0.1", "cliprange=0: expected a number > 0", "adam_beta2=1.0: expected a number in [0, 1)",
      "score_clip=0: expected null or a number > 0", "horizon=0", "warmup_steps=-1", "save_total_limit=0",
      "num_eval_prompts=-1", "target_kl=0"]),
    ("seed", "seed: -1\n", ["seed=-1: expected an integer in [0, 2147483647]"]),
    ("seed-too-large", "seed: 4294967296\n", ["seed=4294967296", "32 bits"]),
    ("empty-strings", "dataset_text_field: ''\noutput_dir: ' '\n",
     ["dataset_text_field='': expected a non-empty string", "output_dir=' '"]),
    ("choices", "precision: float16\nvalue_head: both\nlr_scheduler_type: cosine\non_nonfinite_reward: ignore\n"
     "stop_token: EOS\nbehaviour_logprobs: sampled\n",
     ["precision='float16': expected one of 'float32', 'bfloat16', 'mixed'", "value_head='both'",
      "lr_scheduler_type='cosine': expected 'linear' or 'constant'",
      "on_nonfinite_reward='ignore': expected 'error' or 'skip'", "stop_token='EOS': expected null or 'eos'",
      "behaviour_logprobs='sampled': expected 'forward' or 'sampler'"]),
    ("kl-estimator", "kl_estimator: k9\n", ["kl_estimator='k9': expected one of 'k1', 'k2', 'k3'"]),
    ("reward-function-spec", "reward_function: my_rewards\n",
     ["reward_function='my_rewards': expected null or 'vader' or 'module:function'", "PYTHONPATH"]),
    ("logging-steps-fraction", "logging_steps: 0.1\n", ["logging_steps=0.1", "number of updates"]),
    ("mesh", "mesh_data: -1\nmesh_fsdp: -1\n", ["at most one -1"]),
    ("mesh-zero", "mesh_tensor: 0\n", ["mesh_tensor=0: expected -1 or an integer >= 1"]),
    # ---- fields together
    ("two-reward-sources", "reward_model_path: rm\nreward_function: vader\n", ["keep one of them"]),
    ("forward-batch", "batch_size: 16\nlocal_rollout_forward_batch_size: 5\n",
     ["local_rollout_forward_batch_size=5 does not divide batch_size=16", "e.g. 4"]),
    ("mini-batches", "batch_size: 10\nnum_mini_batches: 3\n", ["does not split into num_mini_batches=3"]),
    ("warmup-vs-updates", "batch_size: 16\ntotal_episodes: 64\nwarmup_steps: 4\n",
     ["warmup_steps=4 is not below the run's 4 update(s)", "Set warmup_steps below 4"]),
    ("skip-needs-room", "on_nonfinite_reward: skip\nmax_nonfinite_steps: 3\n", ["more than 4"]),
    ("adaptive-kl-zero", "adaptive_kl: true\nkl_coef: 0\n", ["would stay 0"]),
    ("score-norm-alone", "use_score_norm: true\n", ["use_score_scaling"]),
    ("label-without-reward-model", "reward_model_label: 1\n",
     ["reward_model_label=1 is set but there is no reward_model_path"]),
    ("eos-penalty-no-stop", "missing_eos_penalty: 1.0\n", ["needs a stop token", "stop_token: eos"]),
    ("two-stop-tokens", "stop_token: eos\nstop_token_id: 2\n", ["both set"]),
    ("policy-head-and-value-model", "value_head: policy\nvalue_model_path: v\n", ["value_head: separate"]),
    # ---- agent runs
    ("turn-length-without-agent", "turn_length: 16\n", ["read only by an agent run", "remove it"]),
    ("agent-dynamic-sampling", "environment_factory: m:Game\nfilter_groups: true\nadvantage_estimator: grpo\n"
     "num_generations: 4\nbatch_size: 16\n", ["filter_groups=True (dynamic sampling) is not available",
                                             "filter_groups: false"]),
    ("agent-turn-too-long", "tools: [m:f]\nturn_length: 80\nresponse_length: 40\n",
     ["turn_length=80 is longer than response_length=40"]),
    ("agent-tools-not-specs", "tools: [calculate]\n", ["'module:function' tools"]),
]


def write(tmp_path, name, text) -> Path:
    path = tmp_path / f"{name}.yaml"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    return path


@pytest.mark.parametrize("name,text,words", BAD_CONFIGS, ids=[row[0] for row in BAD_CONFIGS])
def test_bad_config_in_process(tmp_path, name, text, words):
    with pytest.raises(ConfigError) as err:
        PPOConfig.from_yaml(write(tmp_path, name, text))
    for word in words:
        assert word in str(err.value), f"{word!r} not in:\n{err.value}"


# Libraries that take seconds to import; a config error must be reported before any of them is needed.
HEAVY_LIBRARIES = ("jax", "jaxlib", "flax", "optax", "orbax", "torch", "transformers")


def _poisoned_libraries(root: Path) -> Path:
    """A directory of stand-in packages, one per heavy library, that fail on import. Put first on PYTHONPATH,
    it makes any import of them before the config check visible as a failure, however fast the host."""
    for name in HEAVY_LIBRARIES:
        package = root / name
        package.mkdir(parents=True)
        (package / "__init__.py").write_text(
            f"raise ImportError('POISONED: {name} was imported before the config was checked')\n")
    return root


def test_bad_configs_through_the_cli(tmp_path):
    """Every row through `ppojax train BAD.yaml`'s main, all in one fresh process (tests/cli_refusals.py). The CLI
    must refuse the config before importing JAX (or torch, transformers...): those are shadowed here by packages that
    fail on import, so reaching one shows up as a wrong exit code and message rather than as a slow,
    timing-dependent run."""
    poison = _poisoned_libraries(tmp_path / "poisoned")
    env = {**os.environ,
           "PYTHONPATH": os.pathsep.join([str(REPO), str(poison), os.environ.get("PYTHONPATH", "")])}
    cases = {name: ["train", str(write(tmp_path, name, text))] for name, text, _ in BAD_CONFIGS}
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    done = subprocess.run([sys.executable, "-m", "tests.cli_refusals", str(tmp_path / "cases.json"),
                           str(tmp_path / "results.json")], capture_output=True, text=True, env=env, cwd=REPO,
                          timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    results = json.loads((tmp_path / "results.json").read_text())
    failures = []
    for name, text, words in BAD_CONFIGS:
        result = results[name]
        problems = []
        if result["code"] != 2:
            problems.append(f"exit code {result['code']}")
        if "Traceback" in result["stdout"] + result["stderr"]:
            problems.append("a traceback")
        if "POISONED" in result["stdout"] + result["stderr"]:
            problems.append("a heavy library imported before the error")
        if not result["stderr"].startswith("ppojax: error: "):
            problems.append("no 'ppojax: error:' on stderr")
        problems += [f"{word!r} not on stderr" for word in words if word not in result["stderr"]]
        if problems:
            failures.append(f"{name}: {', '.join(problems)}\n{result['stdout']}{result['stderr']}")
    assert not failures, "\n".join(failures)


def test_the_poisoned_libraries_do_fail_on_import(tmp_path):
    """Control for the test above: with the same PYTHONPATH, importing JAX does fail."""
    poison = _poisoned_libraries(tmp_path / "poisoned")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(poison)])}
    for name in HEAVY_LIBRARIES:
        done = subprocess.run([sys.executable, "-c", f"import {name}"], capture_output=True, text=True, env=env,
                              timeout=60)
        assert done.returncode != 0 and f"POISONED: {name}" in done.stderr, (name, done.stderr)


def test_cli_overrides_are_checked_like_the_file(tmp_path, capsys):
    from ppojax.trainer.cli import main
    good = write(tmp_path, "good", "reward_function: vader\n")
    assert main(["train", str(good), "temperature=0", "bf16=true", "kl_coef=[1"]) == 2
    err = capsys.readouterr().err
    assert "override 'kl_coef=[1':1:" in err  # the override that is not YAML comes first
    assert main(["train", str(good), "temperature=0", "bf16=true"]) == 2
    assert "'bf16' (TRL / transformers): use precision: mixed" in capsys.readouterr().err
    assert main(["train", str(good), "temperature=0"]) == 2
    assert "temperature=0: expected a number > 0" in capsys.readouterr().err
