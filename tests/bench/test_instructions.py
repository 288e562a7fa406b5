"""`instructions`: reading callgrind's dumps, and a counted run end to end.

The pure pieces are checked on dump files written here. The end-to-end run
needs valgrind (where it is missing the test says so and is skipped; CI
installs it), and fails if ddp_ext adds more instructions per iteration to
local training than torch's DDP does, or wakes a thread torch's DDP does not.
The per-thread pieces have their tests in test_thread_counts.py."""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("matplotlib", reason="the benchmark suite needs matplotlib (the `bench` extra)")

from benchmarks.experiments.instructions import KINDS, _wait, per_iteration, turns  # noqa: E402
from benchmarks.harness import callgrind  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _write_dump(path, label, total):
    with open(path, "w") as f:
        f.write(f"version: 1\ncreator: callgrind-3.19.0\ndesc: I1 cache: \ndesc: Trigger: dump {label}\n"
                f"events: Ir\nsummary: {total}\nfn=(1) main\n0 {total}\ntotals: {total}\n")


def test_read_dumps_takes_each_labelled_dump_per_thread_and_leaves_the_exit_dump_out(tmp_path):
    base = str(tmp_path / "rank0")
    _write_dump(base + ".1-01", "0:local", 1000)
    _write_dump(base + ".1-03", "0:local", 70)
    _write_dump(base + ".2-01", "1:ours", 1500)
    _write_dump(base + "-01", "", 99999)  # written at exit, not labelled by a turn
    _write_dump(str(tmp_path / "rank1.1-01"), "0:local", 5)  # another rank's
    dumps = callgrind.read_dumps(base)
    assert sorted((d.label, d.thread, d.instructions) for d in dumps) == [
        ("0:local", 1, 1000), ("0:local", 3, 70), ("1:ours", 1, 1500)]


def test_read_dumps_refuses_a_file_without_a_summary(tmp_path):
    (tmp_path / "rank0.1-01").write_text("desc: Trigger: dump 0:local\n")
    with pytest.raises(ValueError, match="summary"):
        callgrind.read_dumps(str(tmp_path / "rank0"))


def test_per_iteration_splits_the_main_thread_from_the_others_turn_by_turn():
    dumps = [callgrind.Dump("0:torch", 1, 2000), callgrind.Dump("0:torch", 3, 400), callgrind.Dump("0:torch", 4, 200),
             callgrind.Dump("1:ours", 1, 1800), callgrind.Dump("2:torch", 1, 2200), callgrind.Dump("2:torch", 3, 0)]
    assert per_iteration(dumps, 10) == {"torch": {"main": [200.0, 220.0], "other_threads": [60.0, 0.0]},
                                        "ours": {"main": [180.0], "other_threads": [0.0]}}


def test_turns_alternate_the_order_of_the_variants():
    assert turns(2) == [*KINDS, *reversed(KINDS)]
    assert turns(1) == list(KINDS)


def test_the_environment_keeps_the_callers_tunables_and_adds_the_copy_thresholds():
    env = callgrind.environment({"GLIBC_TUNABLES": "glibc.malloc.check=0", "A": "1"})
    assert env["A"] == "1"
    assert env["GLIBC_TUNABLES"].startswith("glibc.malloc.check=0:glibc.cpu.x86_rep_movsb_threshold=")
    assert "x86_rep_stosb_threshold" in callgrind.environment({})["GLIBC_TUNABLES"]


def test_a_failed_rank_stops_the_others_at_once():
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    failing = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    assert _wait([sleeper, failing], timeout_s=120) == [(1, "rank 1 exited with 3")]
    assert sleeper.poll() is not None  # killed, not left to wait at a barrier


def test_counted_run_reports_ddp_work_and_a_control_near_torch(tmp_path):
    missing = callgrind.missing_tools()
    if missing:
        print(f"skipped: {', '.join(missing)} not on PATH (apt-get install valgrind)")
        pytest.skip(f"{', '.join(missing)} not on PATH")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    command = [sys.executable, "-m", "benchmarks", "instructions", "--world-size", "2", "--out", str(tmp_path),
               "--warmup", "20", "--blocks", "1", "--block-iterations", "50"]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{' '.join(command)} failed:\n{done.stdout}\n{done.stderr}"
    with open(tmp_path / "instructions.json") as f:
        measured = json.load(f)["models"]["tinymlp"]
    counts = measured["per_iteration"]
    assert set(counts) == set(KINDS)
    for kind in ("torch", "ours", "torch_control"):
        # A DDP iteration does all local training does and then some.
        assert counts[kind]["ddp_main"] > 0.05 * counts["local"]["main"], (kind, counts)
    # Two identical torch DDPs count within a few percent of each other.
    assert 0.9 < measured["control_over_torch_ddp_main"] < 1.1, measured
    # ddp_ext's fixed cost, as work: per iteration it adds less to local
    # training than torch's DDP does (0.96 to 0.97 of it in 50- and
    # 200-iteration turns). 50 iterations hold one straggler exchange (every
    # 50 training steps by default), as a long run holds one per 50.
    assert measured["ours_over_torch_ddp_main"] < 1.0, (
        "ddp_ext now adds more instructions per iteration than torch's DDP: "
        f"{counts['ours']['ddp_main']:.0f} against {counts['torch']['ddp_main']:.0f}")
    assert "| tinymlp | torch DDP, second replica |" in done.stdout, done.stdout
    # Thread by thread: each DDP runs on the main thread, Gloo's loop and its
    # two workers, and ddp_ext wakes no thread torch's DDP does not.
    threads = measured["per_thread"]
    for kind in ("torch", "ours"):
        assert {"main", "gloo tcp loop", "gloo workers"} <= set(threads[kind]), threads[kind]
        assert threads[kind]["gloo workers"]["threads"] == 2 and threads[kind]["gloo workers"]["instructions"] > 0
    woken = {kind: sum(c.get("woken", 0) for c in threads[kind].values()) for kind in ("torch", "ours")}
    assert woken["ours"] <= woken["torch"], (woken, threads)
    assert "| gloo workers (2) | instructions |" in done.stdout, done.stdout
