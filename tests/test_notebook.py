"""examples/ppo_step_by_step.ipynb runs top to bottom in a fresh kernel (nbclient), as a notebook user runs it.

Its cells assert what they show: the policy ratio is 1 on the rollout's own parameters, the compiled step equals the
phases run one by one, a learning-rate change reuses the compiled step, and the vmapped grid compiles once.
"""
import os
from pathlib import Path

import nbformat
from nbclient import NotebookClient

REPO = Path(__file__).resolve().parents[1]
NOTEBOOK = REPO / "examples" / "ppo_step_by_step.ipynb"


def test_the_notebook_is_committed_without_outputs():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    code = [cell for cell in nb.cells if cell.cell_type == "code"]
    assert code and all(not cell.outputs and cell.execution_count is None for cell in code)


def test_the_step_by_step_notebook_runs(monkeypatch):
    from tests.xla_test_flags import CHEAP_COMPILES

    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    monkeypatch.setenv("XLA_FLAGS", f"{os.environ.get('XLA_FLAGS', '')} {CHEAP_COMPILES}")
    nb = nbformat.read(NOTEBOOK, as_version=4)
    NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(REPO)}}).execute()
    text = "\n".join(out.get("text", "") for cell in nb.cells if cell.cell_type == "code" for out in cell.outputs)
    assert "same as step by step: True" in text, text
    assert "compiled programs: 1" in text, text
    assert text.count("seed 1: scores") == 3, text
