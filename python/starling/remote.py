"""starling.RemoteStages: consecutive stages of a swarm's model as a
torch.nn.Module."""
import collections
import ctypes
import weakref

import torch

from . import _lib
from .errors import error_from_code
from .swarm import Swarm, _enc

__all__ = ["RemoteStages", "Served"]


Served = collections.namedtuple("Served", ["holder", "weight_version", "attempts"])
Served.__doc__ = """Who served one stage of the last forward: the holder's node ID (40 hex
digits), the weight version it computed on (None when it did not say) and
the calls it took (1: no retry). With a batch cut into several calls (more
rows than .max_rows), the last call's."""


def _parse_stages(stages, n_stages, model):
    if isinstance(stages, bool):
        raise TypeError("stages must be an int, a range, a sequence of consecutive ints or (first, last)")
    if isinstance(stages, int):
        first = last = stages
    elif isinstance(stages, range):
        if stages.step != 1 or len(stages) == 0:
            raise ValueError("stages %r: want a non-empty range with step 1" % (stages,))
        first, last = stages[0], stages[-1]
    elif isinstance(stages, tuple) and len(stages) == 2:
        first, last = stages
    elif isinstance(stages, (list, tuple)):
        if not stages:
            raise ValueError("stages is empty")
        first, last = stages[0], stages[-1]
        if not isinstance(first, int) or list(stages) != list(range(first, first + len(stages))):
            raise ValueError("stages %r are not consecutive ints" % (stages,))
    else:
        raise TypeError("stages must be an int, a range, a sequence of consecutive ints or (first, last), "
                        "not %s" % type(stages).__name__)
    for v in (first, last):
        if not isinstance(v, int) or isinstance(v, bool):
            raise TypeError("stage indices must be ints, not %s" % type(v).__name__)
    if not 0 <= first <= last < n_stages:
        raise ValueError("stages %d..%d are out of range: model %s has stages 0..%d"
                         % (first, last, model, n_stages - 1))
    return first, last


def _rows_ptr(t, row, width):
    return t.data_ptr() + row * width * 4


def _close_stages(swarm_guard, guard):
    """Closes the stages' C handle while the swarm's is open (entered, so a
    Swarm.close() on another thread waits); once the swarm is closed its
    close has freed the stages' handle already."""
    try:
        swarm_guard.enter("the swarm")
    except Exception:
        guard.close(lambda ptr: None)
        return
    try:
        guard.close(_lib.lib.starling_stages_close)
    finally:
        swarm_guard.leave()


class _RemoteFn(torch.autograd.Function):
    """Forward through every stage (a training forward), backward from the
    last stage to the first with each stage's served."""

    @staticmethod
    def forward(ctx, rs, x, _dummy):
        ys, served = rs._forward_all(x, training=True)
        ctx.rs = rs
        ctx.save_for_backward(x)
        ctx.inner = ys[:-1]  # the inputs of stages first+1..last
        ctx.served = served
        return ys[-1]

    @staticmethod
    def backward(ctx, gy):
        rs = ctx.rs
        if ctx.served is None:
            raise RuntimeError("RemoteStages: backward through the same forward twice (retain_graph=True) is not "
                               "supported: the peers took the first one's gradients already")
        (x,) = ctx.saved_tensors
        inputs = [x] + list(ctx.inner)
        dy = gy.to(torch.float32).contiguous()
        dx = None
        n = len(inputs)
        for k in range(n - 1, -1, -1):
            stage = rs.first + k
            want_dx = k > 0 or ctx.needs_input_grad[1]
            dx = torch.empty(inputs[k].shape, dtype=torch.float32) if want_dx else None
            rs._backward(stage, inputs[k], dy, dx, ctx.served[k])
            dy = dx
        ctx.inner = ctx.served = None
        return None, dx, None


