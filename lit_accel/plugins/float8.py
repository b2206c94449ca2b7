"""FP8 training of ``nn.Linear`` layers through torchao, reversibly: the conversion behind ``"fp8-mixed"``.

What it adds to torchao's ``convert_to_float8_training`` (which layers, where FP8 runs, an exact revert) and why:
docs/precision.md, "FP8".
"""

from __future__ import annotations

import dataclasses
import difflib
import fnmatch
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn
from torch.nn.utils import parametrize

from lit_accel.plugins._float8_padding import RowPadding
from lit_accel.plugins._module_swap import swap_modules

if TYPE_CHECKING:
    from torchao.float8 import Float8LinearConfig

__all__ = ["MIN_FP8_CAPABILITY", "Float8Conversion", "Float8Report", "ModuleFilter", "resolve_emulation"]

#: CUDA compute capability of the first GPUs with FP8 tensor cores (Ada, sm_89); Hopper and Blackwell are above it.
MIN_FP8_CAPABILITY = (8, 9)
#: ``(module, fqn) -> True`` to convert (torchao's ``module_filter_fn`` contract), or names/patterns to leave out.
ModuleFilter = Callable[[nn.Module, str], bool] | Iterable[str]

# Where a converted layer keeps the Linear it replaced. In ``__dict__`` directly: ``Module.__setattr__`` would register
# it as a child, changing ``state_dict`` keys, ``parameters()`` and ``.to()``.
_ORIGINAL = "_lit_accel_float8_original"
# Hook dicts the converted layer shares with the original, so that hooks registered on the user's Linear keep firing
# while it is converted (and hooks added meanwhile stay on it after revert). State-dict hooks are not shared.
_SHARED_HOOKS = ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks", "_forward_hooks_with_kwargs")
_SHARED_HOOKS += ("_forward_hooks_always_called", "_backward_pre_hooks", "_backward_hooks")
_MAX_LISTED = 4  # layers named in the one-line message; the report holds all of them


def resolve_emulation(device_type: str, capability: tuple[int, int] | None, emulate: bool | None) -> bool:
    """Whether the FP8 matmuls run in fp32 on dequantized values (emulated): the table in docs/precision.md, "FP8".

    Raises:
        RuntimeError: a CUDA GPU below compute capability 8.9 (or unknown) without ``emulate=True``, or
            ``emulate=False`` off CUDA.
    """
    if emulate:
        return True
    if device_type == "cuda":
        if capability is not None and tuple(capability) >= MIN_FP8_CAPABILITY:
            return False
        found = "unknown" if capability is None else ".".join(map(str, capability))
        raise RuntimeError(
            f"Float8Conversion: the CUDA device has compute capability {found}, but FP8 matmuls need"
            f" {'.'.join(map(str, MIN_FP8_CAPABILITY))} or newer (Ada, Hopper, Blackwell). Fix: train on this GPU"
            " in 'bf16-mixed', or pass emulate=True to emulate FP8 numerics (slower than bf16)."
        )
    if emulate is False:
        raise RuntimeError(
            f"Float8Conversion(emulate=False): device type {device_type!r} has no FP8 matmul kernels. Fix: pass"
            " emulate=None to emulate them there, or train on a CUDA GPU of compute capability 8.9 or newer."
        )
    return True


@dataclass(frozen=True)
class Float8Report:
    """What :meth:`Float8Conversion.apply` did: the converted layers and why the other Linear layers were left out."""

    #: Fully qualified names of the converted Linear layers (the first name of a layer registered under several).
    converted: tuple[str, ...]
    #: Linear layers left in high precision: name -> reason (e.g. ``"in_features=10 is not a multiple of 16"``).
    skipped: Mapping[str, str]
    #: True when the FP8 matmuls are emulated.
    emulated: bool
    #: The device type the decision was made for.
    device_type: str

    @property
    def message(self) -> str:
        """One line for the log: how many converted, which were left out and why."""
        where = "emulated on {}: FP8 numerics, not FP8 speed" if self.emulated else "FP8 tensor cores on {}"
        total = len(self.converted) + len(self.skipped)
        text = (
            f"FP8 (torchao, {where.format(self.device_type)}): {len(self.converted)} of {total} Linear layers converted"
        )
        if self.skipped:
            listed = [f"{name or '<root>'} ({why})" for name, why in list(self.skipped.items())[:_MAX_LISTED]]
            more = len(self.skipped) - len(listed)
            text += "; left in high precision: " + ", ".join(listed) + (f" and {more} more" if more else "")
        return text + "."


