"""The packages' imports flow one way (docs/architecture.md): core <- models <- rl <- trainer; io, parallel and
assets are leaves reached from above; backends implement the models' seam and are reached only from the trainer,
through `ppojax.backends` itself (never a backend's own package); errors is imported by all and imports nothing;
the library never imports the repository's `benchmarks`; no module imports another's private names. Below the
trainer nothing tests the platform or keeps per-trace state in context variables: every backend choice is made
when a run is built. Read from the source (every import, inside functions too), so an import added anywhere is
checked."""
import ast
import io
import re
import tokenize
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "ppojax"

#: package -> the packages its modules may import
ALLOWED = {
    "errors": set(),
    "core": {"errors"},
    "models": {"core", "io", "parallel", "errors"},
    "rl": {"core", "models", "parallel", "host", "errors"},
    "trainer": {"core", "models", "rl", "parallel", "io", "assets", "backends", "tasks", "agents", "host", "errors"},
    "io": {"errors"},
    "parallel": {"errors"},
    "assets": {"io", "errors"},
    "tasks": {"agents", "io", "errors"},
    "agents": {"host", "errors"},
    "host": {"errors"},
    # a backend implements the models' seam (`ppojax.models.kernels.Kernels`); nothing below imports a backend
    "backends": {"models", "io", "parallel", "errors"},
}
#: (module, package it imports) pairs outside ALLOWED that remain; each must still be real, so the list can only
#: shrink
KNOWN_EXCEPTIONS = set()


