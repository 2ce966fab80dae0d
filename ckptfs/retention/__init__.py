"""Retention of the last N checkpoints: its rules (rules.py) and the pruner that applies them
(pruner.py)."""
