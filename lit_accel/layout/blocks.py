"""A model's blocks: what a policy selects, and FSDP shards, ``compile=`` compiles and checkpointing wraps one by one.

A *policy* names the blocks: ``"auto"`` (the class repeated inside a ``ModuleList`` or ``Sequential`` whose
instances hold the most parameters together, such as timm's ViT ``Block``, torchvision's ``EncoderBlock`` or a
ResNet's ``BasicBlock``), a module class or tuple of classes, a minimum parameter count (every smallest subtree
holding at least that many parameters not already in a block), or a callable ``module -> bool``. An
``nn.MultiheadAttention``'s ``out_proj`` is never a block: the attention reads its weight without calling it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Literal

from torch import nn

from lit_accel.utilities._compat import composable_checkpoint

__all__ = ["ShardPolicy", "check_policy", "checkpoint_blocks", "find_blocks"]

ShardPolicy = Literal["auto"] | type | tuple[type, ...] | int | Callable[[nn.Module], bool]


def check_policy(owner: str, name: str, policy: object) -> None:
    """Check a policy argument's type at construction; raise naming the value and the fix."""
    ok = (
        policy == "auto"
        or isinstance(policy, type)
        or (isinstance(policy, tuple) and policy and all(isinstance(t, type) for t in policy))
        or (isinstance(policy, int) and not isinstance(policy, bool) and policy > 0)
        or (callable(policy) and not isinstance(policy, str))
    )
    if not ok:
        raise TypeError(
            f"{owner}({name}={policy!r}): expected 'auto', a module class (or tuple of classes), a positive minimum"
            " parameter count or a callable module -> bool. Fix: pass e.g. timm's Block class, or 'auto'."
        )


def _repeated_class(model: nn.Module) -> type | None:
    """The class repeated inside containers whose instances hold the most parameters together (ties: more of them).

    By parameters, not by count: a transformer block holding an ``nn.Sequential`` MLP of two ``Linear`` layers
    (torchvision's ``EncoderBlock``) is the block, not the ``Linear`` that repeats twice as often inside it.
    """
    counts: Counter[type] = Counter()
    totals: Counter[type] = Counter()
    for container in model.modules():
        if isinstance(container, (nn.ModuleList, nn.Sequential)) and len(container) > 1:
            for child in container:
                n = sum(p.numel() for p in child.parameters())
                if n:
                    counts[type(child)] += 1
                    totals[type(child)] += n
    repeated = [cls for cls, count in counts.items() if count > 1]
    return max(repeated, key=lambda cls: (totals[cls], counts[cls])) if repeated else None


def find_blocks(owner: str, model: nn.Module, policy: ShardPolicy, arg: str = "shard_policy") -> list[nn.Module]:
    """The modules ``policy`` selects in ``model`` (the root excluded), outermost first.

    Raises:
        ValueError: a class policy that matches no module of ``model``.
    """
    # nn.MultiheadAttention reads its out_proj's weight without calling it: FSDP's hooks on it would never gather it
    never_called = {id(m.out_proj) for m in model.modules() if isinstance(m, nn.MultiheadAttention)}
    if isinstance(policy, int) and not isinstance(policy, bool):
        return [block for block in _by_size(model, policy) if id(block) not in never_called]
    selected = _selector(owner, model, policy, arg)
    blocks, taken = [], set()
    for module in model.modules():
        if module is model or id(module) in never_called:
            continue
        if selected(module) and not any(id(p) in taken for p in module.parameters()):
            blocks.append(module)
            taken.update(id(p) for p in module.parameters())
    return blocks


def _selector(owner: str, model: nn.Module, policy: ShardPolicy, arg: str) -> Callable[[nn.Module], bool]:
    """Whether a module is a block, by ``policy`` ("auto", a class or classes, or a callable)."""
    if policy == "auto":
        cls = _repeated_class(model)
        return (lambda m: isinstance(m, cls)) if cls else (lambda m: False)
    if not isinstance(policy, (type, tuple)):
        return policy  # type: ignore[return-value]
    classes = policy if isinstance(policy, tuple) else (policy,)
    if not any(isinstance(m, classes) for m in model.modules() if m is not model):
        found = _repeated_class(model)
        hint = f" (its repeated block is {found.__name__})" if found else ""
        names = ", ".join(c.__name__ for c in classes)
        raise ValueError(
            f"{owner}({arg}={names}): the model has no such module{hint}. Fix: pass one of the model's module"
            " classes, or 'auto'."
        )
    return lambda m: isinstance(m, classes)


def _by_size(model: nn.Module, min_params: int) -> list[nn.Module]:
    """Smallest subtrees (bottom-up) holding ``min_params`` parameters not already in a chosen subtree."""
    blocks: list[nn.Module] = []
    taken: set[int] = set()

    def visit(module: nn.Module) -> None:
        for child in module.children():
            visit(child)
        if module is model:
            return
        free = sum(p.numel() for p in module.parameters() if id(p) not in taken)
        if free >= min_params:
            blocks.append(module)
            taken.update(id(p) for p in module.parameters())

    visit(model)
    return blocks[::-1]


def checkpoint_blocks(owner: str, model: nn.Module, blocks: list[nn.Module], policy: bool | ShardPolicy) -> None:
    """Activation checkpointing on ``blocks`` (``True``) or on what ``policy`` selects, before ``fully_shard``."""
    if policy is False:
        return
    checkpoint = composable_checkpoint()
    for block in blocks if policy is True else find_blocks(owner, model, policy, "activation_checkpointing"):
        checkpoint(block)
