"""What a rank's thread is for, from its name (/proc/<pid>/task/<tid>/comm).

Gloo names its threads: `gloo_tcp_loop` (the TCP transport's event loop, which
wakes as data arrives) and `pt_gloo_runloop` (torch's ProcessGroupGloo workers,
which run the collectives). A watcher is a thread that watches for hangs or
keeps a heartbeat (torch's NCCL watchdog, ddp_ext's fault tolerance link).
Python's threads of this Python keep the process's name: they count as other.
"""

MAIN = "main"
GLOO_LOOP = "gloo tcp loop"
GLOO_WORKERS = "gloo workers"
WATCHERS = "reducer/watcher"
OTHER = "other"
KINDS = (MAIN, GLOO_LOOP, GLOO_WORKERS, WATCHERS, OTHER)

_WATCHER_PREFIXES = ("ddp_ext", "pt_nccl", "pt_heartbeat")


def kind(tid: int, pid: int, name: str) -> str:
    if tid == pid:
        return MAIN
    if name == "gloo_tcp_loop":
        return GLOO_LOOP
    if name.startswith("pt_gloo"):
        return GLOO_WORKERS
    if name.startswith(_WATCHER_PREFIXES) or "watch" in name or "reducer" in name:
        return WATCHERS
    return OTHER