class Float8Conversion:
    """Convert a model's ``nn.Linear`` layers to torchao's FP8 training layers, report which, and undo it exactly.

    The converted layers share the original fp32 ``Parameter`` objects (``state_dict`` keys, dtypes and an optimizer
    built before :meth:`apply` stay valid, except with float8 all-gather). Convert before DDP or ``fully_shard``.

    Args:
        config: torchao's ``Float8LinearConfig`` (e.g. ``Float8LinearConfig.from_recipe_name("rowwise")``); None:
            ``Float8LinearConfig()``, dynamic tensorwise scaling. Its ``emulate`` field is set from the decision below.
        module_filter: which eligible layers convert: a callable ``(module, fqn) -> bool`` (True converts), or fnmatch
            names of modules to leave out with their Linear layers (``"head"``, ``"blocks.11"``, ``"*.attn.qkv"``).
        emulate: None (default) runs FP8 tensor cores on CUDA GPUs of compute capability >= 8.9, emulates on devices
            without them (CPU) and refuses older GPUs; True always emulates; False requires FP8 tensor cores.

    Raises:
        ModuleNotFoundError: torchao is not installed.
        TypeError: ``config``, ``module_filter`` or ``emulate`` has the wrong type.
        ValueError: ``emulate=False`` with a ``config`` whose ``emulate`` is True.

    Example::

        conversion = Float8Conversion(module_filter=["head"])
        model = conversion.apply(model, device=torch.device("cuda", 0))  # before DDP / fully_shard
        print(conversion.report.message)
        ...  # train under torch.autocast(dtype=torch.bfloat16)
        model = conversion.revert(model)  # the original nn.Linear objects, with the trained weights
    """

    def __init__(
        self,
        config: Float8LinearConfig | None = None,
        module_filter: ModuleFilter | None = None,
        emulate: bool | None = None,
    ) -> None:
        config = _checked_config(config)
        self._names = _filter_names(module_filter)
        _check_emulate(emulate, config)
        self.config = config
        self.emulate = True if config.emulate else emulate
        self.module_filter = module_filter
        #: What the last :meth:`apply` did (None before).
        self.report: Float8Report | None = None
        self._padding = RowPadding()

    def emulation_for(self, device: torch.device | str) -> bool:
        """Whether :meth:`apply` would emulate on ``device`` (raises as :func:`resolve_emulation` does)."""
        device = torch.device(device)
        cuda = device.type == "cuda" and torch.cuda.is_available()
        return resolve_emulation(device.type, torch.cuda.get_device_capability(device) if cuda else None, self.emulate)

    def apply(self, model: nn.Module, device: torch.device | str) -> nn.Module:
        """Convert the eligible Linear layers of ``model`` in place and log the report.

        Args:
            model: the unwrapped model (not yet in DDP, not sharded). A Linear root is replaced (returned).
            device: the device the model will train on (Lightning calls this before moving the model there).

        Raises:
            ValueError: a ``module_filter`` name matches no module, or no Linear layer is eligible (saying why).
            RuntimeError: the model is already wrapped or sharded, or the device cannot run FP8.
        """
        from torchao.float8 import convert_to_float8_training

        _check_unwrapped(model)
        emulated = self.emulation_for(device)
        config = self.config if self.config.emulate == emulated else dataclasses.replace(self.config, emulate=emulated)
        eligible, report = self._plan(model, emulated, torch.device(device).type)
        if not eligible:
            raise ValueError(f"Float8Conversion: {_nothing_to_convert(report)}")

        converted: list[nn.Module] = []

        def convert(module: nn.Module) -> nn.Module | None:
            if id(module) not in eligible:
                return None
            out = convert_to_float8_training(module, config=config)  # a Linear root: returns the new layer
            out.train(module.training)
            for name in _SHARED_HOOKS:
                if isinstance(getattr(module, name, None), dict):
                    setattr(out, name, getattr(module, name))
            out._is_full_backward_hook = getattr(module, "_is_full_backward_hook", None)
            if config.enable_fsdp_float8_all_gather:
                out.register_state_dict_post_hook(_plain_weight_in_state_dict)
            out.__dict__[_ORIGINAL] = module
            converted.append(out)
            return out

        model = swap_modules(model, convert)
        if not config.pad_inner_dim:  # (torchao pads every GEMM's inner dimension itself then)
            self._padding.install(converted)
        self.report = report
        rank_zero_info(report.message)
        return model

    def revert(self, model: nn.Module) -> nn.Module:
        """Put back the user's Linear objects :meth:`apply` replaced (unwrap DDP first), with the current parameters."""
        self._padding.remove()

        def revert(module: nn.Module) -> nn.Module | None:
            original = module.__dict__.get(_ORIGINAL)
            if original is not None:
                # The converted layer holds the current tensors (``.to()`` may have replaced them since apply).
                for name, param in module._parameters.items():
                    original._parameters[name] = _plain_parameter(param)
                original.training = module.training
            return original

        return swap_modules(model, revert)

    def _plan(self, model: nn.Module, emulated: bool, device_type: str) -> tuple[set[int], Float8Report]:
        from torchao.float8.float8_linear import Float8Linear

        names_of: dict[int, list[str]] = {}
        for name, module in model.named_modules(remove_duplicate=False):
            names_of.setdefault(id(module), []).append(name)
        linears = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.Linear)]
        excluded = self._excluded_by_names(names_of, [name for name, _ in linears])
        inside_mha = {id(c) for m in model.modules() if isinstance(m, nn.MultiheadAttention) for c in m.children()}
        reasons = {name: self._skip_reason(name, m, Float8Linear, inside_mha, excluded) for name, m in linears}
        skipped = {name: reason for name, reason in reasons.items() if reason is not None}
        converted = [(name, module) for name, module in linears if name not in skipped]
        report = Float8Report(tuple(name for name, _ in converted), skipped, emulated, device_type)
        return {id(module) for _, module in converted}, report

    def _skip_reason(
        self, name: str, module: nn.Linear, float8_cls: type, inside_mha: set[int], excluded: set[int]
    ) -> str | None:  # fmt: skip
        """Why the layer stays in high precision (its structure, or ``module_filter``), or None if it converts."""
        reason = _structural_reason(module, float8_cls, id(module) in inside_mha)
        if reason is None and (
            id(module) in excluded or (callable(self.module_filter) and not self.module_filter(module, name))
        ):
            reason = "excluded by module_filter"
        return reason

    def _excluded_by_names(self, names_of: dict[int, list[str]], linear_names: list[str]) -> set[int]:
        if self._names is None:
            return set()
        all_names = [name for names in names_of.values() for name in names]
        for pattern in self._names:
            if not any(fnmatch.fnmatchcase(name, pattern) for name in all_names):
                raise ValueError(_unmatched_pattern(self._names, pattern, linear_names))
        # A name is excluded with its own path or any enclosing module's ("blocks.1" excludes "blocks.1.fc").
        return {key for key, names in names_of.items() if _matches_enclosing(names, self._names)}


