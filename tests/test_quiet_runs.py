"""`ppojax train` as a user runs it says what happens in its own words (issue 51): other libraries' logging and
warnings go to the run's libraries.log, not the terminal (a full disk at a checkpoint is one line; the export check
prints no load report); a reward function that returns text and a prompt the tokenizer cannot read are refused in
one line, exit 2, before the first update."""
import json
import logging
import subprocess
import sys
import textwrap
import warnings

import numpy as np
import pytest

from ppojax.io.library_logs import library_output_to
from tests.test_cli import good_fraction
from tests import test_trust as trust
from tests.test_trust import REPO, args_for
from tests.tiny_setup import run_environment

MODULE = "tests.test_quiet_runs"
# test_trust's fixtures, shared by name (pytest finds a module's fixtures among its names)
cli_env, tiny_dirs = trust.cli_env, trust.tiny_dirs


def noisy_good_fraction(prompts, completions):
    """The tiny reward, and what libraries do during a run: log a warning and raise a Python warning."""
    logging.getLogger("some_library.writer").warning("a library's own warning (with its traceback)")
    warnings.warn("a library's deprecation", FutureWarning)
    return good_fraction(prompts, completions)


def text_scores(prompts, completions):
    return [str(s) for s in good_fraction(prompts, completions)]


#: `ppojax train` (the program, as ``python -m ppojax.trainer.cli``) with an atexit handler that says it ran
CLI_SAYING_ATEXIT_RAN = textwrap.dedent("""
    import atexit, sys
    from ppojax.trainer import cli

    atexit.register(lambda: print("atexit handlers ran", flush=True))
    sys.argv[0] = "ppojax"
    sys.exit(cli.main())
""")


#: a process that has not imported datasets: a run neither imports it nor leaves its variable set; imported during
#: the run, it starts with its bars off
BARS_OF_A_LIBRARY_IMPORTED_DURING_A_RUN = textwrap.dedent("""
    import os, sys
    from pathlib import Path
    from ppojax.io.library_logs import library_output_to

    with library_output_to(Path(sys.argv[1])):
        assert "datasets" not in sys.modules, "switching datasets' progress bars off imported it"
        import datasets
        assert not datasets.is_progress_bar_enabled()
    assert "HF_DATASETS_DISABLE_PROGRESS_BARS" not in os.environ
    print("bars off")
""")


#: a process without torch (a user's install) that imports transformers when a run starts: transformers' advice that
#: its models need torch goes to the run's file, and its handler writes to stderr again after the run
TRANSFORMERS_IMPORTED_WHEN_A_RUN_STARTS = textwrap.dedent("""
    import logging, sys
    from pathlib import Path
    from ppojax.io.library_logs import library_output_to

    assert "transformers" not in sys.modules and sys.modules["torch"] is None
    with library_output_to(Path(sys.argv[1])):
        pass
    logging.getLogger("transformers").warning("after the run")
""")


def _train(dirs, out, env, *extra, preexec_fn=None, program=("-m", "ppojax.trainer.cli")):
    """`ppojax train` on the tiny run with ``extra`` overrides (replacing the test defaults they name)."""
    overridden = {e.split("=", 1)[0] for e in extra}
    args = [a for a in args_for(dirs, out) if a.split("=", 1)[0] not in overridden] + list(extra)
    return subprocess.run([sys.executable, *program, *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300, preexec_fn=preexec_fn)


def test_a_full_disk_at_a_checkpoint_is_one_line_and_library_output_goes_to_the_runs_file(tiny_dirs, tmp_path,
                                                                                          cli_env):
    """A real file-size limit (`ulimit -f 64`) that the first checkpoint crosses: ONE line on stderr, no traceback
    (orbax's writer threads log theirs), nothing half-written; what the libraries logged and warned during the run
    is in output_dir/libraries.log, orbax's own reports of the failed write included. The process ends the
    ordinary way: exit code 1, its atexit handlers run, nothing printed after the line."""
    import resource

    out = tmp_path / "run"
    env = {k: v for k, v in cli_env.items() if k != "JAX_COMPILATION_CACHE_DIR"}

    def small_files():
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, 64 * 1024))

    cli = tmp_path / "ppojax_cli.py"
    cli.write_text(CLI_SAYING_ATEXIT_RAN)
    proc = _train(tiny_dirs, out, env, f"reward_function={MODULE}:noisy_good_fraction", "compilation_cache_dir=none",
                  preexec_fn=small_files, program=(str(cli),))
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert proc.stdout.splitlines()[-1] == "atexit handlers ran", proc.stdout[-3000:]
    assert proc.stderr.splitlines() == [
        f"ppojax: error: file too large while writing {out / 'checkpoints' / 'step_2'}; no earlier checkpoint "
        "exists; raise the file size limit (`ulimit -f unlimited`) or use a file system that allows larger files."]
    assert "Traceback" not in proc.stdout and "library" not in proc.stdout
    assert not [p for p in out.rglob("*") if ".tmp" in p.name or ".partial" in p.name]
    assert not list((out / "checkpoints").glob("step_*"))
    for line in (out / "metrics.jsonl").read_text().splitlines():
        json.loads(line)
    log = (out / "libraries.log").read_text()
    assert "WARNING some_library.writer: a library's own warning" in log
    assert "FutureWarning: a library's deprecation" in log
    assert " ERROR absl: " in log and "os_error_code='27'" in log, log[-3000:]  # orbax's report, with the errno


