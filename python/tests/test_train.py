"""A short training loop: local input projection and head around the four
remote ResFFN stages (python/examples/fmnist_remote.py's model) lowers the
loss; a replica SIGKILLed mid-loop is retried on the other one."""
import os
import signal
import threading
import time

import torch

from conftest import load_example, open_swarm

fm = load_example("fmnist_remote")


def data(n):
    if os.path.isdir(fm.DATA_DIR):
        return fm.load_fmnist("train", limit=n)
    # No dataset package: two separable synthetic classes' worth of signal.
    g = torch.Generator().manual_seed(0)
    y = torch.randint(0, 10, (n,), generator=g)
    x = torch.randn(n, 784, generator=g) * 0.5
    x[torch.arange(n), y * 7] += 3.0
    return x, y


def test_training_lowers_the_loss(pair_swarm):
    torch.manual_seed(0)
    x, y = data(1280)
    with open_swarm(pair_swarm) as s:
        net = fm.Net(s)
        losses, _ = fm.train(net, x, y, batch=32, lr=2e-3)
        first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
        assert all(l == l for l in losses)  # no NaN
        assert last < 0.7 * first, (first, last)
        # Both replicas served.
        assert net.body.counters["calls"] >= 8 * len(losses)


def test_killed_replica_is_retried(kill_swarm):
    """Peer b is SIGKILLed with a call out on it: the call is sent again to
    peer a and the loop finishes. (A peer killed between calls is noticed
    by its closed connection and skipped without a retry; to have a call
    surely out on b when it dies, b is stopped (SIGSTOP) first, and killed
    a second later, while the loop waits on it.)"""
    torch.manual_seed(1)
    x, y = data(1600)
    with open_swarm(kill_swarm, call_timeout=10, max_wait=30) as s:
        net = fm.Net(s)
        timers, attempts = [], []

        def on_step(step):
            attempts.append(max(sv.attempts for sv in net.body.last_served))
            if step == 10:
                kill_swarm.kill("b", signal.SIGSTOP)
                t = threading.Timer(1.0, kill_swarm.kill, ("b", signal.SIGKILL))
                t.start()
                timers.append(t)

        t0 = time.monotonic()
        losses, _ = fm.train(net, x, y, batch=32, lr=2e-3, on_step=on_step)
        for t in timers:
            t.join(30)
        assert kill_swarm.procs["b"].returncode == -signal.SIGKILL
        assert len(losses) == 50 and all(l == l for l in losses)
        c = net.body.counters
        assert c["retries"] > 0 and max(attempts) > 1, (c, attempts)
        served = {sv.holder for sv in net.body.last_served}
        assert served == {kill_swarm.ids["a"]}, (served, kill_swarm.ids)
        assert time.monotonic() - t0 < 60
