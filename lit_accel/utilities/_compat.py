"""The one place where lit_accel touches private attributes of Lightning and torch.

Every accessor here is exercised by ``tests/utilities/test_compat.py``, so a Lightning or torch release that moves
one of them fails loudly in CI instead of silently changing behaviour.
"""
