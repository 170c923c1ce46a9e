"""A swarm of `starling` processes on loopback, for tests and examples.

    with starling.local.LocalSwarm() as ls:
        ls.start_peer("a", "1-4")
        ls.start_peer("b", "1-4", "--target-batch", "16")
        with starling.Swarm(ls.initial_peers) as swarm:
            ...

Every process is started with its output in a temporary directory, every
wait is bounded, and stop() (also at exit of the with block, and at
interpreter exit) sends SIGTERM, then SIGKILL after a grace period, and
reaps every process it started.

The `starling` binary: the binary argument, else $STARLING, else the
checkout's build directories (build-py, build, build-release) when the
package runs from a checkout, else `starling` on PATH.
"""
import atexit
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
import weakref

__all__ = ["LocalSwarm", "find_binary"]

_live = weakref.WeakSet()


def find_binary(binary=None):
    """The path of the `starling` binary (see the module's doc)."""
    if binary:
        return binary
    env = os.environ.get("STARLING")
    if env:
        return env
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    if os.path.isfile(os.path.join(root, "meson.build")):
        for d in ([os.environ["STARLING_BUILD_DIR"]] if os.environ.get("STARLING_BUILD_DIR") else []) + [
                "build", "build-release", "build-py"]:
            p = os.path.join(root, d, "tools", "starling")
            if os.access(p, os.X_OK):
                return p
    p = shutil.which("starling")
    if p:
        return p
    raise FileNotFoundError("no starling binary: set STARLING to its path or build Starling "
                            "(meson setup build && ninja -C build)")


class LocalSwarm:
    """A bootstrap node and peers on 127.0.0.1 (see the module's doc)."""

    def __init__(self, binary=None, *, workdir=None, env=None, keep=False):
        self.binary = find_binary(binary)
        self.dir = workdir or tempfile.mkdtemp(prefix="starling-local-")
        self._own_dir = workdir is None and not keep
        self.env = dict(os.environ)
        self.env.setdefault("OPENBLAS_NUM_THREADS", "1")
        self.env.pop("STARLING_LIBRARY", None)
        if env:
            self.env.update(env)
        # setpriv --pdeathsig KILL (util-linux): a process whose parent dies
        # (a crashed test, a killed example) dies too instead of lingering.
        sp = shutil.which("setpriv")
        self._prefix = [sp, "--pdeathsig", "KILL", "--"] if sp else []
        self.procs = {}       # name -> Popen
        self.ids = {}         # name -> node ID (hex)
        self.initial_peers = None
        _live.add(self)

    # -- processes
    def _spawn(self, name, args):
        out = open(os.path.join(self.dir, name + ".out"), "w")
        err = open(os.path.join(self.dir, name + ".err"), "w")
        try:
            p = subprocess.Popen(self._prefix + [self.binary] + args, stdout=out, stderr=err, stdin=subprocess.DEVNULL,
                                 env=self.env)
        finally:
            out.close()
            err.close()
        self.procs[name] = p
        return p

    def log(self, name, which="err"):
        try:
            with open(os.path.join(self.dir, "%s.%s" % (name, which)), errors="replace") as f:
                return f.read()
        except OSError:
            return ""

    def _fail(self, name, what):
        tail = "\n".join(self.log(name, "err").splitlines()[-20:])
        raise RuntimeError("%s: %s\n--- %s.err (last lines):\n%s" % (name, what, name, tail))

    def _wait_line(self, name, which, regex, timeout):
        end = time.monotonic() + timeout
        pat = re.compile(regex, re.M)
        p = self.procs[name]
        while True:
            m = pat.search(self.log(name, which))
            if m:
                return m
            if p.poll() is not None:
                m = pat.search(self.log(name, which))
                if m:
                    return m
                self._fail(name, "exited with status %s before printing %r" % (p.returncode, regex))
            if time.monotonic() > end:
                self._fail(name, "no line matching %r within %g s" % (regex, timeout))
            time.sleep(0.05)

    def start_bootstrap(self, timeout=60):
        """Starts the bootstrap node; returns (and sets) initial_peers."""
        self._spawn("bootstrap", ["bootstrap", "--listen", "127.0.0.1:0"])
        m = self._wait_line("bootstrap", "out", r"^(\S+/[0-9a-f]{40})$", timeout)
        self.initial_peers = m.group(1)
        return self.initial_peers

    def start_peer(self, name, blocks, *extra, model=None, wait=True, timeout=120):
        """Starts a peer hosting `blocks` ("1-4", "0,5"); waits (bounded) until
        it is online and its announcements can be found, unless wait=False."""
        if self.initial_peers is None:
            self.start_bootstrap()
        if name in self.procs:
            raise ValueError("a process named %r exists" % name)
        args = ["peer", "--initial-peers", self.initial_peers, "--blocks", str(blocks), "--listen",
                "127.0.0.1:0", "--blas-threads", "1"]
        if model:
            args += ["--model", model]
        self._spawn(name, args + [str(a) for a in extra])
        if wait:
            self.wait_online(name, model=model, timeout=timeout)
        return self.procs[name]

    def wait_online(self, name, model=None, timeout=120):
        """Waits for the peer's "online: announcing N block(s)" line, then for
        `starling monitor` to show it online on N stages."""
        end = time.monotonic() + timeout
        m = self._wait_line(name, "err", r"online: announcing (\d+) block", timeout)
        n = int(m.group(1))
        m = self._wait_line(name, "out", r"address \S*/([0-9a-f]{40})$", max(1.0, end - time.monotonic()))
        nid = self.ids[name] = m.group(1)
        pat = re.compile(r'"id":"%s","addr":"[^"]*","state":"online"' % nid)
        args = [self.binary, "monitor", "--json", "--initial-peers", self.initial_peers]
        if model:
            args += ["--model", model]
        while True:
            left = end - time.monotonic()
            if left <= 0:
                self._fail(name, "its announcements never became visible within %g s" % timeout)
            try:
                r = subprocess.run(args, capture_output=True, text=True, timeout=max(1.0, min(30.0, left)),
                                   env=self.env)
                if len(pat.findall(r.stdout)) >= n:
                    return nid
            except subprocess.TimeoutExpired:
                pass
            time.sleep(0.2)

    def kill(self, name, sig=signal.SIGKILL, timeout=10):
        """Sends sig to the process and, for SIGKILL/SIGTERM, reaps it
        (SIGKILL after timeout)."""
        p = self.procs[name]
        if p.poll() is None:
            p.send_signal(sig)
        if sig in (signal.SIGKILL, signal.SIGTERM):
            try:
                p.wait(timeout)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(10)
        return p.returncode

    def pids(self):
        return {n: p.pid for n, p in self.procs.items()}

    def stop(self, grace=5.0):
        """SIGTERM to every process, SIGKILL to those still running after
        grace seconds; reaps them all. Idempotent."""
        procs = list(self.procs.values())
        for p in procs:
            if p.poll() is None:
                try:
                    p.terminate()
                except OSError:
                    pass
        end = time.monotonic() + grace
        for p in procs:
            try:
                p.wait(max(0.0, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for p in procs:
            if p.poll() is None:
                try:
                    p.kill()
                except OSError:
                    pass
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    pass
        if self._own_dir and os.path.isdir(self.dir):
            shutil.rmtree(self.dir, ignore_errors=True)
            self._own_dir = False

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


@atexit.register
def _stop_all():
    for ls in list(_live):
        ls.stop(grace=2.0)
