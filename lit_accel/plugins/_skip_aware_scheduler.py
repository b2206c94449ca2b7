"""Step-interval LR schedulers that do not advance when the optimizer step was skipped.

Lightning steps every ``interval="step"`` scheduler after each optimizer step, also when the loss scaler skipped it
(Lightning #5558, #18828), so an fp16 run whose first steps overflow starts its schedule late. ``make_skip_aware``
swaps the scheduler's class for a subclass whose ``step()`` asks the precision plugin whether the last step of its
optimizer was skipped. The class swap (rather than an instance attribute) matters: a torch scheduler's
``state_dict()`` is its whole ``__dict__``, so an instance attribute would be written into every checkpoint (and a
closure there makes ``torch.save`` fail); the subclass pickles and deep-copies back to the original class.
"""

from __future__ import annotations

import contextlib
import copyreg
import weakref
from collections.abc import Callable
from typing import Any, Protocol

from lightning.pytorch.utilities.rank_zero import rank_zero_warn

__all__ = ["SkipRecord", "make_skip_aware"]


class SkipRecord(Protocol):
    """What a skip-aware scheduler asks: was the last step of ``optimizer`` (or of any, if ``None``) skipped?"""

    def _should_skip_scheduler(self, optimizer: Any) -> bool: ...


# scheduler -> function answering "was the last step of your optimizer skipped?". Weak keys: no leak, and nothing is
# stored on the scheduler itself, whose state_dict() is its whole __dict__.
_SKIP_SOURCES: weakref.WeakKeyDictionary[Any, Callable[[], bool]] = weakref.WeakKeyDictionary()
_SKIP_AWARE_CLASSES: dict[type, type] = {}


def make_skip_aware(scheduler: Any, plugin: SkipRecord) -> bool:
    """Point the scheduler's ``step()`` at ``plugin``'s skip record; False (with a warning) if that is impossible."""
    plugin_ref = weakref.ref(plugin)
    optimizer = getattr(scheduler, "optimizer", None)

    def should_skip() -> bool:
        owner = plugin_ref()
        return owner is not None and owner._should_skip_scheduler(optimizer)

    cls = type(scheduler)
    try:
        _SKIP_SOURCES[scheduler] = should_skip
        if not getattr(cls, "_lit_accel_skip_aware", False):
            scheduler.__class__ = _skip_aware_class(cls)
    except TypeError:  # not weak-referenceable, or an instance layout that cannot be subclassed (__slots__)
        with contextlib.suppress(TypeError):
            _SKIP_SOURCES.pop(scheduler, None)
        rank_zero_warn(
            f"AccelPrecision: cannot make the {cls.__name__} scheduler skip-aware; it will also step on skipped"
            " optimizer steps."
        )
        return False
    return True


def _new_instance(cls: type, *args: Any) -> Any:
    """``copyreg.__newobj__`` without its class check: unpickles a skip-aware scheduler as its original class."""
    return cls.__new__(cls, *args)


def _skip_aware_class(cls: type) -> type:
    cached = _SKIP_AWARE_CLASSES.get(cls)
    if cached is not None:
        return cached

    def step(self: Any, *args: Any, **kwargs: Any) -> Any:
        should_skip = _SKIP_SOURCES.get(self)
        if should_skip is not None and should_skip():
            return None  # the optimizer did not step: neither does the schedule (Lightning #5558, #18828)
        return cls.step(self, *args, **kwargs)

    def __reduce_ex__(self: Any, protocol: Any) -> Any:
        # Pickle (and deepcopy) as the original class: skip-awareness is run-time wiring, not state.
        reduced = cls.__reduce_ex__(self, protocol)
        if isinstance(reduced, tuple) and len(reduced) > 1 and reduced[1] and reduced[1][0] is new_cls:
            # copyreg.__newobj__ insists on the object's own class; an equivalent module-level function does not.
            func = _new_instance if reduced[0] is copyreg.__newobj__ else reduced[0]
            reduced = (func, (cls, *reduced[1][1:]), *reduced[2:])
        return reduced

    new_cls = type(
        f"SkipAware{cls.__name__}",
        (cls,),
        {"step": step, "__reduce_ex__": __reduce_ex__, "_lit_accel_skip_aware": True, "__module__": __name__},
    )
    _SKIP_AWARE_CLASSES[cls] = new_cls
    return new_cls