def _checked_config(config: Float8LinearConfig | None) -> Float8LinearConfig:
    """The config to convert with (torchao's default for None), its type checked."""
    try:
        from torchao.float8 import Float8LinearConfig
    except ModuleNotFoundError as err:
        raise ModuleNotFoundError(
            "Float8Conversion needs torchao, which is not installed. Fix: pip install 'torchao>=0.10'."
        ) from err
    if config is not None and not isinstance(config, Float8LinearConfig):
        raise TypeError(
            f"Float8Conversion(config={config!r}): expected a torchao.float8.Float8LinearConfig or None."
            " Fix: pass e.g. config=Float8LinearConfig.from_recipe_name('rowwise')."
        )
    return config if config is not None else Float8LinearConfig()


def _check_emulate(emulate: bool | None, config: Float8LinearConfig) -> None:
    if emulate is not None and not isinstance(emulate, bool):
        raise TypeError(f"Float8Conversion(emulate={emulate!r}): expected None, True or False. Fix: pass None.")
    if config.emulate and emulate is False:
        raise ValueError(
            "Float8Conversion(emulate=False): the config has emulate=True. Fix: pass emulate=None or a config"
            " with emulate=False."
        )


def _filter_names(module_filter: ModuleFilter | None) -> tuple[str, ...] | None:
    """The module names a ``module_filter`` list leaves out (None for a callable or no filter), type-checked."""
    if module_filter is None or callable(module_filter):
        return None
    names = tuple(module_filter) if isinstance(module_filter, Iterable) and not isinstance(module_filter, str) else None
    if names is None or not all(isinstance(n, str) for n in names):
        raise TypeError(
            f"Float8Conversion(module_filter={module_filter!r}): expected a callable (module, fqn) -> bool or a"
            " list of module names, and every name must be a str. Fix: pass e.g. module_filter=['head']."
        )
    return names


