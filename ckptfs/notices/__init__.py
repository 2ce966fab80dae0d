"""A preemption notice: carried out (preempter.py) and watched for on the clouds' metadata
endpoints (watchers.py)."""
