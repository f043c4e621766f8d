"""docs/scaling.md's TPU plan table is current (benchmarks/plan_table.py): the table is its rows' stored compiles,
each model's chosen slice and mesh is the best of those tried, and, on request, the 1B rows compiled again by the
TPU compiler give the table's numbers (PPOJAX_TESTS_PLAN_TABLE=1, `make test-plan-table`: minutes per row)."""

import pytest

from benchmarks import plan_table
from ppojax.trainer.plan_targets import libtpu_version, tpu_compiler_installed
from tests.xla_test_flags import switched_on

RECOMPILE = switched_on("PPOJAX_TESTS_PLAN_TABLE")


def _block(start, end):
    text = plan_table.DOC.read_text()
    return text[text.index(start) + len(start):text.index(end)].strip()


def test_the_table_is_its_rows_stored_compiles():
    assert all(plan_table.stored(row)[0] is not None for row in plan_table.ROWS), "a row was never compiled"
    assert _block(plan_table.START, plan_table.END) == plan_table.render_table(), (
        "docs/scaling.md's plan table differs from benchmarks/plans_tpu/: python -m benchmarks.plan_table --render")
    assert _block(plan_table.SEARCH_START, plan_table.SEARCH_END) == plan_table.render_search()
    assert all(plan_table.stored(row)[0] is not None for row in plan_table.LONG_ROWS)
    assert _block(plan_table.LONG_START, plan_table.LONG_END) == plan_table.render_table(plan_table.LONG_ROWS)


def test_every_accepted_tpu_compile_has_the_compilers_peak():
    rows = [*plan_table.ROWS, *plan_table.LONG_ROWS, *plan_table.candidate_rows()]
    assert not [row.key for row in rows if plan_table.stale(plan_table.stored(row)[0])]


def test_each_chosen_mesh_is_the_best_of_those_tried():
    for (size, lora), chosen in plan_table.CHOSEN.items():
        assert chosen in plan_table.CANDIDATES[(size, lora)]
        assert plan_table.best_candidate(size, lora) == chosen, (size, lora)


@pytest.mark.slow
@pytest.mark.skipif(not RECOMPILE, reason="recompiles the 1B rows with libtpu (minutes each): make test-plan-table")
@pytest.mark.skipif(not tpu_compiler_installed(), reason="libtpu is not installed: pip install 'ppojax[tpu]'")
@pytest.mark.parametrize("row", [r for r in plan_table.ROWS if r.size == "1b"], ids=lambda r: r.key)
def test_the_1b_rows_compile_to_the_table(row, tmp_path):
    table_plan, _ = plan_table.stored(row)
    assert table_plan["compiler"] == f"libtpu {libtpu_version()}", (
        f"the table was compiled by {table_plan['compiler']}, this is libtpu {libtpu_version()}: install the tpu "
        "extra's libtpu, or regenerate the table (python -m benchmarks.plan_table)")
    fresh = plan_table.compile_row(row, out=tmp_path / "plan.json")
    assert plan_table.tpu_cells(fresh) == plan_table.tpu_cells(table_plan), (
        f"{row.key}: the TPU compiler's numbers moved; regenerate: python -m benchmarks.plan_table --rows {row.size}")
