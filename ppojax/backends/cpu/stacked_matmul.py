"""Projections that read ONE layer's weights where they lie in a stacked kernel: oneDNN's GEMM through jax.ffi (CPU).

Under the layer scan XLA:CPU hands a dot whole buffers, so every layer call first copies its weights out of the
stacked `[L, ...]` kernels (a `dynamic-slice`: forward, backward and every decode step) and XLA has no dot that
reads a slice in place on the CPU. `matmul(x, stack, layer)` computes
`x @ stack[layer]` with oneDNN's float32 GEMM (`dnnl_sgemm`, from the `onednn-cpu-gomp` wheel) called as an XLA
FFI custom call on a pointer into the stack: no copy. Its VJP: the input gradient by the same kernel, reading the
layer transposed in place; the weight gradient `x.T @ g` by oneDNN into a layer-sized buffer, written into the
stacked gradient at `layer` (a dynamic-update-slice into zeros, which XLA folds into the scan's in-place
accumulation of the stack's cotangent). Values: float32 GEMMs as XLA's, summed in another order.
At a decode step's few rows (`few_rows_limit`) the handlers multiply with kernels of their own, which read each
weight once (AVX-512 or AVX2 CPUs): there a product is bound by reading the weights, and the libraries, which pack
them first, were slower than XLA's copy-then-dot.

The LM head's product too (`matmul_transposed` for a tied head: the hidden states times the embedding `[V, D]`
read transposed where it lies; an untied head's kernel `[D, V]` as a one-layer stack), at an update's rows.

The same handlers on MKL's GEMM (`matmul_implementation: mkl`, the library `"mkl"`): MKL as torch's x86 wheels link
it into `libtorch_cpu.so` (its Fortran `sgemm_`), the GEMM TRL's step runs; for CPUs where MKL outruns oneDNN at a
model's shapes. "auto" takes, for each projection shape and each of its three products (forward, input gradient,
weight gradient), the library measured fastest for it on the CPU it runs on (chosen by `matmul_tuning.py`, which
measures once per CPU and shape and records in `matmul_record.py`'s file); the libraries share one OpenMP runtime
(`libgomp.so.1`).

The handlers (`stacked_gemm.cc`) are compiled on first use with the system's C++ compiler against the library's
file (the wheel's `libdnnl.so.3`, or torch's `libtorch_cpu.so`), once per source, library and jaxlib, into
`$XDG_CACHE_HOME/ppojax/ffi` (`ppojax.backends.cpu.ffi.build`); a library already there (built before, or prebuilt for a
machine without a compiler) is taken as it is.
:func:`unavailable_reason` says why not where they cannot be had (not Linux x86-64, no wheel, no compiler, a
failed build); the models then keep XLA's dots (the models' `matmul_implementation`: "auto", "xla", "onednn" or
"mkl").
"""
from __future__ import annotations

import ctypes
import functools
import platform
import threading
from concurrent.futures import ThreadPoolExecutor
from importlib import metadata
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from ppojax.backends.cpu import capabilities
from ppojax.backends.cpu.ffi.build import build_cached
from ppojax.backends.cpu.matmul_record import Libraries

SOURCE = Path(__file__).parent / "ffi" / "stacked_gemm.cc"
#: the GEMM libraries the handlers can be built on ("auto" takes the one measured fastest on this CPU),
#: each the compiler define choosing it in `stacked_gemm.cc`; each is also a `matmul_implementation` of its own
LIBRARIES = {"onednn": (), "onednn_primitive": ("-DPPOJAX_ONEDNN_PRIMITIVE",), "mkl": ("-DPPOJAX_FORTRAN_SGEMM",)}
LIBRARY_NAMES = {"onednn": "oneDNN's sgemm", "onednn_primitive": "oneDNN's matmul primitive", "mkl": "MKL's sgemm"}
PRODUCT_NAMES = {"fwd": "the forward products", "dx": "the input gradients", "dw": "the weight gradients"}
IMPLEMENTATIONS = ("auto", "xla", *LIBRARIES)  # ppojax.trainer.config.MATMUL_IMPLEMENTATIONS spells the same (jax-free)
#: "auto" takes oneDNN from these sizes on: a layer's projection kernels of at least this many elements (below, the
#: copy it saves is small and a custom call's fixed cost larger: the tiny benchmark model ran slower through it) and
#: calls of at least this many token rows (below, a GEMM library is slower than XLA's dot, copy included), or of at
#: most `few_rows_limit` rows (a decode step's, which the handlers' own kernels multiply)
AUTO_MIN_LAYER_ELEMENTS = 1 << 20
AUTO_MIN_ROWS = 64
WHEEL = "onednn-cpu-gomp"
#: the FFI targets of each library's handlers
TARGETS = {"onednn": {"matmul": "ppojax_stacked_matmul", "weight_grad": "ppojax_weight_grad"},
           "onednn_primitive": {"matmul": "ppojax_stacked_matmul_primitive",
                                "weight_grad": "ppojax_weight_grad_primitive"},
           "mkl": {"matmul": "ppojax_stacked_matmul_mkl", "weight_grad": "ppojax_weight_grad_mkl"}}
