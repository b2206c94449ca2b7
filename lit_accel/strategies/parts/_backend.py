"""The ``process_group_backend`` argument: every spelling torch accepts, checked against the rank's device at setup.

torch takes a backend name in any case (``"gloo"``, ``"NCCL"``), a ``"device:backend"`` list (``"cpu:gloo,cuda:nccl"``,
the usual spec for GPU jobs that also run CPU collectives) and backends registered by plugins, possibly after the
strategy was built. So only the shape is checked at construction; the names are resolved at setup, when every
registration has happened, and a backend that cannot carry the rank's device (nccl on a CPU) is refused before the
process group starts. A rank that also runs collectives on CPU tensors (``AccelFSDP(cpu_offload=True)``: clipping
and the loss scaler's found-inf reduce the offloaded CPU gradients) on a CUDA device gets a CPU backend beside NCCL,
as torchtitan does when it offloads: NCCL alone carries no CPU tensor and would fail at the first optimizer step.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_info

__all__ = ["backend_for_device", "check_backend_spec", "resolve_backend"]


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


def _carries(spec: str, device_type: str) -> bool:
    pairs = _pairs(spec)
    if pairs is not None:
        return device_type in pairs
    name = spec.strip().lower()
    return device_type in dist.Backend.backend_capability.get(name, [])


def resolve_backend(owner: str, spec: str | None, device: torch.device, *, cpu_collectives: bool = False) -> str | None:
    """The ``process_group_backend`` to start with: ``spec`` validated, extended with ``cpu:gloo`` where it must be.

    ``cpu_collectives`` says that this rank also reduces CPU tensors. On a non-CPU device whose backend (``spec``, or
    torch's default for the device when None) carries no CPU tensor, the answer is ``"<device>:<backend>,cpu:gloo"``,
    said once on rank zero; otherwise ``spec`` unchanged (None: Lightning's default for the device).

    Raises:
        ValueError: as :func:`backend_for_device`.
    """
    if spec is not None:
        backend_for_device(owner, spec, device)
    if not cpu_collectives or device.type == "cpu":
        return spec
    current = spec if spec is not None else dist.Backend.default_device_backend_map.get(device.type, "gloo")
    if _carries(current, "cpu"):
        return spec
    pairs = _pairs(current) or {device.type: current.strip().lower()}
    resolved = ",".join(f"{device_type}:{backend}" for device_type, backend in {**pairs, "cpu": "gloo"}.items())
    rank_zero_info(
        f"{owner}: process_group_backend={resolved!r} (was {spec!r}): the CPU-offloaded gradients are clipped and"
        " checked for inf/NaN with CPU collectives, which need a CPU backend beside"
        f" {current!r}. Pass process_group_backend with a 'cpu:' entry to choose another."
    )
    return resolved
