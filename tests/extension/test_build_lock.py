"""ddp_ext's JIT build lock: a stale torch lock file is removed with a word,
and a live build elsewhere is waited for, within a bound."""

import fcntl
import os
import time

import pytest

from ddp_ext._build_lock import OWN_LOCK_NAME, TORCH_LOCK_NAME, BuildLockTimeout, build_lock


def test_stale_torch_lock_is_reported_and_removed(tmp_path, capsys):
    torch_lock = tmp_path / TORCH_LOCK_NAME
    torch_lock.touch()  # what a killed build leaves behind
    with build_lock(str(tmp_path), timeout_s=5):
        assert not torch_lock.exists()
        assert (tmp_path / OWN_LOCK_NAME).read_text() == str(os.getpid())
    assert f"removing {torch_lock}, a stale lock file" in capsys.readouterr().err


def test_no_word_without_a_stale_lock(tmp_path, capsys):
    with build_lock(str(tmp_path), timeout_s=5):
        pass
    with build_lock(str(tmp_path), timeout_s=5):  # the lock is free again once released
        pass
    assert capsys.readouterr().err == ""


def test_live_build_elsewhere_times_out_naming_the_files(tmp_path, capsys):
    own_lock = tmp_path / OWN_LOCK_NAME
    with open(own_lock, "w") as holder:  # another build holds the lock
        holder.write("4242")
        holder.flush()
        fcntl.flock(holder, fcntl.LOCK_EX)
        started = time.monotonic()
        with pytest.raises(BuildLockTimeout) as raised:
            with build_lock(str(tmp_path), timeout_s=1, poll_s=0.1):
                pytest.fail("acquired a lock that another build holds")
        assert time.monotonic() - started < 10
    message = str(raised.value)
    assert "process 4242" in message and str(own_lock) in message and str(tmp_path / TORCH_LOCK_NAME) in message
    assert "waiting for process 4242" in capsys.readouterr().err
