"""Shared core: one timer, one renderer, device facts, FLOP counting, user errors.

Nothing here imports torch at module level except where a function needs it, so the CLI stays fast.
"""
