"""The ``process_group_backend`` argument: every spelling torch accepts, checked against the rank's device at setup.

torch takes a backend name in any case (``"gloo"``, ``"NCCL"``), a ``"device:backend"`` list (``"cpu:gloo,cuda:nccl"``,
the usual spec for GPU jobs that also run CPU collectives) and backends registered by plugins, possibly after the
strategy was built. So only the shape is checked at construction; the names are resolved at setup, when every
registration has happened, and a backend that cannot carry the rank's device (nccl on a CPU) is refused before the
process group starts.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["backend_for_device", "check_backend_spec"]


def _pairs(spec: str) -> dict[str, str] | None:
    """``{"cpu": "gloo", "cuda": "nccl"}`` for a ``device:backend`` list; ``None`` for a plain backend name."""
    if ":" not in spec:
        return None
    pairs = {}
    for part in spec.split(","):
        device, _, backend = part.strip().partition(":")
        if not device or not backend:
            raise ValueError(part)
        pairs[device.strip().lower()] = backend.strip().lower()
    return pairs


def check_backend_spec(owner: str, spec: object) -> None:
    """Check the shape of ``process_group_backend`` at construction (names are resolved at setup).

    Raises:
        TypeError: not a string or None. ValueError: a malformed ``device:backend`` list.
    """
    if spec is None:
        return
    if not isinstance(spec, str) or not spec.strip():
        raise TypeError(f"{owner}(process_group_backend={spec!r}): expected a backend name such as 'gloo', or None.")
    try:
        _pairs(spec)
    except ValueError:
        raise ValueError(
            f"{owner}(process_group_backend={spec!r}): expected a name or 'device:backend' pairs. Fix: pass e.g."
            " 'nccl' or 'cpu:gloo,cuda:nccl'."
        ) from None


def backend_for_device(owner: str, spec: str, device: torch.device) -> str:
    """The backend of ``spec`` that carries ``device``'s tensors, validated against torch's registry now.

    Raises:
        ValueError: an unknown backend name, or none in ``spec`` that carries ``device`` (e.g. nccl on a CPU).
    """
    pairs = _pairs(spec)
    names = list(pairs.values()) if pairs else [spec.strip().lower()]
    known = [b for b in dist.Backend.backend_list if b != "undefined"]
    for name in names:
        if name not in known:
            raise ValueError(
                f"{owner}(process_group_backend={spec!r}): torch knows no backend {name!r} (known: {', '.join(known)})."
                " Fix: register it before the Trainer starts, or pass a known one."
            )
    if pairs is not None:
        backend, capable = pairs.get(device.type), sorted(pairs)
    else:
        capable = dist.Backend.backend_capability.get(names[0], [device.type])
        backend = names[0] if device.type in capable else None
    if backend is None:
        raise ValueError(
            f"{owner}(process_group_backend={spec!r}) needs {'/'.join(c.upper() for c in capable)} devices, but this"
            f" rank runs on {device}. Fix: drop process_group_backend (gloo on CPU, nccl on CUDA), or add"
            f" '{device.type}:gloo'."
        )
    return backend
