"""A checkpoint's host state as JSON: any JSON-able dict, where numpy/jax arrays and scalars keep their dtype
(restored as numpy arrays, bit for bit) and typed PRNG keys are stored as their key data and implementation name.
Python floats round-trip exactly, so a float32 stored as ``float(x)`` comes back as the same float32."""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from ppojax.errors import CheckpointError

__all__ = ["encode_host_state", "decode_host_state", "config_as_dict"]


def _encode(value: Any, where: str) -> Any:
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    if isinstance(value, dict):
        bad = [k for k in value if not isinstance(k, str)]
        if bad:
            raise CheckpointError(f"host_state{where}: key {bad[0]!r} is not a string; JSON needs string keys.")
        return {k: _encode(v, f"{where}[{k!r}]") for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_encode(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, jax.Array) and jax.dtypes.issubdtype(value.dtype, jax.dtypes.prng_key):
        return {"__prng_key__": str(jax.random.key_impl(value)), "shape": list(value.shape),
                "data": np.asarray(jax.random.key_data(value)).ravel().tolist()}
    if isinstance(value, (np.ndarray, np.generic, jax.Array)):
        array = np.asarray(value)
        if array.dtype != object:
            return {"__ndarray__": str(array.dtype), "shape": list(array.shape), "data": array.ravel().tolist()}
    raise CheckpointError(
        f"host_state{where}: cannot store a {type(value).__name__} in a checkpoint's host state; use numbers, "
        "strings, lists, dicts, numpy/jax arrays or PRNG keys (put device pytrees in the train state).")


def decode_host_state(value: Any) -> Any:
    """Inverse of :func:`encode_host_state`: arrays come back as numpy arrays, keys as typed PRNG keys."""
    if isinstance(value, list):
        return [decode_host_state(v) for v in value]
    if not isinstance(value, dict):
        return value
    if "__prng_key__" in value:
        data = np.asarray(value["data"], np.uint32).reshape(*value["shape"], -1)
        return jax.random.wrap_key_data(data, impl=value["__prng_key__"])
    if "__ndarray__" in value:
        dtype = jax.numpy.dtype(value["__ndarray__"])  # knows bfloat16 & co. (ml_dtypes)
        return np.asarray(value["data"], dtype=dtype).reshape(value["shape"])
    return {k: decode_host_state(v) for k, v in value.items()}


def encode_host_state(host_state: dict) -> dict:
    """The JSON-able form of ``host_state`` (arrays and PRNG keys tagged with dtype / implementation)."""
    if not isinstance(host_state, dict):
        raise CheckpointError(f"host_state must be a dict, got {type(host_state).__name__}.")
    return _encode(host_state, "")


def config_as_dict(config) -> dict:
    """A config as the dict a checkpoint stores: a dict, ``to_dict()`` of a PPOConfig, or a dataclass's fields."""
    if isinstance(config, dict):
        return dict(config)
    if hasattr(config, "to_dict"):
        return config.to_dict()
    if dataclasses.is_dataclass(config):
        return dataclasses.asdict(config)
    raise CheckpointError(f"config must be a dict or a dataclass, got {type(config).__name__}.")
