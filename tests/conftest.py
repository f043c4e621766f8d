import atexit
import os
import shutil
import tempfile

import torch

from tests.xla_test_flags import use_cheap_compiles

torch.set_num_threads(1)
use_cheap_compiles()  # before jax starts its backend: the suite's compiles without LLVM's optimisation

# PPOTrainer turns on JAX's persistent compilation cache ('auto'); keep the tests' entries out of the
# user's ~/.cache, in one directory per test session (xdist workers and subprocesses, e.g. the CLI tests,
# inherit it). The process that made it removes it at exit.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="ppojax-tests-xla-")
    atexit.register(shutil.rmtree, os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)
