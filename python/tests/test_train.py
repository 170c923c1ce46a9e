"""A short training loop: local input projection and head around the four
remote ResFFN stages (python/examples/fmnist_remote.py's model) lowers the
loss; a replica SIGKILLed mid-loop is retried on the other one."""
import os
import signal

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
    torch.manual_seed(1)
    x, y = data(1600)
    with open_swarm(kill_swarm, call_timeout=10, max_wait=30) as s:
        net = fm.Net(s)
        killed = []

        def on_step(step):
            if step == 10:
                killed.append(kill_swarm.kill("b", signal.SIGKILL))

        losses, _ = fm.train(net, x, y, batch=32, lr=2e-3, on_step=on_step)
        assert killed == [-signal.SIGKILL]
        assert len(losses) == 50 and all(l == l for l in losses)
        c = net.body.counters
        assert c["retries"] > 0, c
        served = {sv.holder for sv in net.body.last_served}
        assert served == {kill_swarm.ids["a"]}, (served, kill_swarm.ids)
