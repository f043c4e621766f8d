"""The documentation a newcomer reads is true: README's example of the pure functions runs as printed, and every
relative link in README.md, docs/ and benchmarks/README.md leads to a file of the repository."""
import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", REPO / "benchmarks" / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def _python_blocks(path: Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", path.read_text(), re.S)


def _readers_environment(home=None) -> dict:
    """A reader's bare environment (none of the suite's variables but these) and install (ppojax's dependencies,
    without the tests' torch: tests/without_torch), with the suite's XLA flags (its compiles without LLVM's
    optimisation: tests/xla_test_flags.py), its compilation cache and its per-machine cache (ppojax's C++ handlers
    built once), which the examples share with the rest of the suite."""
    env = {"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin",
           "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests" / "without_torch")])}
    if home is not None:
        env["HOME"] = str(home)
    env.update({name: os.environ[name] for name in ("XLA_FLAGS", "JAX_COMPILATION_CACHE_DIR", "XDG_CACHE_HOME")
                if name in os.environ})
    return env


def test_the_readmes_pure_function_example_runs_as_printed():
    block = next(b for b in _python_blocks(REPO / "README.md") if "from ppojax import core" in b)
    done = subprocess.run([sys.executable, "-c", block], cwd=REPO, capture_output=True, text=True, timeout=300,
                          env=_readers_environment())
    assert done.returncode == 0, done.stderr[-2000:]
    assert re.fullmatch(r"loss -?\d+\.\d{4}, clip fraction \d\.\d{2}\n", done.stdout), done.stdout


def test_every_relative_link_leads_to_a_file():
    missing = []
    for doc in DOCS:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", doc.read_text()):
            if re.match(r"[a-z]+://", target):
                continue
            if not (doc.parent / target).exists():
                missing.append(f"{doc.relative_to(REPO)} -> {target}")
    assert not missing, missing


def test_no_document_cites_a_file_users_do_not_have():
    """The project's own words only: no citation of the developers' reference files."""
    names = ("SPEC.md", "DESIGN.md", "ASSETS.md", "ACCELERATORS.md", "RESULTS.md")
    offenders = [f"{p.relative_to(REPO)}: {n}" for p in [*DOCS, *REPO.joinpath("ppojax").rglob("*.py")]
                 for n in names if n in p.read_text()]
    assert not offenders, offenders
    assert not [p for p in REPO.joinpath("ppojax").rglob("*.py") if re.search(r"\bSPEC\b", p.read_text())]


def test_the_configuration_reference_is_current():
    """docs/configuration.md is generated from PPOConfig's fields; regenerate it with
    `python -m ppojax.trainer.config > docs/configuration.md` after changing a field."""
    from ppojax.trainer.config import configuration_markdown

    assert (REPO / "docs" / "configuration.md").read_text() == configuration_markdown()


#: what the python blocks of a document presuppose from the text around them, run before the block with that
#: index ({document: {block index: code}}); "{tiny}" is a tiny checkpoint directory and prompt file. Every block of
#: README.md and docs/ runs (the pure-function example above on its own too), in order, one process per document.
GIVENS = {
    "README.md": {
        1: "import numpy as np\nquery_token_ids = [np.asarray(ids) for ids in trainer.tokenizer(['the movie was', "
           "'it is not'] * 8)['input_ids']]\nscores = [0.5] * 16\n",
    },
    "docs/cpu_backend.md": {
        0: "from flax import nnx\nfrom tests.tiny_setup import tiny_policy\nmodel = tiny_policy()\n",
    },
    "docs/scaling.md": {
        0: "import jax\nfrom ppojax import PPOConfig\nfrom ppojax.trainer.build import build_run\n"
           "config = PPOConfig(model_name_or_path='{tiny}/model', dataset='{tiny}/prompts.jsonl', batch_size=16, "
           "response_length=8, max_prompt_length=6, reward_function='tests.test_cli:good_fraction', "
           "output_dir='run')\nrun = build_run(config)\nparams, optimizer, ppo_program = run.state.params, "
           "run.program.optimizer, run.program\n"
           "my_rows_of_prompts = next(run.batches).input_ids\nkey = jax.random.key(0)\nlog = print\n"
           "params, frozen = jax.tree.map(jax.numpy.copy, (params, run.state.frozen))  # the run's state owns its "
           "buffers\n",
    },
}
#: README's trainer example names a checkpoint directory the reader has: the test gives the tiny one, whose
#: word-level tokenizer knows a few lower-case words only
REPLACE = {"README.md": {'"path/to/hf_checkpoint"': '"{tiny}/model"',
                         '["The movie was", "I think that"]': '["the movie was", "it is not"]'}}


def test_every_python_example_in_the_documents_runs(tmp_path):
    from tests.tiny_setup import write_tiny_run_inputs

    tiny = write_tiny_run_inputs(tmp_path / "tiny")
    documents = [p for p in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))] if _python_blocks(p)]
    assert {str(p.relative_to(REPO)) for p in documents} >= set(GIVENS)
    for path in documents:
        name = str(path.relative_to(REPO))
        script = []
        for index, block in enumerate(_python_blocks(path)):
            for old, new in REPLACE.get(name, {}).items():
                block = block.replace(old, new)
            script.append(GIVENS.get(name, {}).get(index, "") + block)
        code = "\n".join(script).replace("{tiny}", str(tiny))
        done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True,
                              timeout=600, env=_readers_environment(tmp_path))
        assert done.returncode == 0, f"{name}:\n{done.stderr[-3000:]}"