#: the name remat's "dots" policy saves a projection's output by (a custom call is not a dot to jax.checkpoint)
SAVED_NAME = "stacked_projection"

Array = jax.Array


def onednn_library() -> Path | None:
    """The ``libdnnl.so.3*`` of the installed ``onednn-cpu-gomp`` wheel, or None."""
    try:
        files = metadata.distribution(WHEEL).files or []
    except metadata.PackageNotFoundError:
        return None
    for f in files:
        if f.name.startswith("libdnnl.so.3"):
            return Path(f.locate()).resolve()
    return None


def mkl_library() -> Path | None:
    """torch's ``libtorch_cpu.so``, where torch's x86 wheels link MKL in (exporting its BLAS, ``sgemm_``), or None
    (no torch installed). Found without importing torch."""
    try:
        files = metadata.distribution("torch").files or []
    except metadata.PackageNotFoundError:
        return None
    for f in files:
        if f.name == "libtorch_cpu.so":
            return Path(f.locate()).resolve()
    return None


def buildable_libraries() -> tuple:
    """The libraries whose handlers are built here (building them first where needed), none of them loaded: a library
    is loaded (and its runtime mapped into the process: torch's, for MKL) only where it is measured or taken."""
    build_all_handlers()
    with _lock:
        return tuple(lib for lib in LIBRARIES if _built(lib)[0] is not None)



_lock = threading.Lock()  # a compile_ahead thread and the main thread may both ask first


def _library_file(library: str) -> tuple[Path | None, str]:
    """(the file the handlers of `library` link against, "") or (None, how to get it)."""
    if library == "mkl":  # every other library is oneDNN's
        found = mkl_library()
        return found, "" if found else "MKL is read from torch's x86 wheel, and torch is not installed " \
                                        "(pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu)"
    found = onednn_library()
    return found, "" if found else f"the {WHEEL} wheel is not installed (pip install {WHEEL}==2023.2.0)"


@functools.cache
def _built(library: str = "onednn") -> tuple[Path | None, str]:
    """(the compiled handlers on `library`, "") or (None, why not). Built once per process and library at most."""
    off = capabilities.backend_off()
    if off:
        return None, off
    cpu = capabilities.probe()
    if platform.system() != "Linux" or not cpu.has("x86_64"):
        return None, f"the GEMM libraries' wheels are for Linux x86-64 (this is {platform.system()} " \
                     f"{platform.machine()})"
    file, why = _library_file(library)
    if file is None:
        return None, why
    # a build may be carried prebuilt to a machine without a compiler. The few-rows kernels stop at the
    # instruction sets the probe reports (a cap included).
    return build_cached(SOURCE, f"ppojax's handlers on {LIBRARY_NAMES[library]}", file, build_flags(library, cpu))


def build_flags(library: str, cpu=None) -> tuple[str, ...]:
    """The compiler flags of `library`'s handlers on `cpu` (default: the probe's): the library's defines, and the
    few-rows kernels kept within the CPU's instruction sets."""
    return LIBRARIES[library] + capabilities.build_defines(cpu)


_FEW_ROWS: dict = {}  # library -> the most rows its handlers' few-rows kernels take on this CPU (once registered)


def few_rows_limit(library: str) -> int:
    """The most token rows `library`'s handlers multiply with their few-rows kernels on this CPU, reading each weight
    once where it lies (`stacked_gemm.cc`: a decode step's products, bound by reading the weights; AVX-512 or AVX2
    CPUs); 0 where they cannot (no such kernels here, or the handlers cannot be had)."""
    return 0 if unavailable_reason(library) else _FEW_ROWS[library]


@functools.cache
def _registered(library: str = "onednn") -> str:
    """Register `library`'s handlers with XLA once; "" when done, else why they are unavailable."""
    handlers_file, why = _built(library)
    if handlers_file is None:
        return why
    try:  # ctypes resolves every symbol now: a library without the GEMM (e.g. torch without MKL) fails here
        handlers = ctypes.cdll.LoadLibrary(str(handlers_file))
    except OSError as err:  # e.g. the wheel's libdnnl removed since the build
        return f"loading {handlers_file} failed ({err})"
    targets = TARGETS[library]
    _FEW_ROWS[library] = int(handlers.FewRowsKernels())
    jax.ffi.register_ffi_target(targets["matmul"], jax.ffi.pycapsule(handlers.StackedMatmul), platform="cpu")
    jax.ffi.register_ffi_target(targets["weight_grad"], jax.ffi.pycapsule(handlers.WeightGradOut), platform="cpu")
    return ""


