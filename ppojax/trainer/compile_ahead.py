"""Compiling ``train_step`` while the weights load.

The compiled PPO program depends on the models' structure (graphdefs, weight shapes, dtypes, shardings), the
settings and the batch's shape, not on the weights. The checkpoints' configs and tensor names give that
structure before any weight is read (``ppojax.models.abstract_pretrained``), so ``build_run`` forms the
models abstractly first, makes the program and its ``train_step``, and lowers and compiles it on a background
thread while the main thread loads the weights. XLA's compile releases the GIL, and jit keeps the executable
that ``jitted.lower(abstract arguments).compile()`` made: the first real call, with arguments of those
shapes, dtypes and shardings, runs it instead of compiling.

The step returned waits for the thread at its first call (a call while the compile runs would start a second
one). Everything here is a head start only: if the abstract models cannot be formed, the thread's compile
fails, or the loaded models' structure differs from the guess, the run is built as without it and the first
call compiles.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import jax
import numpy as np

from ppojax import parallel
from ppojax.rl.program import make_train_step, place_inputs
from ppojax.rl.types import init_train_state

log = logging.getLogger(__name__)


@dataclass
class CompileAhead:
    """A ``train_step`` compiling on a background thread. seconds: the thread's lowering and compile time
    (None until it ends); error: what stopped it (None: compiled or still running)."""

    program: Any
    train_step: Optional[Callable] = None
    thread: Optional[threading.Thread] = field(default=None, repr=False)
    seconds: Optional[float] = None
    error: Optional[BaseException] = None

    def wait(self) -> "CompileAhead":
        self.thread.join()
        return self


def start_train_step(program, params, frozen, *, hyperparams, kl_coef: float, prompts_shape: tuple,
                     in_flight=None) -> CompileAhead:
    """``make_train_step(program, shardings)`` with its compile started on a background thread, for the
    ``TrainState`` of ``params`` / ``frozen`` (``jax.ShapeDtypeStruct`` trees, e.g. the states of
    ``abstract_pretrained`` models; the state ``init_sharded_train_state`` makes from their arrays) and prompts
    i32[prompts_shape] (this process's rows, placed as the step places them); in_flight: an asynchronous run's
    queue shapes (``init_train_state``'s). -> ``CompileAhead``, whose ``train_step`` is the step to call with the
    real state."""
    state = jax.eval_shape(lambda p, f: init_train_state(p, program.optimizer, hyperparams=hyperparams, frozen=f,
                                                         kl_coef=kl_coef, in_flight=in_flight), params, frozen)
    state_shardings = parallel.train_state_shardings(state, program.mesh)
    state = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s, weak_type=x.weak_type),
                         state, state_shardings)
    step = make_train_step(program, state_shardings)
    prompts, key = place_inputs(program, np.zeros(prompts_shape, np.int32), jax.random.key(0))
    ahead = CompileAhead(program)

    def compile_step():
        start = time.perf_counter()
        try:
            step.jitted.lower(state, prompts, key).compile()
            ahead.seconds = time.perf_counter() - start
        except Exception as err:  # noqa: BLE001 - the first real call compiles again and raises it there
            ahead.error = err
            log.info("train_step not compiled ahead: %s: %s", type(err).__name__, err)

    def train_step(state, prompts, key):
        ahead.wait()
        return step(state, prompts, key)

    train_step.jitted = step.jitted
    train_step.compile_ahead = ahead
    ahead.train_step = train_step
    # not a daemon: an interpreter exiting mid-compile waits for it rather than tearing XLA down under it
    ahead.thread = threading.Thread(target=compile_step, name="ppojax-compile-ahead")
    ahead.thread.start()
    return ahead
