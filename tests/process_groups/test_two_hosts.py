"""Two hosts: ddp_ext trains across two network namespaces joined by a veth
pair, started by `torchrun --nnodes=2` with c10d rendezvous.

Each namespace is a host with one address on the veth (10.213.0.1 and
10.213.0.2, which exist only inside the namespaces) and its own loopback;
Gloo is told to use the veth (GLOO_SOCKET_IFNAME). The test checks that both
hosts end with bitwise identical parameters equal to local training on the
concatenated batch, then that when host 1's worker is SIGKILLed mid-training,
host 0's worker raises within ERROR_BOUND_S (its process group timeout is
20 s, so an error that quick comes from the lost connection, not a timeout).

Needs root (`ip netns add`); skips, saying why, otherwise. The namespaces
(made by benchmarks/harness/fake_hosts.py), and any process left in them, are
removed whatever happens.
"""

import itertools
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from tests.support import namespace_hosts, reference
from tests.support import two_host_train as worker
from tests.support.harness import assert_states_close, same_bits

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "tests", "support", "two_host_train.py")

LAUNCH_TIMEOUT_S = 120  # per torchrun launch (both hosts)
ERROR_BOUND_S = 10.0
RDZV_PORT = 29400  # free: the namespaces are new
_runs = itertools.count()


@pytest.fixture
def hosts():
    with namespace_hosts.two_hosts("two-host test", f"t{next(_runs)}") as pair:
        yield pair


def _launch(pair, out: str, mode: str):
    """Runs torchrun in both namespaces; returns (exit codes, both logs),
    failing the test if they do not finish within LAUNCH_TIMEOUT_S."""
    procs, logs = [], []
    run_id = f"two_hosts_{os.path.basename(out)}"
    for i, h in enumerate(pair):
        # The machine's hostname resolves outside the namespaces: each host
        # names its own address (--local-addr) and says whether it serves
        # the rendezvous store (is_host).
        env = dict(os.environ, PYTHONPATH=ROOT, GLOO_SOCKET_IFNAME=h.veth, TWO_HOST_INDEX=str(i), OMP_NUM_THREADS="1")
        command = ["ip", "netns", "exec", h.netns, sys.executable, "-m", "torch.distributed.run",
                   "--nnodes=2", "--nproc-per-node=1", "--max-restarts=0", "--rdzv-backend=c10d",
                   f"--rdzv-endpoint={pair[0].addr}:{RDZV_PORT}", f"--rdzv-id={run_id}",
                   f"--rdzv-conf=is_host={int(i == 0)}", f"--local-addr={h.addr}",
                   SCRIPT, out, mode]  # fmt: skip
        logs.append(os.path.join(out, f"torchrun_host{i}.log"))
        with open(logs[-1], "w") as log:
            procs.append(subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                          start_new_session=True))  # fmt: skip
    deadline = time.monotonic() + LAUNCH_TIMEOUT_S
    hung = False
    try:
        for p in procs:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        hung = True
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)  # its workers die with their namespace
                p.wait(timeout=30)
    codes = [p.returncode for p in procs]
    text = "\n".join(f"--- host {i} (exit {c}) ---\n{open(path).read()[-4000:]}" for i, (c, path) in
                     enumerate(zip(codes, logs)))  # fmt: skip
    if hung:
        pytest.fail(f"torchrun did not finish within {LAUNCH_TIMEOUT_S} s:\n{text}")
    return codes, text


def _read_json(out: str, name: str, what: str):
    path = os.path.join(out, name)
    assert os.path.exists(path), f"{name} missing: {what}"
    with open(path) as f:
        return json.load(f)


def test_two_hosts_train_alike_and_a_lost_host_fails_the_other(hosts, tmp_path):
    # 1. Training: both hosts alike, and equal to local training.
    out = os.fspath(tmp_path / "train")
    os.mkdir(out)
    codes, logs = _launch(hosts, out, "train")
    assert codes == [0, 0], logs
    traces = [torch.load(os.path.join(out, f"host{i}.pt"), weights_only=False) for i in range(2)]
    assert sorted(t["rank"] for t in traces) == [0, 1], logs
    for name, p in traces[0]["params"].items():
        assert same_bits(p, traces[1]["params"][name]), f"`{name}` differs between the hosts"
    local = reference.train_local(worker.CASE, 2, concat=True)
    assert_states_close(traces[0]["params"], local["params"], "two hosts vs local training")
    assert traces[0]["grad_none"] == local["grad_none"]

    # 2. Host 1's worker dies mid-training: host 0's raises, quickly.
    out = os.fspath(tmp_path / "kill")
    os.mkdir(out)
    codes, logs = _launch(hosts, out, "kill")
    killed = _read_json(out, "killed.json", f"host 1 never reached step {worker.KILL_STEP}\n{logs}")
    error = _read_json(out, "error.json", f"host 0 did not raise\n{logs}")
    assert codes[0] != 0 and codes[1] != 0, logs
    assert not os.path.exists(os.path.join(out, "finished0.json")), logs
    assert error["step"] >= worker.KILL_STEP, error
    seconds = error["at"] - killed["at"]
    print(f"\nhost 0 raised {seconds:.2f} s after host 1's worker was killed "
          f"(process group timeout {worker.PG_TIMEOUT_S} s): {error['type']}: {error['message'][:300]}")  # fmt: skip
    assert 0 <= seconds < ERROR_BOUND_S, f"host 0 raised {seconds:.1f} s after the kill: {error}"
    assert error["type"] in ("DistBackendError", "RuntimeError", "DistNetworkError"), error
    assert hosts[1].addr in error["message"], error  # Gloo's connection ran over the veth
