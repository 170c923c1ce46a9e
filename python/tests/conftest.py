"""Fixtures: loopback swarms of `starling` processes ($STARLING), the
package from this checkout (PYTHONPATH=python, STARLING_LIBRARY = the
built library).

Every process a fixture starts is killed and reaped at teardown, also when
a test fails; every wait is bounded (starling.local)."""
import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
PYDIR = os.path.dirname(HERE)
if PYDIR not in sys.path:
    sys.path.insert(0, PYDIR)

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import torch  # noqa: E402

torch.set_num_threads(1)  # 2 cores: the peers need the other one

import starling  # noqa: E402
import starling.local  # noqa: E402

if not os.environ.get("STARLING"):
    try:
        os.environ["STARLING"] = starling.local.find_binary()
    except FileNotFoundError:
        pass

TARGET_BATCH = 16  # the peers' --target-batch: a step every 16 rows of gradient


def _swarm(peers):
    """A LocalSwarm with the given peers [(name, blocks, flags...)]."""
    ls = starling.local.LocalSwarm(os.environ.get("STARLING"))
    try:
        ls.start_bootstrap()
        for name, blocks, *flags in peers:
            ls.start_peer(name, blocks, *flags)
    except BaseException:
        ls.stop()
        raise
    return ls


@pytest.fixture(scope="module")
def fresh_swarm():
    """Bootstrap + one peer holding fmnist-mlp's stages 1-4 at weight version
    0 (for the exactness tests), stepping every TARGET_BATCH rows."""
    ls = _swarm([("a", "1-4", "--target-batch", TARGET_BATCH)])
    yield ls
    ls.stop()


@pytest.fixture(scope="session")
def pair_swarm():
    """Bootstrap + two peers both holding fmnist-mlp's stages 1-4."""
    ls = _swarm([("a", "1-4", "--target-batch", 32), ("b", "1-4", "--target-batch", 32)])
    yield ls
    ls.stop()


@pytest.fixture
def kill_swarm():
    """As pair_swarm, for a test that kills one of the peers."""
    ls = _swarm([("a", "1-4", "--target-batch", 32), ("b", "1-4", "--target-batch", 32)])
    yield ls
    ls.stop()


def open_swarm(ls, **kw):
    kw.setdefault("join_timeout", 15.0)
    kw.setdefault("call_timeout", 20.0)
    kw.setdefault("max_wait", 30.0)
    kw.setdefault("seed", 7)
    return starling.Swarm(ls.initial_peers, **kw)


@pytest.fixture
def swarm_of():
    """swarm_of(local_swarm, **options): a starling.Swarm on it, closed at
    teardown."""
    opened = []

    def make(ls, **kw):
        s = open_swarm(ls, **kw)
        opened.append(s)
        return s

    yield make
    for s in opened:
        s.close()


def load_example(name):
    """Imports python/examples/<name>.py as a module."""
    import importlib.util
    path = os.path.join(PYDIR, "examples", name + ".py")
    spec = importlib.util.spec_from_file_location("example_" + name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
