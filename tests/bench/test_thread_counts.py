"""The per-thread pieces of `instructions`: /proc status files parsed, threads
told apart by name, callgrind's thread numbers matched to thread ids, and a
rank's turns summed by kind of thread. Pure: no process is started."""

import os
import threading

import pytest

from benchmarks.harness import callgrind, task_switches, thread_counts, thread_kinds
from benchmarks.harness.task_switches import Task

STATUS = """Name:\tpt_gloo_runloop
State:\tS (sleeping)
Tgid:\t7003
Pid:\t9754
Cpus_allowed_list:\t0-1
voluntary_ctxt_switches:\t253
nonvoluntary_ctxt_switches:\t134
"""


def test_parse_status_reads_both_switch_counts():
    assert task_switches.parse_status(STATUS) == (253, 134)


def test_parse_status_refuses_a_file_without_the_counts():
    with pytest.raises(ValueError, match="context switch"):
        task_switches.parse_status("Name:\tpython\nvoluntary_ctxt_switches:\t3\n")


def test_snapshot_reads_a_task_folder(tmp_path):
    for tid, name, status in ((10, "python", STATUS.replace("253", "5")), (12, "gloo_tcp_loop", STATUS)):
        (tmp_path / str(tid)).mkdir()
        (tmp_path / str(tid) / "comm").write_text(name + "\n")
        (tmp_path / str(tid) / "status").write_text(status)
    assert task_switches.snapshot(str(tmp_path)) == {10: Task("python", 5, 134), 12: Task("gloo_tcp_loop", 253, 134)}


def test_snapshot_of_this_process_has_its_main_thread_and_a_started_one():
    stop = threading.Event()
    worker = threading.Thread(target=stop.wait)
    worker.start()
    try:
        tasks = task_switches.snapshot()
    finally:
        stop.set()
        worker.join()
    assert os.getpid() in tasks and worker.native_id in tasks
    assert tasks[os.getpid()].voluntary >= 0


def test_between_counts_a_thread_born_in_between_from_zero_and_drops_one_that_ended():
    before = {1: Task("python", 10, 4), 2: Task("gloo_tcp_loop", 100, 0), 3: Task("python", 1, 1)}
    after = {1: Task("python", 15, 4), 2: Task("gloo_tcp_loop", 160, 2), 4: Task("pt_gloo_runloop", 7, 1)}
    assert task_switches.between(before, after) == {
        1: Task("python", 5, 0), 2: Task("gloo_tcp_loop", 60, 2), 4: Task("pt_gloo_runloop", 7, 1)}


def test_json_round_trip():
    tasks = {7: Task("pt_gloo_runloop", 3, 4)}
    assert task_switches.from_json(task_switches.to_json(tasks)) == tasks


def test_thread_kinds_by_name():
    assert thread_kinds.kind(100, 100, "callgrind-amd64") == thread_kinds.MAIN
    assert thread_kinds.kind(101, 100, "gloo_tcp_loop") == thread_kinds.GLOO_LOOP
    assert thread_kinds.kind(102, 100, "pt_gloo_runloop") == thread_kinds.GLOO_WORKERS
    assert thread_kinds.kind(103, 100, "pt_nccl_watchdg") == thread_kinds.WATCHERS
    assert thread_kinds.kind(104, 100, "python") == thread_kinds.OTHER


def test_thread_numbers_follow_the_thread_ids_until_a_thread_ends():
    assert callgrind.thread_numbers({5, 9}, {5, 9, 12, 13}) == {1: 5, 2: 9, 3: 12, 4: 13}
    assert callgrind.thread_numbers({5, 9, 11}, {5, 9, 12}) is None


def _snap(tasks):
    return task_switches.to_json(tasks)


# A rank of pid 50: the main thread, an idle Python thread, Gloo's loop and one worker.
START = {50: Task("python", 0, 0), 51: Task("python", 0, 0)}
THREADS = {**START, 60: Task("gloo_tcp_loop", 0, 0), 61: Task("pt_gloo_runloop", 0, 0)}


def _record():
    def later(vol):
        return {tid: Task(t.name, t.voluntary + vol.get(tid, 0), t.nonvoluntary + 1) for tid, t in THREADS.items()}

    return {"pid": 50, "start": _snap(START), "turns": [
        {"label": "0:torch", "before": _snap(THREADS), "after": _snap(later({50: 20, 60: 40, 61: 10}))},
        {"label": "1:ours", "before": _snap(THREADS), "after": _snap(later({50: 10, 60: 30}))}]}


def test_instructions_are_summed_by_kind_of_thread_per_iteration():
    dumps = [callgrind.Dump("0:torch", 1, 1000), callgrind.Dump("0:torch", 2, 0), callgrind.Dump("0:torch", 3, 300),
             callgrind.Dump("0:torch", 4, 100), callgrind.Dump("1:ours", 1, 900), callgrind.Dump("1:ours", 2, 0),
             callgrind.Dump("1:ours", 3, 200), callgrind.Dump("1:ours", 4, 0)]
    assert thread_counts.instructions(_record(), dumps, 10) == {
        "torch": {"main": [100.0], "other": [0.0], "gloo tcp loop": [30.0], "gloo workers": [10.0]},
        "ours": {"main": [90.0], "other": [0.0], "gloo tcp loop": [20.0], "gloo workers": [0.0]}}


def test_dumps_that_do_not_match_the_threads_seen_are_numbered_not_named():
    dumps = [callgrind.Dump("0:torch", 1, 1000), callgrind.Dump("0:torch", 5, 300)]
    assert thread_counts.dump_kinds(_record(), dumps)["0:torch"] == {1: thread_kinds.MAIN, 5: thread_kinds.OTHER}


def test_switches_are_summed_by_kind_of_thread_per_iteration():
    counted = thread_counts.switches(_record(), 10)
    assert counted["torch"]["gloo tcp loop"] == {"threads": [1], "woken": [1], "voluntary": [4.0],
                                                 "nonvoluntary": [0.1]}
    assert counted["ours"]["gloo workers"]["voluntary"] == [0.0]
    assert counted["ours"]["gloo workers"]["woken"] == [1]  # an involuntary switch counts as woken
    assert counted["ours"]["other"]["threads"] == [1]
    assert set(counted["torch"]) == {"main", "other", "gloo tcp loop", "gloo workers"}


def test_present_orders_the_kinds_found():
    assert thread_counts.present({"torch": {"other": 1, "main": 2}, "ours": {"gloo workers": 3}}) == [
        "main", "gloo workers", "other"]
