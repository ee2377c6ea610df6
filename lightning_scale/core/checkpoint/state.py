"""The non-tensor part of a checkpoint as JSON.

A training checkpoint is more than tensors: loop counters, callbacks' state, LR schedulers,
hyper-parameters, the loss scaler. Pickling them would make loading a checkpoint run whatever
code its author put in it, so :func:`encode` turns such a tree into JSON with tagged values and
takes the tensors out (they go to DCP under the key in their placeholder), and :func:`decode`
builds it back without importing anything: dataclasses come back as instances only when their
class is already imported (else as a plain dict), anything else JSON cannot name is refused at
save time with the path to it.

No Lightning, no process group.
"""

from __future__ import annotations

import argparse
import base64
import dataclasses
import enum
import math
import sys
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path, PurePath
from typing import Any

import torch
from torch import Tensor

__all__ = ["decode", "encode"]

_TAG = "__ls__"  # key of a tagged value: {"__ls__": kind, "v": payload}


def _tag(kind: str, value: Any) -> dict[str, Any]:
    return {_TAG: kind, "v": value}


def _qualname(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def encode(
    obj: Any,
    tensors: dict[str, Tensor],
    *,
    prefix: str,
    lenient: Callable[[tuple[str, ...]], bool] = lambda path: False,
) -> Any:
    """``obj`` as a JSON value; each tensor is put into ``tensors`` under ``prefix/<path>`` and left
    as a placeholder. ``lenient(path)``: where a value JSON cannot hold is stored as its ``repr``
    (with a warning) instead of raising ``TypeError`` (hyper-parameters, which resuming never reads)."""

    def walk(value: Any, path: tuple[str, ...]) -> Any:
        if value is None or isinstance(value, (bool, str)):
            return value
        if isinstance(value, enum.Enum):  # before int: an IntEnum is an int
            return _tag("enum", [_qualname(type(value)), value.name])
        if isinstance(value, int):
            return int(value)
        if isinstance(value, float):
            return value if math.isfinite(value) else _tag("float", repr(value))
        if isinstance(value, Tensor):
            key = "/".join((prefix, *path))
            tensors[key] = value
            return _tag("tensor", key)
        if type(value).__module__ == "numpy":  # arrays and scalars, without importing numpy here
            if hasattr(value, "shape") and getattr(value, "ndim", 0) > 0:
                return walk(torch.as_tensor(value), path)
            if hasattr(value, "item"):
                return walk(value.item(), path)
        if isinstance(value, torch.dtype):
            return _tag("dtype", str(value).removeprefix("torch."))
        if isinstance(value, torch.device):
            return _tag("device", str(value))
        if isinstance(value, (bytes, bytearray)):
            return _tag("bytes", base64.b64encode(bytes(value)).decode())
        if isinstance(value, PurePath):
            return _tag("path", str(value))
        if isinstance(value, argparse.Namespace):
            return _tag("namespace", walk(vars(value), path))
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            fields = {f.name: walk(getattr(value, f.name), (*path, f.name)) for f in dataclasses.fields(value)}
            return _tag("dataclass", [_qualname(type(value)), fields])
        if isinstance(value, Mapping):
            if all(isinstance(k, str) and k != _TAG for k in value):
                return {k: walk(v, (*path, k)) for k, v in value.items()}
            return _tag("dict", [[walk(k, (*path, "<key>")), walk(v, (*path, str(k)))] for k, v in value.items()])
        if isinstance(value, tuple):
            return _tag("tuple", [walk(v, (*path, str(i))) for i, v in enumerate(value)])
        if isinstance(value, (list, set, frozenset)) or _is_sequence(value):
            kind = "set" if isinstance(value, (set, frozenset)) else None
            items = [walk(v, (*path, str(i))) for i, v in enumerate(value)]
            return _tag(kind, items) if kind else items
        if lenient(path):
            warnings.warn(
                f"{'/'.join((prefix, *path))} holds a {type(value).__name__}, which a checkpoint stores as JSON only; "
                "its repr is kept instead.",
                RuntimeWarning,
                stacklevel=3,
            )
            return _tag("repr", repr(value))
        raise TypeError(
            f"Cannot store {'/'.join((prefix, *path))} (a {type(value).__name__}) in a checkpoint: its non-tensor "
            "state is JSON, which holds None, bool, int, float, str, lists, tuples, dicts, dataclasses, enums, "
            "paths, dtypes and tensors. Store it as one of those (e.g. in `state_dict`/`on_save_checkpoint`)."
        )

    return walk(obj, ())


def _is_sequence(value: Any) -> bool:
    # OmegaConf's ListConfig and other list-likes: iterable, sized, indexable, not a string.
    return hasattr(value, "__len__") and hasattr(value, "__getitem__") and hasattr(value, "__iter__")


def _imported_class(qualname: str) -> type | None:
    """The class named ``module:Qual.name`` if its module is already imported (nothing is imported here)."""
    module_name, _, name = qualname.partition(":")
    obj: Any = sys.modules.get(module_name)
    for part in name.split("."):
        obj = getattr(obj, part, None)
    return obj if isinstance(obj, type) else None


def decode(doc: Any, tensors: Mapping[str, Tensor]) -> Any:
    """The object :func:`encode` turned into ``doc``, with ``tensors`` put back at their placeholders."""

    def walk(value: Any) -> Any:
        if isinstance(value, list):
            return [walk(v) for v in value]
        if not isinstance(value, dict):
            return value
        if _TAG not in value:
            return {k: walk(v) for k, v in value.items()}
        kind, payload = value[_TAG], value.get("v")
        if kind == "tensor":
            if payload not in tensors:
                raise KeyError(
                    f"The checkpoint's state refers to the tensor {payload!r}, which its shards do not hold."
                )
            return tensors[payload]
        if kind == "float":
            return float(payload)
        if kind == "tuple":
            return tuple(walk(v) for v in payload)
        if kind == "set":
            return set(walk(v) for v in payload)
        if kind == "dict":
            return {walk(k): walk(v) for k, v in payload}
        if kind == "dtype":
            dtype = getattr(torch, payload, None)
            if not isinstance(dtype, torch.dtype):
                raise ValueError(f"Unknown dtype {payload!r} in the checkpoint's state.")
            return dtype
        if kind == "device":
            return torch.device(payload)
        if kind == "bytes":
            return base64.b64decode(payload)
        if kind == "path":
            return Path(payload)
        if kind == "namespace":
            return argparse.Namespace(**walk(payload))
        if kind == "repr":
            return payload
        if kind == "enum":
            cls = _imported_class(payload[0])
            return cls[payload[1]] if cls is not None and issubclass(cls, enum.Enum) else payload[1]
        if kind == "dataclass":
            cls, fields = _imported_class(payload[0]), walk(payload[1])
            if cls is not None and dataclasses.is_dataclass(cls):
                return cls(**{f.name: fields[f.name] for f in dataclasses.fields(cls) if f.init and f.name in fields})
            return fields  # its class is not loaded: the fields, as a dict
        raise ValueError(
            f"Unknown tagged value {kind!r} in the checkpoint's state (written by a newer lightning-scale?)."
        )

    return walk(doc)