def test_the_export_check_prints_no_load_report(tiny_dirs, tmp_path):
    """The policy exported with its value head (value_head: policy, as the demo): transformers' causal LM ignores
    v_head.* and says so in a load report; the run keeps that report in libraries.log and prints only its own
    line about the check (which needs torch)."""
    out = tmp_path / "run"
    proc = _train(tiny_dirs, out, run_environment(torch=True), "value_head=policy", "num_eval_prompts=4",
                  "total_episodes=16", "save_steps=0", "learning_rate=1e-4", "export_check=true")
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text[-3000:]
    assert "ppojax: transformers reproduces ppojax's greedy continuations: True" in proc.stdout
    assert "LOAD REPORT" not in text and "UNEXPECTED" not in text, text[-3000:]
    assert "Loading weights" not in text  # transformers' progress bar
    # stderr: ppojax's own word that the tiny checkpoint has no value head to load, nothing else
    assert proc.stderr.splitlines() == [f"ppojax: no v_head.summary.* in {tiny_dirs / 'model'}: value head "
                                        "initialised randomly (seed 0)"], proc.stderr
    log = (out / "libraries.log").read_text()
    assert "LOAD REPORT" in log and "v_head.summary.bias   | UNEXPECTED" in log


def test_a_reward_function_that_returns_text_is_refused_in_one_line(tiny_dirs, tmp_path, cli_env):
    out = tmp_path / "run"
    proc = _train(tiny_dirs, out, cli_env, f"reward_function={MODULE}:text_scores")
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stdout + proc.stderr, proc.stderr[-3000:]
    assert lines[0].startswith(f"ppojax: error: reward function {MODULE}.text_scores returned text, '"), lines[0]
    assert "for prompt index 0" in lines[0] and "scores must be numbers, not strings" in lines[0]
    assert not (out / "checkpoints").exists()  # before the first update
    assert not (out / "metrics.jsonl").exists() or not (out / "metrics.jsonl").read_text()


def test_a_prompt_the_tokenizer_cannot_read_is_refused_before_compute(tiny_dirs, tmp_path, cli_env):
    """The tiny word-level tokenizer encodes words outside its vocabulary as its pad token: a prompt of such words
    carries nothing; refused before anything is compiled, naming the prompt, the share and the fix."""
    prompts = tmp_path / "prompts.jsonl"
    texts = ["the movie was good", "a very bad plot", "zebra quantum", "it is fun"]
    prompts.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in texts))
    compile_cache = tmp_path / "jax_cache"
    compile_cache.mkdir()
    out = tmp_path / "run"
    proc = _train(tiny_dirs, out, {**cli_env, "JAX_COMPILATION_CACHE_DIR": str(compile_cache)}, f"dataset={prompts}")
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stdout + proc.stderr, proc.stderr[-3000:]
    assert lines[0] == ("ppojax: error: prompt 2 ('zebra quantum') encodes to nothing the model can read: 2 of its 2 "
                        "tokens (100%) are the tokenizer's pad ('<pad>', id 0) token and the rest are special tokens. "
                        "Its words are outside the tokenizer's vocabulary: use the tokenizer saved with this model, or "
                        "rewrite or remove the prompt.")
    assert not any(compile_cache.iterdir())  # nothing compiled


