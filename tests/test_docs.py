"""The documentation a newcomer reads is true: README's example of the pure functions runs as printed, and every
relative link in README.md, docs/ and benchmarks/README.md leads to a file of the repository."""
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", REPO / "benchmarks" / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def _python_blocks(path: Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", path.read_text(), re.S)


def test_the_readmes_pure_function_example_runs_as_printed():
    block = next(b for b in _python_blocks(REPO / "README.md") if "from ppojax import core" in b)
    done = subprocess.run([sys.executable, "-c", block], cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)})
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
                 for n in names if n in p.read_text() and not (n == "RESULTS.md" and p.name == "README.md"
                                                               and p.parent.name == "benchmarks")]
    assert not offenders, offenders
    assert not [p for p in REPO.joinpath("ppojax").rglob("*.py") if re.search(r"\bSPEC\b", p.read_text())]


def test_the_configuration_reference_is_current():
    """docs/configuration.md is generated from PPOConfig's fields; regenerate it with
    `python -m ppojax.trainer.config > docs/configuration.md` after changing a field."""
    from ppojax.trainer.config import configuration_markdown

    assert (REPO / "docs" / "configuration.md").read_text() == configuration_markdown()
