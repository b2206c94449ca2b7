"""The parts every lit_accel strategy shares, owned through :class:`AccelParts` (``accel_parts.py``).

The batch planner (the ``BatchPlan`` of a fit, agreed and applied to the Trainer), micro-batching and its ``"auto"``
search, the exact partial window, compile, the backend argument, SyncBatchNorm, comm counters and peer-failure
messages. Nothing here imports a strategy: ``ddp/`` and ``sharded/`` build on these parts, never the reverse.
"""
