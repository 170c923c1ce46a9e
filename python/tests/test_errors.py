"""Bad arguments raise, before or from the library, and leave no thread
and no process behind."""
import errno
import os
import socket
import threading
import time

import pytest
import torch

import starling
from conftest import open_swarm


def tasks():
    return len(os.listdir("/proc/self/task"))


def children():
    out = set()
    for t in os.listdir("/proc/self/task"):
        try:
            with open("/proc/self/task/%s/children" % t) as f:
                out |= set(f.read().split())
        except OSError:
            pass
    return out


def settle(base_threads, base_tasks, timeout=10):
    end = time.monotonic() + timeout
    while (threading.active_count() != base_threads or tasks() != base_tasks) and time.monotonic() < end:
        time.sleep(0.05)
    return threading.active_count(), tasks()


def free_udp_port():
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as u:
        u.bind(("127.0.0.1", 0))
        return u.getsockname()[1]


def test_errors_leave_nothing_behind(pair_swarm, tmp_path):
    # Warm up what starts threads once per process (torch's pools, BLAS).
    torch.randn(64, 64) @ torch.randn(64, 64)
    with open_swarm(pair_swarm) as s:
        starling.RemoteStages(s, "fmnist-mlp", 1).close()
    base = (threading.active_count(), tasks())
    kids = children()

    with open_swarm(pair_swarm) as s:
        # Unknown model: from the library (ENOENT).
        with pytest.raises(starling.UnknownModelError) as ei:
            starling.RemoteStages(s, "no-such-model", range(1, 2))
        assert ei.value.errno == errno.ENOENT and "no-such-model" in str(ei.value)
        with pytest.raises(starling.UnknownModelError):
            s.holders("no-such-model", 0)
        # Stages out of range, not consecutive, of the wrong type.
        for bad in (range(5, 7), (4, 6), -1, [1, 3], range(3, 1), range(1, 5, 2)):
            with pytest.raises(ValueError):
                starling.RemoteStages(s, "fmnist-mlp", bad)
        for bad in ("1-4", 1.5, None):
            with pytest.raises(TypeError):
                starling.RemoteStages(s, "fmnist-mlp", bad)
        with pytest.raises(ValueError) as ei:
            s.holders("fmnist-mlp", 6)
        assert isinstance(ei.value, starling.StarlingError) and ei.value.errno == errno.EINVAL
        with pytest.raises(ValueError):
            s.put("k", b"x" * 769)
        with pytest.raises(TypeError):
            s.put("k", "not bytes")

        rs = starling.RemoteStages(s, "fmnist-mlp", range(1, 5))
        # Wrong dtype, device, shape: caught before the library.
        with pytest.raises(TypeError):
            rs(torch.zeros(2, 512, dtype=torch.float64))
        with pytest.raises(TypeError):
            rs([[0.0] * 512])
        with pytest.raises(ValueError):
            rs(torch.zeros(2, 512, device="meta"))
        for shape in ((2, 511), (512,), (0, 512), (2, 2, 512)):
            with pytest.raises(ValueError):
                rs(torch.zeros(*shape))
        # A non-contiguous input is copied, not refused.
        rs.eval()
        x = torch.randn(512, 3).t()
        assert torch.allclose(rs(x), rs(x.contiguous()))
        rs.close()
        rs.close()  # idempotent
        with pytest.raises(starling.ClosedError):
            rs(torch.zeros(1, 512))
        rs2 = starling.RemoteStages(s, "fmnist-mlp", (2, 3))
    # The swarm's close closed rs2 too, and calls on a closed swarm raise.
    assert rs2.closed and s.closed
    with pytest.raises(starling.ClosedError):
        rs2(torch.zeros(1, 512))
    with pytest.raises(starling.ClosedError):
        s.models()
    s.close()

    # A stage nobody holds: StarlingTimeoutError (a TimeoutError) after
    # max_wait; closing the swarm from another thread while a call waits
    # there waits for it to end.
    with open_swarm(pair_swarm, max_wait=1.5) as s:
        rs0 = starling.RemoteStages(s, "fmnist-mlp", 0)
        t0 = time.monotonic()
        with pytest.raises(TimeoutError) as ei:
            rs0(torch.zeros(1, 784))
        assert isinstance(ei.value, starling.StarlingTimeoutError) and ei.value.errno == errno.ETIMEDOUT
        assert 1.0 < time.monotonic() - t0 < 10
        out = []
        th = threading.Thread(target=lambda: out.append(pytest.raises(starling.StarlingError, rs0,
                                                                      torch.zeros(1, 784))))
        th.start()
        time.sleep(0.3)
        s.close()
        th.join(30)
        assert not th.is_alive() and len(out) == 1
    assert rs0.closed

    # Nobody at the initial peer: UnreachableError within the join timeout.
    t0 = time.monotonic()
    with pytest.raises(starling.UnreachableError) as ei:
        starling.Swarm("127.0.0.1:%d" % free_udp_port(), join_timeout=2.0)
    assert time.monotonic() - t0 < 2.0 + 3.0
    assert ei.value.errno in (errno.EHOSTUNREACH, errno.EADDRNOTAVAIL) and ei.value.message
    # Under a swarm key the open swarm does not use: SwarmKeyError; a key
    # file that is not there: StarlingError (EIO).
    key = tmp_path / "swarm.key"
    fd = os.open(key, os.O_WRONLY | os.O_CREAT, 0o600)
    os.write(fd, b"ab" * 32 + b"\n")
    os.close(fd)
    with pytest.raises(starling.SwarmKeyError) as ei:
        starling.Swarm(pair_swarm.initial_peers, swarm_key=key, join_timeout=5.0)
    assert ei.value.errno == errno.EKEYREJECTED and "swarm key" in ei.value.message
    with pytest.raises(starling.StarlingError) as ei:
        starling.Swarm(pair_swarm.initial_peers, swarm_key=tmp_path / "missing.key", join_timeout=5.0)
    assert ei.value.errno == errno.EIO
    # Malformed lists and options: before or from the library.
    for bad in ("", "not an address", "127.0.0.1"):
        with pytest.raises(ValueError):
            starling.Swarm(bad, join_timeout=2.0)
    with pytest.raises(ValueError):
        starling.Swarm(pair_swarm.initial_peers, join_timeout=0)
    with pytest.raises(ValueError):
        starling.Swarm([])

    assert settle(*base) == base
    assert children() == kids