def _package(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _imports(path: Path):
    """(imported ppojax module) for every import statement of ``path``, wherever it stands."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and node.module.startswith("ppojax"):
            if node.module == "ppojax":
                yield from (f"ppojax.{alias.name}" for alias in node.names)
            else:
                yield node.module
        elif isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names if alias.name.startswith("ppojax"))


def _modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        yield ".".join(parts[:-1] if parts[-1] == "__init__" else parts), path


def test_imports_flow_one_way():
    edges = set()
    for module, path in _modules():
        source = _package(module)
        if source == "":  # ppojax/__init__.py: the public names, from anywhere
            continue
        for imported in _imports(path):
            target = _package(imported)
            if target and target != source:
                edges.add((module, target))
    wrong = sorted((m, t) for m, t in edges if t not in ALLOWED[_package(m)] and (m, t) not in KNOWN_EXCEPTIONS)
    assert not wrong, f"imports against the layering (module, package it imports): {wrong}"
    stale = KNOWN_EXCEPTIONS - edges
    assert not stale, f"no longer imported: remove from KNOWN_EXCEPTIONS: {sorted(stale)}"


def test_every_module_belongs_to_a_package():
    """Only ppojax/__init__.py (the public names) and errors.py sit at the top; every other module is in one of
    the packages above, and every package is named in ALLOWED."""
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert top == ["__init__.py", "errors.py"]
    packages = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()}
    assert packages == set(ALLOWED) - {"errors"}


def test_no_module_takes_another_module_s_private_names():
    """A name with a leading underscore is its module's own: where another module needs it, it has a public name
    (what a module offers the others is what it does not hide)."""
    taken = [f"{module} takes {node.module}.{alias.name}" for module, path in _modules()
             for node in ast.walk(ast.parse(path.read_text()))
             if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("ppojax")
             for alias in node.names if alias.name.startswith("_") and not alias.name.startswith("__")]
    assert taken == []


def test_errors_are_one_family_importable_where_they_are_raised():
    """One errors module; the classes keep the names the layers raise them under."""
    from ppojax import errors
    from ppojax.backends.cpu.capabilities import CpuFeatureMissing
    from ppojax.io.checkpoint import CheckpointError
    from ppojax.io.export_dir import ExportDirError
    from ppojax.io.run_dir import RunDirError
    from ppojax.models.errors import ModelLoadError, UnsupportedModelError
    from ppojax.rl.rewards import RewardFunctionError
    from ppojax.trainer.config import ConfigError

    assert (ConfigError, RunDirError, ModelLoadError, UnsupportedModelError, CheckpointError, ExportDirError,
            RewardFunctionError, CpuFeatureMissing) == (
        errors.ConfigError, errors.RunDirError, errors.ModelLoadError, errors.UnsupportedModelError,
        errors.CheckpointError, errors.ExportDirError, errors.RewardFunctionError, errors.CpuFeatureMissing)
    assert issubclass(errors.RunDirError, errors.ConfigError)  # the CLI's exit 2 for both


#: the layers below the trainer, which must hold no backend logic: the backends reach them through the seam
#: (`ppojax.models.kernels.Kernels`, `ppojax.rl.optimizer.OptaxStep`), chosen when a run is built
BACKEND_FREE = ("core", "models", "rl")
#: code (not comments or docstrings) that would be backend logic there: a platform test, a custom call, a library
BACKEND_LOGIC = re.compile(r"\.\s*platform\b|default_backend\s*\(|jax\s*\.\s*ffi|onednn|\bmkl\b|mimalloc|\bcpu\b",
                           re.IGNORECASE)
#: modules below the trainer allowed backend logic: none (attention's choice of cuDNN is the GPU backend's)
KNOWN_PLATFORM_TESTS = set()


def _code_without_comments_or_strings(path: Path) -> str:
    kept = []
    for token in tokenize.generate_tokens(io.StringIO(path.read_text()).readline):
        if token.type not in (tokenize.COMMENT, tokenize.STRING):
            kept.append(token.string)
    return " ".join(kept)


def test_no_backend_logic_below_the_trainer():
    """The models, the RL programs and the math run the same code on every backend: no platform test, no custom
    call, no CPU library named in their code. The test reads the code itself, so it fails where one is added."""
    found = {}
    for module, path in _modules():
        if _package(module) in BACKEND_FREE and module not in KNOWN_PLATFORM_TESTS:
            hits = BACKEND_LOGIC.findall(_code_without_comments_or_strings(path))
            if hits:
                found[module] = sorted(set(hits))
    assert not found, f"backend logic below the trainer (move it behind ppojax.backends' seam): {found}"
    for module in KNOWN_PLATFORM_TESTS:
        path = PACKAGE.parent / (module.replace(".", "/") + ".py")
        assert BACKEND_LOGIC.search(_code_without_comments_or_strings(path)), f"{module}: no longer; remove it"


#: what below the trainer would make a choice while tracing: state that no jit cache key holds
PER_TRACE_STATE = re.compile(r"\bcontextvars\b|\bContextVar\b|\bthreading\s*\.\s*local\b")


def test_nothing_below_the_trainer_decides_while_tracing():
    """No context variable (or thread-local) in the math, the models or the RL programs: a choice read from one
    while a program is traced is part of no jit cache key. Choices reach the programs as data (the models'
    `Kernels`, the program's settings)."""
    found = [module for module, path in _modules() if _package(module) in BACKEND_FREE
             and PER_TRACE_STATE.search(_code_without_comments_or_strings(path))]
    assert not found, f"per-trace state below the trainer (pass the choice as data instead): {found}"


def test_the_library_never_imports_the_benchmarks():
    """`benchmarks/` is the repository's harness, not part of the installed package: importing it from ppojax
    would behave differently from a wheel."""
    found = []
    for module, path in _modules():
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([alias.name for alias in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else [])
            found += [(module, name) for name in names if name.split(".")[0] == "benchmarks"]
    assert not found, f"ppojax imports the benchmarks: {found}"


def test_backend_code_is_reached_only_through_ppojax_backends():
    """Outside `ppojax/backends/`, a backend's own package (`ppojax.backends.cpu`, `.gpu`) is never imported: the
    trainer asks `ppojax.backends` (one door), which makes the choice."""
    found = sorted((module, imported) for module, path in _modules() if _package(module) != "backends"
                   for imported in _imports(path)
                   if imported.startswith("ppojax.backends.") or _from_backends_import_a_package(path))
    assert not found, f"imports of a backend's own package outside ppojax/backends (ask ppojax.backends): {found}"


def _from_backends_import_a_package(path: Path) -> bool:
    """``from ppojax.backends import cpu`` (a backend package by name)."""
    return any(isinstance(node, ast.ImportFrom) and node.module == "ppojax.backends"
               and any(alias.name in ("cpu", "gpu") for alias in node.names)
               for node in ast.walk(ast.parse(path.read_text())))


#: the array libraries the tests and benchmarks import at the top of a file, never inside a function
ARRAY_LIBRARIES = ("jax", "numpy", "flax")
#: (file, function) importing one inside a function anyway, each with its reason; each must still do so
LAZY_ARRAY_IMPORTS = {
    # runs in .venv-bench too (benchmarks/run.py's TRL interpreter), which has torch and no jax
    ("benchmarks/peak.py", "measure_jax"),
    # also runs where jax cannot be imported (test_config_errors.py's refusals before any heavy library)
    ("tests/cli_refusals.py", "run_cases"),
    # imported by tests/conftest.py at its top, before the ISA cap and the TPU skip set the environment JAX reads
    ("tests/lowering_contexts.py", "share_lowering_contexts"),
}


def _array_imports_inside_functions(path: Path):
    """(innermost function's name, imported module) for every import of an ARRAY_LIBRARIES module inside a
    function of ``path``."""
    def visit(node, function):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield from visit(child, child.name)
                continue
            if function is not None:
                modules = ([alias.name for alias in child.names] if isinstance(child, ast.Import)
                           else [child.module] if isinstance(child, ast.ImportFrom) and child.level == 0 else [])
                yield from ((function, m) for m in modules if m.split(".")[0] in ARRAY_LIBRARIES)
            yield from visit(child, function)

    yield from visit(ast.parse(path.read_text()), None)


def test_tests_and_benchmarks_import_jax_and_numpy_at_the_top():
    """tests/ and benchmarks/ import jax, numpy and flax where a reader looks for them: at the top of the file (ruff
    lets them import other things lazily). ``XLA_FLAGS`` set by a test or a benchmark needs no lazy import: XLA
    reads it when JAX starts its backend, not when jax is imported."""
    found = {(str(path.relative_to(PACKAGE.parent)), function)
             for folder in ("tests", "benchmarks") for path in sorted((PACKAGE.parent / folder).rglob("*.py"))
             for function, _ in _array_imports_inside_functions(path)}
    lazy = sorted(found - LAZY_ARRAY_IMPORTS)
    assert not lazy, f"jax/numpy/flax imported inside a function (move it to the file's top): {lazy}"
    stale = LAZY_ARRAY_IMPORTS - found
    assert not stale, f"no longer imported inside the function: remove from LAZY_ARRAY_IMPORTS: {sorted(stale)}"
