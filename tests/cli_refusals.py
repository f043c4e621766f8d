"""Runs several `ppojax` argument lists through the CLI's ``main`` in ONE fresh process and records, per list, the
exit code and what was printed (and, with --count-compiles, the XLA compiles it asked for):

    python -m tests.cli_refusals CASES.json RESULTS.json [--count-compiles]

CASES.json: ``{name: [arg, ...]}``; RESULTS.json: ``{name: {"code", "stdout", "stderr", "compiles"}}``. The tests
that use it assert for every list that it is refused: exit code 2, one message, no traceback, and nothing compiled
(tests/test_trust.py) or no heavy library imported (tests/test_config_errors.py, which makes them unimportable). A
refused list leaves nothing behind in the process: no compiled program, no imported library. So while every list is
refused, each one starts as a fresh `ppojax` process would, and one process stands for one per list.
A compile request counts whether XLA compiles or a cache answers it.
"""
from __future__ import annotations

import contextlib
import io
import json
import sys
import traceback
from pathlib import Path

from ppojax.trainer.cli import main

#: what JAX records around every compile request (jax/_src/dispatch.py's BACKEND_COMPILE_EVENT)
COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


def run_cases(cases: dict[str, list[str]], count_compiles: bool) -> dict[str, dict]:
    compiles = []
    if count_compiles:
        import jax  # noqa: PLC0415 - optional here: the config-error lists run where jax cannot be imported

        jax.monitoring.register_event_duration_secs_listener(
            lambda event, duration, **kwargs: compiles.append(kwargs.get("fun_name")) if event == COMPILE_EVENT
            else None)
    results = {}
    for name, args in cases.items():
        compiles.clear()
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(args)
            except BaseException as exc:  # reported, not raised: the other lists still run
                traceback.print_exc()
                code = f"raised {type(exc).__name__}"
        results[name] = {"code": code, "stdout": out.getvalue(), "stderr": err.getvalue(),
                         "compiles": list(compiles)}
    return results


if __name__ == "__main__":
    cases_path, results_path, *options = sys.argv[1:]
    results = run_cases(json.loads(Path(cases_path).read_text()), count_compiles="--count-compiles" in options)
    Path(results_path).write_text(json.dumps(results, indent=1))