def _unmatched_pattern(patterns: tuple[str, ...], pattern: str, linear_names: list[str]) -> str:
    close = difflib.get_close_matches(pattern, linear_names, n=3, cutoff=0.5) or linear_names[:3]
    return (
        f"Float8Conversion(module_filter={list(patterns)!r}): {pattern!r} matches no module of the"
        f" model (closest Linear layers: {close}; {len(linear_names)} in all). Fix: use names from"
        " model.named_modules(), or fnmatch patterns such as '*.head'."
    )


def _matches_enclosing(names: list[str], patterns: tuple[str, ...]) -> bool:
    """Whether a pattern matches one of a module's names or the name of a module enclosing it."""
    prefixes = {".".join(n.split(".")[:i]) for n in names for i in range(1, n.count(".") + 2)}
    return any(fnmatch.fnmatchcase(p, pattern) for p in prefixes for pattern in patterns)


def _structural_reason(module: nn.Linear, float8_cls: type, inside_mha: bool) -> str | None:
    """Why ``module`` cannot run as a ``Float8Linear`` whatever the user asks, or None if it can."""
    if isinstance(module, float8_cls):
        return "already a Float8Linear"
    if parametrize.is_parametrized(module):
        return "parametrized (torch.nn.utils.parametrize)"
    if type(module).forward is not nn.Linear.forward:
        return f"{type(module).__name__} overrides forward"
    if next(iter(module.children()), None) is not None:
        return "has child modules"
    if inside_mha:
        return "inside nn.MultiheadAttention, which does not call its forward"
    bad = [f"{dim}={getattr(module, dim)}" for dim in ("in_features", "out_features") if getattr(module, dim) % 16]
    if bad:
        return f"{' and '.join(bad)} {'is not a multiple' if len(bad) == 1 else 'are not multiples'} of 16"
    return None


def _nothing_to_convert(report: Float8Report) -> str:
    if not report.skipped:
        return "the model has no nn.Linear layer, so there is nothing to train in FP8. Fix: use 'bf16-mixed'."
    reasons = "; ".join(f"{name or '<root>'}: {why}" for name, why in report.skipped.items())
    return (
        f"no Linear layer of the model can train in FP8 ({reasons}). Fix: use 'bf16-mixed' for this model, or make"
        " the Linear dimensions multiples of 16 and loosen module_filter."
    )


def _check_unwrapped(model: nn.Module) -> None:
    wrapped = [m for m in model.modules() if isinstance(m, nn.parallel.DistributedDataParallel)]
    if not wrapped and dist.is_available():
        from torch.distributed.tensor import DTensor

        wrapped = [p for p in model.parameters() if isinstance(p, DTensor)]
    if wrapped:
        raise RuntimeError(
            "Float8Conversion.apply: the model is already wrapped in DistributedDataParallel or sharded (DTensor"
            " parameters); the swapped layers would miss the wrapper's hooks. Fix: convert first, then wrap or shard."
        )


def _fsdp_float8_inner(tensor: Any) -> Any:
    """The fp32 tensor inside torchao's FSDP float8 weight wrapper (``enable_fsdp_float8_all_gather``), else None.

    Its ``_tensor`` (torchao 0.18): the revert and state-dict tests fail loudly if that changes.
    """
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    return tensor._tensor if isinstance(tensor, WeightWithDynamicFloat8CastTensor) else None


def _plain_parameter(param: nn.Parameter | None) -> nn.Parameter | None:
    inner = None if param is None else _fsdp_float8_inner(param)
    if inner is None:
        return param
    # ``Float8Linear.from_float`` wrapped the original Parameter, which the optimizer updated in place through it.
    return inner if isinstance(inner, nn.Parameter) else nn.Parameter(inner, requires_grad=param.requires_grad)


def _plain_weight_in_state_dict(module: nn.Module, state_dict: dict[str, Any], prefix: str, _: Any) -> None:
    # Checkpoints hold plain tensors, so they load without torchao (outside FSDP; DTensors are left alone).
    for key in (f"{prefix}weight", f"{prefix}bias"):
        inner = _fsdp_float8_inner(state_dict.get(key))
        if inner is not None:
            state_dict[key] = inner.detach()