class RemoteStages(_lib.Closable, torch.nn.Module):
    """Stages `stages` of `model`, served by the swarm's peers, as a module.

    stages: a range or sequence of consecutive stage indices, (first, last)
    inclusive, or one int. forward(x) takes a float32 CPU tensor whose
    first dimension is the batch and whose other dimensions flatten to the
    first stage's input width (in_width), and returns (B, *out_shape) of
    the last stage. In training mode with autograd enabled, the forward is
    a training forward and backward() sends the output's gradient through
    the stages from the last to the first (the holders accumulate the
    parameter gradients and step their own optimizers at their target
    batch); otherwise it is an inference call, and the output has no
    gradient.

    The stages' parameters live on the peers: this module has no
    Parameters, and a local optimizer never sees them.

    Tensors are passed to C without copies when they are contiguous
    float32 CPU tensors (others are converted first); outputs are
    allocated with torch.empty and written by the library. The GIL is
    released during every call, so several Python threads may call
    forward/backward at once (micro-batches in flight).
    """

    def __init__(self, swarm, model, stages):
        super().__init__()
        if not isinstance(swarm, Swarm):
            raise TypeError("swarm must be a starling.Swarm, not %s" % type(swarm).__name__)
        info = swarm.model_info(model)  # UnknownModelError for a model nobody knows
        first, last = _parse_stages(stages, len(info["stages"]), model)
        self.swarm = swarm
        self.model = model
        self.first, self.last = first, last
        self.info = info
        m = _enc(model, "model")

        def open_stages(p):
            # Open, read the shapes and register under the swarm's stages
            # lock: a Swarm.close() on another thread then either sees the
            # new handle (and closes it first) or runs before the open.
            out = ctypes.c_void_p()
            err = _lib.errbuf()
            rc = _lib.lib.starling_stages_open(ctypes.byref(out), p, m, first, last, err, _lib.ERR_LEN)
            if rc < 0:
                raise error_from_code(rc, err.raw)
            widths = []
            for s in range(first, last + 1):
                a, b = ctypes.c_int64(), ctypes.c_int64()
                _lib.lib.starling_stages_widths(out, s, ctypes.byref(a), ctypes.byref(b))
                widths.append((a.value, b.value))
            guard = _lib.Guard(out.value)
            swarm._stages.add(guard)
            # Rows per C call: the peers' largest request (the library
            # refuses more); a larger batch is cut into calls.
            return guard, widths, _lib.lib.starling_stages_max_rows(out)

        with swarm._stages_lock:
            self._guard, self.widths, self.max_rows = swarm._call(open_stages)
        self._finalizer = weakref.finalize(self, _close_stages, swarm._guard, self._guard)
        self.in_width = self.widths[0][0]
        self.out_width = self.widths[-1][1]
        self.in_shape = tuple(info["stages"][first]["in_shape"])
        self.out_shape = tuple(info["stages"][last]["out_shape"])
        self.last_served = []

    def __getstate__(self):
        raise TypeError("a RemoteStages holds a live handle on its swarm: it cannot be pickled or copied; "
                        "open another one on the swarm")

    def extra_repr(self):
        return "model=%r, stages=%d..%d, in_width=%d, out_width=%d" % (
            self.model, self.first, self.last, self.in_width, self.out_width)

    # -- life cycle
    def close(self):
        """Closes the stages (waits for calls in flight). Idempotent; the
        swarm's close() closes them too."""
        _lib.Closable.close(self)

    @property
    def counters(self):
        """{"calls": stage calls made, "retries": calls sent again to another
        replica} since the stages were opened."""
        calls, retries = ctypes.c_uint64(), ctypes.c_uint64()
        ptr = self._enter()
        try:
            _lib.lib.starling_stages_counters(ptr, ctypes.byref(calls), ctypes.byref(retries))
        finally:
            self._leave()
        return {"calls": calls.value, "retries": retries.value}

    # -- calls
    def _enter(self):
        self.swarm._guard.enter("the swarm")
        try:
            return self._guard.enter("RemoteStages(%s, %d..%d)" % (self.model, self.first, self.last))
        except BaseException:
            self.swarm._guard.leave()
            raise

    def _leave(self):
        self._guard.leave()
        self.swarm._guard.leave()

    def _check_input(self, x):
        if not isinstance(x, torch.Tensor):
            raise TypeError("RemoteStages takes a torch.Tensor, not %s" % type(x).__name__)
        if x.dtype != torch.float32:
            raise TypeError("RemoteStages takes float32 tensors, not %s" % x.dtype)
        if x.device.type != "cpu":
            raise ValueError("RemoteStages takes CPU tensors, not %s: move it with .cpu()" % x.device)
        if x.dim() < 2 or x.shape[0] < 1:
            raise ValueError("input of shape %s: want (batch, ...) with batch >= 1 and the other dims "
                             "flattening to %d" % (tuple(x.shape), self.in_width))
        n = 1
        for d in x.shape[1:]:
            n *= d
        if n != self.in_width:
            raise ValueError("input of shape %s: its rows have %d values; stage %d of %s takes %d (%s)"
                             % (tuple(x.shape), n, self.first, self.model, self.in_width,
                                "x".join(map(str, self.in_shape))))

    def _forward_all(self, x, training):
        """x: (B, in_width) contiguous float32. Returns ([y per stage],
        [[Served per chunk] per stage])."""
        B = x.shape[0]
        ys, served = [], []
        cur = x
        ptr = self._enter()
        try:
            for k in range(self.last - self.first + 1):
                stage = self.first + k
                win, wout = self.widths[k]
                y = torch.empty((B, wout), dtype=torch.float32)
                chunks = []
                for r0 in range(0, B, self.max_rows):
                    rows = min(self.max_rows, B - r0)
                    sv = _lib.Served()
                    err = _lib.errbuf()
                    rc = _lib.lib.starling_stage_forward(ptr, stage, _rows_ptr(cur, r0, win), rows,
                                                         _rows_ptr(y, r0, wout), 1 if training else 0,
                                                         ctypes.byref(sv), err, _lib.ERR_LEN)
                    if rc < 0:
                        raise error_from_code(rc, err.raw)
                    chunks.append(sv)
                ys.append(y)
                served.append(chunks)
                cur = y
        finally:
            self._leave()
        self.last_served = [Served(c[-1].holder_hex(), c[-1].weight_version if c[-1].version_known else None,
                                   c[-1].attempts) for c in served]
        return ys, served

    def _backward(self, stage, x, dy, dx, served):
        k = stage - self.first
        win, wout = self.widths[k]
        B = x.shape[0]
        ptr = self._enter()
        try:
            for i, r0 in enumerate(range(0, B, self.max_rows)):
                rows = min(self.max_rows, B - r0)
                err = _lib.errbuf()
                rc = _lib.lib.starling_stage_backward(ptr, stage, _rows_ptr(x, r0, win), _rows_ptr(dy, r0, wout),
                                                      rows, _rows_ptr(dx, r0, win) if dx is not None else None,
                                                      ctypes.byref(served[i]), err, _lib.ERR_LEN)
                if rc < 0:
                    raise error_from_code(rc, err.raw)
        finally:
            self._leave()

    def forward(self, x):
        self._check_input(x)
        B = x.shape[0]
        x2 = x.reshape(B, self.in_width)
        if not x2.is_contiguous():
            x2 = x2.contiguous()
        if self.training and torch.is_grad_enabled():
            # The dummy input requires grad so that backward reaches the remote
            # stages even when x does not (their parameters have no local
            # Parameter to hang the graph on).
            y = _RemoteFn.apply(self, x2, torch.empty(0, requires_grad=True))
        else:
            with torch.no_grad():
                ys, _ = self._forward_all(x2.detach(), training=False)
            y = ys[-1]
        return y.view((B,) + self.out_shape)
