"""Diagnosis: what went wrong, on which rank, named in seconds.

`attach(reducer, group, key)` gives a reducer a hang handler (Note [Hang
attribution] in reducer/observation/stall_watch.h): the reducer waits with a deadline and
reports what this rank is doing; ddp_ext/_diagnosis/hang.py publishes it
through the store, reads the other ranks' reports and formats the message.
"""

from ddp_ext._diagnosis.hang import HangDiagnosis, attach, proposed_number, store_key
from ddp_ext._diagnosis.settings import HangSettings, resolve_hang_settings

__all__ = ["HangDiagnosis", "HangSettings", "attach", "proposed_number", "resolve_hang_settings", "store_key"]
