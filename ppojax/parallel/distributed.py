"""Multi-process start-up: JAX's own multi-controller runtime (``jax.distributed``), started first thing when a
launcher (SLURM, Open MPI, a TPU pod, ``JAX_COORDINATOR_ADDRESS``) runs several processes; only
:func:`is_main_process` writes logs and exports.
"""
from __future__ import annotations

import glob
import importlib.util
import logging
import os
from typing import Optional

import jax

logger = logging.getLogger(__name__)


def _cluster_env() -> Optional[str]:
    """A launcher JAX's ``jax.distributed.initialize()`` can auto-detect, when it runs several processes."""
    env = os.environ
    if env.get("JAX_COORDINATOR_ADDRESS"):
        return "JAX_COORDINATOR_ADDRESS"
    if all(k in env for k in ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID",
                              "SLURM_LOCALID")) and env["SLURM_NTASKS"].isdigit() and int(env["SLURM_NTASKS"]) > 1:
        return "slurm"
    if "OMPI_MCA_orte_hnp_uri" in env:
        return "open-mpi"
    hosts = env.get("TPU_PROCESS_ADDRESSES") or env.get("TPU_WORKER_HOSTNAMES") or ""
    if "," in hosts or env.get("MEGASCALE_COORDINATOR_ADDRESS"):
        return "tpu"
    # a Cloud TPU VM (libtpu installed, TPU chips attached): JAX finds the pod slice's workers itself
    if importlib.util.find_spec("libtpu") is not None and (glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*")):
        return "cloud-tpu"
    return None


def initialize_distributed(coordinator_address: Optional[str] = None, num_processes: Optional[int] = None,
                           process_id: Optional[int] = None, *, auto: Optional[bool] = None,
                           **kwargs) -> bool:
    """Start JAX's multi-controller runtime (``jax.distributed.initialize``) when this is a multi-process
    run; call it first thing, before any other JAX call. Returns True when running distributed.

    Sources, in order: the arguments; ``PPOJAX_COORDINATOR`` (host:port of process 0),
    ``PPOJAX_NUM_PROCESSES``, ``PPOJAX_PROCESS_ID``; then ``jax.distributed.initialize()`` with no
    arguments, so that JAX detects the cluster itself, when one is seen (a Cloud TPU VM: libtpu + TPU
    chips; GKE TPU / multislice variables; SLURM with more than one task; Open MPI;
    ``JAX_COORDINATOR_ADDRESS``) or when ``auto=True`` / ``PPOJAX_DISTRIBUTED=1``; ``auto=False`` /
    ``PPOJAX_DISTRIBUTED=0`` turns the detection off. With none of these: single process, nothing to do
    (returns False). Extra keyword arguments go to ``jax.distributed.initialize`` (e.g.
    ``local_device_ids``, ``initialization_timeout``).
    """
    if jax.distributed.is_initialized():
        return True
    env = os.environ
    coordinator_address = coordinator_address or env.get("PPOJAX_COORDINATOR") or None

    def as_int(value, name):
        if value is None or value == "":
            return None
        try:
            return int(value)
        except (TypeError, ValueError):
            raise ValueError(f"{name}={value!r}; expected an integer.") from None

    num_processes = as_int(num_processes if num_processes is not None else env.get("PPOJAX_NUM_PROCESSES"),
                           "num_processes (PPOJAX_NUM_PROCESSES)")
    process_id = as_int(process_id if process_id is not None else env.get("PPOJAX_PROCESS_ID"),
                        "process_id (PPOJAX_PROCESS_ID)")
    if auto is None and env.get("PPOJAX_DISTRIBUTED"):
        auto = env["PPOJAX_DISTRIBUTED"].lower() not in ("0", "false", "no", "")
    explicit = coordinator_address is not None or num_processes is not None or process_id is not None
    if explicit:
        if num_processes == 1 and coordinator_address is None:
            return False
        missing = [name for name, value in (("coordinator_address (PPOJAX_COORDINATOR)", coordinator_address),
                                            ("num_processes (PPOJAX_NUM_PROCESSES)", num_processes),
                                            ("process_id (PPOJAX_PROCESS_ID)", process_id)) if value is None]
        if missing and _cluster_env() is None and not auto:
            raise ValueError(f"multi-process run is missing {', '.join(missing)}: give all three of "
                             "coordinator_address, num_processes and process_id (or their PPOJAX_* "
                             "environment variables), or run under a launcher JAX detects.")
        if num_processes is not None and process_id is not None and not 0 <= process_id < num_processes:
            raise ValueError(f"process_id={process_id} with num_processes={num_processes}; expected "
                             f"0 <= process_id < num_processes.")
        jax.distributed.initialize(coordinator_address, num_processes, process_id, **kwargs)
    elif auto or (auto is None and _cluster_env() is not None):
        logger.info("initializing jax.distributed from the environment (%s)", _cluster_env() or "auto")
        jax.distributed.initialize(**kwargs)
    else:
        return False
    logger.info("jax.distributed: process %d of %d, %d local / %d global devices", jax.process_index(),
                jax.process_count(), jax.local_device_count(), jax.device_count())
    return True


def is_main_process() -> bool:
    """True on process 0: the one that writes logs, sample tables and exports."""
    return jax.process_index() == 0
