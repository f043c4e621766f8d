import os
import tempfile

import torch

torch.set_num_threads(1)

# PPOTrainer turns on JAX's persistent compilation cache ('auto'); keep the tests' entries out of the
# user's ~/.cache, in one directory per test session (subprocesses, e.g. the CLI tests, inherit it).
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", tempfile.mkdtemp(prefix="ppojax-tests-xla-"))
