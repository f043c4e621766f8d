"""A run's outputs are never lost or mixed, and a user's mistake never ends in a traceback (issue 17), through
``ppojax train`` itself: a finished run re-run changes nothing; a fresh run never touches another run's
directory; overwrite moves the old run aside; a resume with changed settings is refused unless allowed; a
second process cannot share a directory; SIGTERM / SIGINT stop after the update in flight with a checkpoint
and a one-line hint; bad inputs that need the models' config.json or the devices are refused before any
weights are loaded, fast.

(The module-level mechanisms are tested in tests/test_run_dir.py, test_logging.py, test_checkpoint.py and
test_config_errors.py; SIGKILL + resume with every sink in tests/test_reliability.py.)
"""
import hashlib
import json
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ppojax.trainer.cli import main
from ppojax.models import ScoreModel, save_pretrained
from tests.tiny_setup import run_environment, tiny_config, tiny_policy, tiny_tokenizer, write_tiny_run_inputs

REPO = Path(__file__).resolve().parents[1]
TINY_YAML = str(REPO / "configs" / "tiny.yaml")


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    return write_tiny_run_inputs(tmp_path_factory.mktemp("tiny"))


def args_for(dirs, out, *extra):
    return ["train", TINY_YAML, f"model_name_or_path={dirs / 'model'}", f"dataset={dirs / 'prompts.jsonl'}",
            f"output_dir={out}", "num_eval_prompts=0", *extra]


