"""HF Accelerate trains with ddp_ext's DDP (ddp_ext.integrations.accelerate.
Accelerator) to the same parameters as with torch's DDP, on 2 CPU ranks
started by `accelerate launch`: prepare, accumulate (no_sync), no_sync with
trigger_sync_in_backward, DDP arguments and comm hooks (FP16, PowerSGD)
chosen through DistributedDataParallelKwargs, unwrap_model, save_state and
load_state.

One launch runs every case (tests/support/accelerate_train.py); the tests read its
per-rank results.
"""

import importlib.util
import os
import signal
import socket
import subprocess
import sys
import tempfile

import pytest
import torch

from tests.support import frameworks
from tests.support.harness import assert_states_close, same_bits

# Checked without importing it: only the ranks import accelerate.
pytestmark = pytest.mark.skipif(importlib.util.find_spec("accelerate") is None, reason="needs the test extra")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "tests", "support", "accelerate_train.py")
TIMEOUT_S = 300


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_launch():
    with tempfile.TemporaryDirectory(prefix="ddp_ext_accelerate_") as out:
        # Without MPI, `accelerate launch --cpu` starts one process only;
        # --multi_gpu starts them through torchrun, and the script's
        # Accelerator(cpu=True) makes them CPU ranks over Gloo.
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
               "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
               "--main_process_port", str(_free_port()), SCRIPT, out]  # fmt: skip
        env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
        log_path = os.path.join(out, "launch.log")
        hung = False
        with open(log_path, "w") as log:
            proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            try:
                proc.wait(timeout=TIMEOUT_S)
            except subprocess.TimeoutExpired:
                hung = True
                # torchrun ends its workers (each in a session of its own) on SIGTERM.
                proc.terminate()
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
        with open(log_path) as log:
            output = log.read()
        if hung or proc.returncode != 0:
            what = f"hung ({TIMEOUT_S} s limit)" if hung else f"failed (exit {proc.returncode})"
            raise AssertionError(f"accelerate launch {what}:\n{output}")
        return [torch.load(os.path.join(out, f"rank{r}.pt"), weights_only=False) for r in range(2)]


_LAUNCH = []


def _launch():
    """Every rank's {case id: (ok, results or traceback)}, from one launch
    (whose failure every test then reports)."""
    if not _LAUNCH:
        try:
            _LAUNCH.append(_run_launch())
        except AssertionError as failure:
            _LAUNCH.append(failure)
    if isinstance(_LAUNCH[0], AssertionError):
        raise _LAUNCH[0]
    return _LAUNCH[0]


def _results(case_id):
    per_rank = [by_case[case_id] for by_case in _launch()]
    failed = [f"--- rank {r} ---\n{v}" for r, (ok, v) in enumerate(per_rank) if not ok]
    if failed:
        raise AssertionError(f"case {case_id} raised:\n" + "\n".join(failed))
    return [v for _, v in per_rank]


def _parity(case_id):
    results = _results(case_id)
    frameworks.assert_parity(
        [{"ext": r["ext"]["params"], "torch": r["torch"]["params"]} for r in results], f"Accelerate {case_id}"
    )
    return results


CASES = ["prepare", "accumulate", "trigger_sync", "ddp_kwargs", "comm_hook_fp16", "comm_hook_power_sgd"]


@pytest.mark.parametrize("case_id", CASES)
def test_accelerate_matches_torch_ddp(case_id):
    results = _parity(case_id)
    if case_id.startswith("comm_hook"):
        # The hook changes the result, so parity shows ddp_ext ran it too.
        plain = _results("prepare")[0]["torch"]["params"]
        hooked = results[0]["torch"]["params"]
        assert any(not torch.allclose(hooked[n], plain[n], rtol=1e-5, atol=1e-6) for n in plain), case_id


def test_accelerate_passes_ddp_kwargs():
    for r in _results("ddp_kwargs"):
        assert r["ext"]["chosen"] == r["torch"]["chosen"] == dict(
            bucket_bytes_cap=2**20, find_unused_parameters=True, gradient_as_bucket_view=True
        ), r["ext"]["chosen"]


def test_accelerate_wraps_in_ddp_ext():
    for r in _results("prepare"):
        assert r["ext"]["wrapper"] == "ddp_ext.distributed.DistributedDataParallel", r["ext"]["wrapper"]
        assert r["torch"]["wrapper"] == "torch.nn.parallel.distributed.DistributedDataParallel"


def test_accelerate_unwrap_model():
    for r in _results("prepare"):
        assert r["torch"]["unwrapped_is_net"]
        assert r["ext"]["unwrapped_is_net"], "unwrap_model did not return the module that was prepared"


def test_accelerate_save_and_load_state():
    for rank, r in enumerate(_results("prepare")):
        ext, reference = r["ext"], r["torch"]
        assert_states_close(ext["saved"], reference["saved"], f"rank {rank}: save_state model file")
        assert_states_close(ext["loaded"], ext["params"], f"rank {rank}: parameters after load_state")
        for loaded, trained in zip(ext["loaded_momentum"], ext["momentum"]):
            assert same_bits(loaded, trained), f"rank {rank}: optimizer state after load_state"
