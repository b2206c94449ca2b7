"""Planning a run before launch: every layout's memory per rank (``plan``)."""

from lit_accel.planning.plan import Plan, PlanRow, plan

__all__ = ["Plan", "PlanRow", "plan"]