def snapshot(directory: Path) -> dict:
    """Every file under ``directory`` with its bytes' hash and its modification time."""
    return {str(p.relative_to(directory)): (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mtime_ns)
            for p in sorted(directory.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def finished_run(tiny_dirs, tmp_path_factory):
    out = tmp_path_factory.mktemp("finished") / "run"
    assert main(args_for(tiny_dirs, out)) == 0
    return out


def test_rerunning_a_finished_run_changes_nothing(tiny_dirs, finished_run, capsys):
    before = snapshot(finished_run)
    assert json.loads((finished_run / "run.json").read_text())["status"] == "finished"
    capsys.readouterr()
    assert main(args_for(tiny_dirs, finished_run, "resume=auto")) == 0
    printed = capsys.readouterr().out
    assert "already holds this run, finished" in printed and str(finished_run / "summary.json") in printed
    assert snapshot(finished_run) == before  # byte for byte, times included
    assert not (finished_run / "run.lock").exists()


def test_a_fresh_run_never_touches_another_runs_directory(tiny_dirs, finished_run, capsys):
    before = snapshot(finished_run)
    assert main(args_for(tiny_dirs, finished_run, "learning_rate=0.5")) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "Traceback" not in err
    assert "resume=auto" in err and "output_dir=<another directory>" in err and "overwrite_output_dir=true" in err
    assert snapshot(finished_run) == before


def test_export_on_an_install_without_torch_prints_only_where_it_wrote(finished_run, tmp_path, cli_env):
    """`ppojax export` where torch is not installed (cli_env: a user's install): transformers' advice at import that
    its models need torch is not printed; stdout is the export's directory, stderr nothing."""
    target = tmp_path / "exported"
    done = subprocess.run([sys.executable, "-m", "ppojax.trainer.cli", "export", str(finished_run / "checkpoints"),
                           str(target)], cwd=REPO, env=cli_env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stderr == "", done.stderr[-3000:]
    assert done.stdout.splitlines() == [str(target)]
    assert (target / "config.json").is_file() and (target / "model.safetensors").is_file()


def test_overwrite_moves_the_old_run_aside(tiny_dirs, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(args_for(tiny_dirs, out, "total_episodes=16")) == 0
    old = snapshot(out)
    assert main(args_for(tiny_dirs, out, "total_episodes=16", "overwrite_output_dir=true", "seed=1")) == 0
    aside = [p for p in tmp_path.iterdir() if p.name.startswith("run.replaced-")]
    assert len(aside) == 1 and snapshot(aside[0]) == old  # moved whole, nothing deleted
    assert json.loads((out / "run.json").read_text())["config"]["seed"] == 1
    assert str(aside[0]) in capsys.readouterr().out


def test_resume_with_changed_settings_is_refused_unless_allowed(tiny_dirs, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(args_for(tiny_dirs, out, "total_episodes=32", "save_steps=1")) == 0
    before = snapshot(out)
    capsys.readouterr()
    # more episodes is fine (a finished run continued); a new learning rate is a change that must be allowed
    code = main(args_for(tiny_dirs, out, "total_episodes=48", "save_steps=1", "resume=auto", "learning_rate=0.5"))
    err = " ".join(capsys.readouterr().err.split())
    assert code == 2 and "learning_rate" in err and "resume_with_changes" in err and "Traceback" not in err
    assert snapshot(out) == before
    assert main(args_for(tiny_dirs, out, "total_episodes=48", "save_steps=1", "resume=auto", "learning_rate=0.5",
                         "resume_with_changes=true")) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3] and rows[-1]["lr"] == pytest.approx(0.5 * 1 / 3, rel=1e-5)


# ------------------------------------------------------------------------------------------------------------
# Signals and concurrency: real processes
# ------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def cli_env():
    """The runs' environment (`tests.tiny_setup.run_environment`: XLA's quickest compile; these tests check what the
    runs do, not their numbers)."""
    return run_environment()


def start(dirs, out, env, *extra):
    log = out.with_suffix(".log")
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as f:
        # a long run at a gentle learning rate (the tiny model diverges after many updates at tiny.yaml's 1e-2)
        proc = subprocess.Popen([sys.executable, "-m", "ppojax.trainer.cli", *args_for(dirs, out, "total_episodes=1600",
                                                                               "save_steps=0", "learning_rate=1e-4",
                                                                               *extra)],
                                cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT)
    return proc, log


def wait_for_updates(out: Path, proc, log: Path, n: int, timeout=240):
    deadline = time.time() + timeout
    while time.time() < deadline:
        metrics = out / "metrics.jsonl"
        if metrics.exists() and len(metrics.read_text().splitlines()) >= n:
            return
        assert proc.poll() is None, log.read_text()[-3000:]
        time.sleep(0.1)
    raise AssertionError(log.read_text()[-3000:])


#: an asynchronous run whose 2 batches in flight are part-decoded (in-flight weight updates: their KV caches in the
#: state); the plain pipeline's queue goes through the same loop and checkpoints (tests/test_pipeline.py kills it)
ASYNCHRONOUS = ("max_staleness=2", "behaviour_logprobs=sampler", "use_decoupled_loss=true",
                "in_flight_weight_updates=true")


@pytest.mark.parametrize("signum, extra", [(signal.SIGTERM, ()), (signal.SIGINT, ()),
                                           pytest.param(signal.SIGINT, ASYNCHRONOUS, id="SIGINT-asynchronous")])
def test_a_signal_finishes_the_update_writes_a_checkpoint_and_exits_with_a_hint(tiny_dirs, tmp_path, cli_env,
                                                                                signum, extra, capsys):
    """Also in an asynchronous run (2 part-decoded batches in flight): the checkpoint holds the queue, so the run
    resumes without sampling its first batches again."""
    out = tmp_path / "run"
    proc, log = start(tiny_dirs, out, cli_env, *extra)
    wait_for_updates(out, proc, log, 2)
    proc.send_signal(signum)
    proc.wait(timeout=120)
    text = log.read_text()
    assert proc.returncode == 128 + signum, text[-3000:]
    assert "Traceback" not in text
    name = signal.Signals(signum).name
    last = [line for line in text.splitlines() if line.startswith(f"ppojax: stopped by {name}")]
    assert len(last) == 1 and "Continue with resume=auto" in last[0], text[-2000:]
    step = len((out / "metrics.jsonl").read_text().splitlines())
    assert f"after update {step};" in last[0]
    assert (out / "checkpoints" / f"step_{step}" / "COMPLETE").exists()
    assert not (out / "run.lock").exists()
    # the run continues from there
    capsys.readouterr()
    assert main(args_for(tiny_dirs, out, "total_episodes=" + str(16 * (step + 1)), "save_steps=0",
                         "learning_rate=1e-4", "resume=auto", "resume_with_changes=true", *extra)) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, step + 2))
    if extra:
        assert "sampling the first 2 batches" in text  # before update 1, and never again:
        assert "sampling the first" not in capsys.readouterr().out  # the queue came back from the checkpoint
        assert rows[-1]["offpolicy/staleness_max"] == 2


def test_two_runs_cannot_share_a_directory(tiny_dirs, tmp_path, cli_env, capsys):
    out = tmp_path / "run"
    proc, log = start(tiny_dirs, out, cli_env)
    try:
        wait_for_updates(out, proc, log, 1)
        assert main(args_for(tiny_dirs, out, "total_episodes=1600", "save_steps=0", "learning_rate=1e-4",
                             "resume=auto")) == 2
        err = " ".join(capsys.readouterr().err.split())
        assert f"pid {proc.pid}" in err and "Traceback" not in err, err
    finally:
        proc.kill()
        proc.wait()


# ------------------------------------------------------------------------------------------------------------
# Bad inputs that need the models' config.json or the devices: refused before any weights load, fast
# ------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def unloadable_dirs(tiny_dirs, tmp_path_factory):
    """tiny_dirs with the policy's weights file replaced by junk: a run that reads it fails with a load error,
    so a refusal with the expected message shows that no weights were read."""
    root = tmp_path_factory.mktemp("unloadable")
    shutil.copytree(tiny_dirs / "model", root / "model")
    shutil.copy(tiny_dirs / "prompts.jsonl", root / "prompts.jsonl")
    weights = list((root / "model").glob("*.safetensors"))
    assert weights
    for path in weights:
        path.write_bytes(b"not a safetensors file")
    return root


def _reward_dirs(root: Path):
    """A causal LM and a 2-label classifier, each a real transformers checkpoint directory."""
    causal = root / "causal_reward"
    save_pretrained(tiny_policy(), tiny_config(), causal, tokenizer=tiny_tokenizer())
    two = root / "two_labels"
    save_pretrained(ScoreModel(tiny_config(), rngs=__import__("flax").nnx.Rngs(0)), tiny_config(), two,
                    tokenizer=tiny_tokenizer())
    config = json.loads((two / "config.json").read_text())
    config.update(id2label={"0": "NEGATIVE", "1": "POSITIVE"}, label2id={"NEGATIVE": 0, "POSITIVE": 1})
    (two / "config.json").write_text(json.dumps(config))
    return causal, two


def test_a_full_disk_during_training_is_one_message_and_leaves_nothing_half_written(tiny_dirs, tmp_path, cli_env):
    """`ppojax train` under a 16 KB file-size limit (`ulimit -f`: EFBIG, as a full disk gives ENOSPC; above
    run.json's size): whichever write fails first (TensorBoard, metrics or the first checkpoint), ONE error line
    names the run's directory and what to do, exit 1, no traceback; no .tmp debris; every metrics line that was
    written is whole."""
    import resource

    out = tmp_path / "run"
    env = {k: v for k, v in cli_env.items() if not k.startswith("JAX_PERSISTENT_CACHE")
           and k != "JAX_COMPILATION_CACHE_DIR"}
    limit = 16 * 1024

    def small_files():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    proc = subprocess.run([sys.executable, "-m", "ppojax.trainer.cli",
                           *args_for(tiny_dirs, out, "compilation_cache_dir=none")],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300, preexec_fn=small_files)
    text = proc.stdout + proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("ppojax: error:")]
    assert proc.returncode == 1 and "Traceback" not in text, text[-3000:]
    assert len(errors) == 1 and "too large while writing" in errors[0] and str(out) in errors[0], text[-3000:]
    assert "No checkpoint was written yet" in errors[0] or "no earlier checkpoint exists" in errors[0], errors[0]
    assert not [p for p in out.rglob("*") if ".tmp" in p.name]
    for line in (out / "metrics.jsonl").read_text().splitlines():
        json.loads(line)


def _bad_prompt_files(root: Path) -> None:
    """Prompt files with a malformed line 2 (JSONL), a Latin-1 byte on line 3, a JSON syntax error found on line 4."""
    (root / "broken.jsonl").write_text('{"prompt": "one"}\n{"prompt": "two",}\n{"prompt": "three"}\n')
    (root / "latin1.jsonl").write_bytes('{"prompt": "one"}\n{"prompt": "two"}\n{"prompt": "caf\u00e9"}\n'
                                        .encode("latin-1"))
    (root / "broken.json").write_text('[\n  {"prompt": "one"},\n  {"prompt": "two"\n]\n')


BUILD_ERRORS = {
    "stop token outside the vocabulary": (["stop_token_id=500"],
                                          r"stop_token_id=500 is outside the policy's vocabulary \(vocab_size=16\)"),
    "prompt + response past max_position_embeddings": (["response_length=80"],
                                                       r"6 \+ 80 = 86 exceeds the policy's max_position_embeddings=64"),
    "a causal LM as the reward model": (["reward_model_path={causal}", "reward_function=null"],
                                        r"is a LlamaForCausalLM checkpoint, not a reward model"),
    "a 2-label classifier as the reward model": (["reward_model_path={two}", "reward_function=null"],
                                                 r"classifier with 2 labels \(0 = NEGATIVE, 1 = POSITIVE\).*"
                                                 r"set reward_model_label to its index"),
    "a label the classifier does not have": (["reward_model_path={two}", "reward_function=null",
                                              "reward_model_label=2"],
                                             r"reward_model_label=2 is not an output of .* which has 2 label"),
    "a malformed JSONL prompt file": (["dataset={data}/broken.jsonl"],
                                      r"broken.jsonl: line 2 is not valid JSON"),
    "a prompt file that is not UTF-8": (["dataset={data}/latin1.jsonl"],
                                        r"latin1.jsonl: line 3 is not UTF-8 text \(byte 0xe9"),
    "a JSON prompt file with a syntax error": (["dataset={data}/broken.json"],
                                               r"broken.json: not valid JSON at line 4, column 1"),
    "mesh larger than the devices": (["mesh_data=4"], r"4 devices but 1 are in use"),
    "forward batch size that does not divide": (["local_rollout_forward_batch_size=5"],
                                                r"does not divide batch_size=16"),
    "no reward source": (["reward_function=null"], r"No reward source"),
}


@pytest.fixture(scope="module")
def refusals(unloadable_dirs, tmp_path_factory, cli_env):
    """Every BUILD_ERRORS case through `ppojax train`'s main, all in one fresh process (tests/cli_refusals.py):
    {case: (result, output_dir)}."""
    root = tmp_path_factory.mktemp("refusals")
    causal, two = _reward_dirs(root)
    _bad_prompt_files(root)
    cases, outs = {}, {}
    for index, (case, (extra, _)) in enumerate(BUILD_ERRORS.items()):
        extra = [e.format(causal=causal, two=two, data=root) for e in extra]
        outs[case] = root / f"run{index}"
        overridden = {e.split("=", 1)[0] for e in extra}
        cases[case] = [a for a in args_for(unloadable_dirs, outs[case]) if a.split("=", 1)[0] not in overridden] + extra
    (root / "cases.json").write_text(json.dumps(cases))
    proc = subprocess.run([sys.executable, "-m", "tests.cli_refusals", str(root / "cases.json"),
                           str(root / "results.json"), "--count-compiles"], cwd=REPO, env=cli_env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    results = json.loads((root / "results.json").read_text())
    return {case: (results[case], outs[case]) for case in BUILD_ERRORS}


@pytest.mark.parametrize("case", list(BUILD_ERRORS))
def test_bad_inputs_found_in_config_json_are_refused_before_loading(refusals, case):
    result, out = refusals[case]
    text = result["stdout"] + result["stderr"]
    assert result["code"] == 2, text[-2000:]
    # the expected message, not the junk weights' load error: refused before any weights were read
    pattern = BUILD_ERRORS[case][1]
    assert "Traceback" not in text and re.search(pattern, " ".join(result["stderr"].split())), text[-2000:]
    assert result["compiles"] == []  # nothing compiled
    assert not out.exists()  # refused before the output directory was claimed