def build_all_handlers() -> None:
    """Build every library's handlers at once (each a compiler process; "auto" measures all that can be had)."""
    with _lock, ThreadPoolExecutor(len(LIBRARIES)) as pool:
        list(pool.map(_built, LIBRARIES))


def unavailable_reason(library: str = "onednn") -> str:
    """"" when `library`'s handlers are registered (building them if needed), else why they cannot be."""
    with _lock:
        return _registered(library)


def check_implementation(implementation: str) -> None:
    """Raise a clear `ValueError` unless `implementation` is one of `IMPLEMENTATIONS`."""
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"matmul_implementation={implementation!r} is not one of {IMPLEMENTATIONS}: 'auto' "
                         f"multiplies float32 layer kernels in place with oneDNN on a single CPU device where it can "
                         f"be had, 'xla' keeps XLA's dots, 'onednn' insists on oneDNN's sgemm, 'onednn_primitive' "
                         f"takes oneDNN's matmul primitive, 'mkl' MKL's sgemm (torch's)")


def kernel_shapes(kernels) -> tuple:
    """The distinct `(d_in, d_out)` of stacked layer kernels ([L, d_in, d_out] each), in order."""
    return tuple(dict.fromkeys((int(k.shape[1]), int(k.shape[2])) for k in kernels))


def _gemm(a: Array, stack: Array, layer: Array, transpose: bool, library: str) -> Array:
    n = stack.shape[1] if transpose else stack.shape[2]
    # vmap (e.g. seeds vmapped over, examples/vmap_seeds.py) runs the call once per batch element
    call = jax.ffi.ffi_call(TARGETS[library]["matmul"], jax.ShapeDtypeStruct((a.shape[0], n), jnp.float32),
                            vmap_method="sequential")
    return call(a, stack, layer, transpose_w=np.int64(transpose))


def matmul(x: Array, stack: Array, layer: Array, library: str | Libraries = "onednn") -> Array:
    """x f32[N, K] @ stack[layer] -> f32[N, M] for stack f32[L, K, M] and layer i32[] (in range; checked by the
    handler), by `library`'s GEMM (a key of `LIBRARIES`), or by each product's library (`Libraries`: the forward,
    and in the VJP the input and weight gradients). Call :func:`unavailable_reason` first for each (it registers the
    handlers). The product carries the name remat's "dots" policy saves (outside the custom VJP, where
    jax.checkpoint sees it)."""
    libraries = library if isinstance(library, Libraries) else Libraries.every(library)
    return checkpoint_name(_product(x, stack, layer, libraries, False), SAVED_NAME)


def matmul_transposed(x: Array, stack: Array, layer: Array, library: str | Libraries = "onednn") -> Array:
    """x f32[N, M] @ stack[layer].T -> f32[N, K] for stack f32[L, K, M] (a tied LM head: the hidden states times
    the embedding [V, D], read in place), by each product's library as :func:`matmul` measures them for the shape
    (K, M): this product is that shape's input-gradient kind (`libraries.dx`), its input gradient `g @ stack[layer]`
    the forward kind (`libraries.fwd`), its weight gradient `g.T @ x` the weight-gradient kind (`libraries.dw`)."""
    libraries = library if isinstance(library, Libraries) else Libraries.every(library)
    return _product(x, stack, layer, libraries, True)


def weight_grad(x: Array, g: Array, library: str) -> Array:
    """x.T @ g -> f32[K, M] for x f32[N, K], g f32[N, M], by `library`'s GEMM (one layer's weight gradient)."""
    out = jax.ShapeDtypeStruct((x.shape[1], g.shape[1]), jnp.float32)
    return jax.ffi.ffi_call(TARGETS[library]["weight_grad"], out, vmap_method="sequential")(x, g)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _product(x: Array, stack: Array, layer: Array, libraries: Libraries, transposed: bool) -> Array:
    """x @ stack[layer] (or, `transposed`, x @ stack[layer].T), each product by the library of its kind."""
    return _gemm(x, stack, layer, transposed, libraries.dx if transposed else libraries.fwd)


def _product_fwd(x, stack, layer, libraries, transposed):
    return _product(x, stack, layer, libraries, transposed), (x, stack, layer)


def _product_bwd(libraries, transposed, residuals, g):
    x, stack, layer = residuals
    # the input gradient reads the layer the other way round; the weight gradient is [K, M], the stack's layout
    dx = _gemm(g, stack, layer, not transposed, libraries.fwd if transposed else libraries.dx)
    dw = weight_grad(g, x, libraries.dw) if transposed else weight_grad(x, g, libraries.dw)
    dstack = jax.lax.dynamic_update_index_in_dim(jnp.zeros_like(stack), dw, layer, 0)
    return dx, dstack, None


_product.defvjp(_product_fwd, _product_bwd)