def test_library_progress_bars_are_off_during_a_run_and_on_again_after(tmp_path, cli_env):
    """datasets imported before the run: its bars off during it, on after. Not imported before (a fresh process):
    the run does not import it to switch them off (it takes a second), and imported during the run it draws none."""
    import datasets  # noqa: PLC0415 - a second to import: collecting the suite's files would pay it in every worker

    datasets.enable_progress_bars()
    with library_output_to(tmp_path / "libraries.log"):
        assert not datasets.is_progress_bar_enabled()
    assert datasets.is_progress_bar_enabled()
    out = subprocess.run([sys.executable, "-c", BARS_OF_A_LIBRARY_IMPORTED_DURING_A_RUN, str(tmp_path / "fresh.log")],
                         cwd=REPO, env={k: v for k, v in cli_env.items() if k != "HF_DATASETS_DISABLE_PROGRESS_BARS"},
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "bars off", out.stderr[-3000:]


def test_what_a_library_prints_at_import_goes_to_the_runs_file(tmp_path, cli_env):
    """Without torch, importing transformers advises on stderr that its models need it: `ppojax train` (which needs
    only its tokenizers) keeps that in libraries.log, and transformers' own logging reaches stderr again after."""
    log = tmp_path / "libraries.log"
    out = subprocess.run([sys.executable, "-c", TRANSFORMERS_IMPORTED_WHEN_A_RUN_STARTS, str(log)], cwd=REPO,
                         env=cli_env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout == "", out.stderr[-3000:]
    assert out.stderr.splitlines() == ["[transformers] after the run"], out.stderr
    assert "WARNING library_imports: [transformers] PyTorch was not found." in log.read_text()


def test_prompt_readability_against_hand_counted_cases():
    """Unknown and pad tokens among readable ones pass; all unknown / pad (with or without special tokens) is
    refused with its share; a tokenizer with a separate unknown token names it."""
    from ppojax.trainer.data import tokenize_prompts
    from tests.test_models import tiny_tokenizer as tokenizer_with_unk

    tok = tokenizer_with_unk()  # <pad> 0, <s> 1, </s> 2, <unk> 3, and five words
    ids, kept, _ = tokenize_prompts(["the zebra movie", "the movie"], tok, 8, chat_template=False)
    assert ids == [[4, 3, 5], [4, 5]] and kept == [0, 1]
    with pytest.raises(ValueError, match=r"prompt 1 \('zebra quantum'\) encodes to nothing the model can read: 2 of "
                                         r"its 2 tokens \(100%\) are the tokenizer's unknown \('<unk>', id 3\) token"):
        tokenize_prompts(["the movie", "zebra quantum"], tok, 8, chat_template=False)


def test_scores_as_text_are_refused_whatever_holds_them():
    """numpy reads "0.25" as 0.25; check_scores names the text instead, in a list, a numpy string or object array,
    a column of rows, bytes; numbers in the same containers pass."""
    from ppojax.rl.rewards import RewardFunctionError, check_scores

    for scores, index, value in ((["0.25", "0.5"], 0, "'0.25'"), (np.array(["0.25", "0.5"]), 0, "'0.25'"),
                                 ([[0.1], ["0.5"]], 1, "'0.5'"), ((0.1, b"0.5"), 1, "b'0.5'"),
                                 (np.array([0.1, "3"], dtype=object), 1, "'3'")):
        with pytest.raises(RewardFunctionError, match=rf"^reward function f returned text, {value} for prompt index "
                                                      rf"{index} \(.*\); scores must be numbers, not strings"):
            check_scores(scores, 2, name="reward function f")
    for scores in ([0.25, 0.5], np.array([0.25, 0.5]), np.array([[0.25], [0.5]]), (0.25, 0.5)):
        assert check_scores(scores, 2).tolist() == [0.25, 0.5]
    with pytest.raises(RewardFunctionError, match="not a sequence of numbers"):  # words: no number at all
        check_scores(["good", "bad"], 2)
