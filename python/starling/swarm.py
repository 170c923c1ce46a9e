"""starling.Swarm: a light client of a Starling swarm."""
import ctypes
import dataclasses
import json
import os
import threading
import weakref

from . import _lib
from .errors import error_from_code

__all__ = ["Swarm", "ModelInfo", "Holder", "Record", "model_info", "init_params"]


@dataclasses.dataclass(frozen=True)
class ModelInfo:
    """A model that the swarm's peers announce (their models index)."""
    name: str
    stages: int
    description: "str | None"  # 40 hex digits: the hash of its published description
    announcers: int


@dataclasses.dataclass(frozen=True)
class Holder:
    """One holder of a stage, as `starling monitor` shows it."""
    id: str
    addr: str
    state: str            # "online", "joining" or "offline"
    usable: bool          # online and announcing this build's stage hash
    throughput: float     # samples/s
    load: float           # 0..1
    weight_version: int
    device: str
    age_s: float          # seconds since its announcement
    avg_rounds: int
    grads_refused: int
    frozen: bool


@dataclasses.dataclass(frozen=True)
class Record:
    """One entry of a raw DHT record."""
    subkey: bytes
    value: bytes
    signed: bool
    expires_in_s: float


def _enc(s, what):
    if not isinstance(s, str):
        raise TypeError("%s must be a str, not %s" % (what, type(s).__name__))
    if "\0" in s:
        raise ValueError("%s contains a NUL character" % what)
    return s.encode("utf-8")


def _check(rc, err):
    if rc < 0:
        raise error_from_code(rc, err.raw)
    return rc


def _json_call(fn, *args):
    """Calls fn(*args, &json, err, len); returns the decoded JSON."""
    out = ctypes.c_void_p()
    err = _lib.errbuf()
    rc = fn(*args, ctypes.byref(out), err, _lib.ERR_LEN)
    if rc < 0:
        _lib.lib.starling_free(out)
        raise error_from_code(rc, err.raw)
    return json.loads(_lib.take_string(out) or "null")


def _model_info(ptr, model):
    return _json_call(_lib.lib.starling_model_info, ptr, _enc(model, "model"))


def _stage_tensors(info, stage):
    """(params, [(key, offset, shape), ...]) of stage `stage` in a model_info dict."""
    stages = info["stages"]
    if not isinstance(stage, int) or isinstance(stage, bool):
        raise TypeError("stage must be an int, not %s" % type(stage).__name__)
    if not 0 <= stage < len(stages):
        raise ValueError("stage %d is out of range: model %s has stages 0..%d"
                         % (stage, info["name"], len(stages) - 1))
    st = stages[stage]
    names = [t["name"] for t in st["tensors"]]
    seen = {}
    out = []
    for t in st["tensors"]:
        name = t["name"]
        if names.count(name) > 1:
            i = seen.get(name, 0)
            seen[name] = i + 1
            key = "%d.%s" % (i, name)
        else:
            key = name
        shape = [int(d) for d in t["shape"]]
        if len(shape) == 2 and shape[1] == 1:
            shape = shape[:1]  # vectors ([n, 1] in the list): 1-D, as torch has them
        out.append((key, int(t["offset"]), shape))
    return int(st["params"]), out


def _init_params(ptr, model, stage, info):
    import torch
    n, tensors = _stage_tensors(info, stage)
    flat = torch.empty(n, dtype=torch.float32)
    err = _lib.errbuf()
    _check(_lib.lib.starling_stage_init_params(ptr, _enc(model, "model"), stage, flat.data_ptr(), n,
                                               err, _lib.ERR_LEN), err)
    out = {}
    for key, off, shape in tensors:
        size = 1
        for d in shape:
            size *= d
        out[key] = flat[off:off + size].view(*shape)
    return out


def model_info(name):
    """A built-in or registered model's facts (no swarm): see Swarm.model_info."""
    return _model_info(None, name)


def init_params(model, stage):
    """A built-in or registered model's stage's initial parameters (no
    swarm): see Swarm.init_params."""
    return _init_params(None, model, stage, model_info(model))


def _close_swarm(guard, stages_guards, stages_lock):
    # The stages first (the C close would free them under our handles);
    # under the lock that opening a RemoteStages takes, so none is missed.
    with stages_lock:
        for g in list(stages_guards):
            g.close(_lib.lib.starling_stages_close)
        guard.close(_lib.lib.starling_swarm_close)


class Swarm(_lib.Closable):
    """A light DHT client joined to a swarm through initial_peers.

    initial_peers: "HOST:PORT[/NODEID]" as `starling bootstrap` and
    `starling peer` print it, several joined by commas, or a list of them.
    swarm_key: the swarm key file of a private swarm; identity: an
    ed25519 identity file (default: a fresh identity); listen: our DHT
    address "HOST:PORT" (default: any port). join_timeout bounds the join,
    call_timeout one stage call (and a connection's set-up), max_wait the
    wait for a stage without a reachable holder; seed fixes the replica
    choice (0: from the clock).

    Raises UnreachableError when no initial peer answers within
    join_timeout, SwarmKeyError under the wrong swarm key, ValueError for a
    malformed list. Every method may be called from several threads at
    once; close() waits for calls in flight.
    """

    def __init__(self, initial_peers, swarm_key=None, identity=None, *, listen=None, join_timeout=15.0,
                 call_timeout=30.0, max_wait=120.0, seed=0):
        if isinstance(initial_peers, (list, tuple)):
            if not initial_peers or not all(isinstance(p, str) for p in initial_peers):
                raise ValueError("initial_peers must be a non-empty list of 'HOST:PORT[/NODEID]' strings")
            initial_peers = ",".join(initial_peers)
        peers = _enc(initial_peers, "initial_peers")
        if not peers:
            raise ValueError("initial_peers is empty")
        for name, v in (("join_timeout", join_timeout), ("call_timeout", call_timeout), ("max_wait", max_wait)):
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not v > 0:
                raise ValueError("%s must be a positive number of seconds, not %r" % (name, v))
        if not isinstance(seed, int) or not 0 <= seed < 2 ** 64:
            raise ValueError("seed must be an int in 0..2**64-1")
        opt = _lib.SwarmOptions()
        opt.swarm_key_file = _enc(os.fspath(swarm_key), "swarm_key") if swarm_key is not None else None
        opt.identity_file = _enc(os.fspath(identity), "identity") if identity is not None else None
        opt.listen = _enc(listen, "listen") if listen is not None else None
        opt.join_timeout_s = float(join_timeout)
        opt.call_timeout_s = float(call_timeout)
        opt.max_wait_s = float(max_wait)
        opt.seed = seed
        ptr = ctypes.c_void_p()
        err = _lib.errbuf()
        rc = _lib.lib.starling_swarm_open(ctypes.byref(ptr), peers, ctypes.byref(opt), err, _lib.ERR_LEN)
        _check(rc, err)
        self._guard = _lib.Guard(ptr.value)
        self._stages = weakref.WeakSet()  # the Guards of RemoteStages opened on us
        self._stages_lock = threading.Lock()
        self._finalizer = weakref.finalize(self, _close_swarm, self._guard, self._stages, self._stages_lock)
        hexbuf = ctypes.create_string_buffer(41)
        _lib.lib.starling_swarm_node_id(ptr, hexbuf)
        self._node_id = hexbuf.value.decode()
        self.initial_peers = initial_peers

    # -- life cycle
    def close(self):
        """Closes every RemoteStages opened on this swarm, leaves the DHT and
        stops the swarm's thread. Waits for calls in flight. Idempotent."""
        _lib.Closable.close(self)

    def __repr__(self):
        return "<starling.Swarm %s%s>" % (self._node_id[:8], " closed" if self.closed else "")

    # -- internals
    def _call(self, fn):
        ptr = self._guard.enter("the swarm")
        try:
            return fn(ptr)
        finally:
            self._guard.leave()

    # -- queries
    @property
    def node_id(self):
        """Our node ID, 40 hex digits."""
        return self._node_id

    def models(self):
        """The models the swarm's peers announce, sorted by name."""
        rows = self._call(lambda p: _json_call(_lib.lib.starling_swarm_models, p))
        return [ModelInfo(name=r["model"], stages=int(r["stages"]), description=r.get("description"),
                          announcers=int(r["announcers"])) for r in rows]

    def holders(self, model, stage):
        """The holders of stage `stage` of `model` (UnknownModelError for a
        model nobody knows, InvalidArgumentError, a ValueError, for a stage
        out of range)."""
        if not isinstance(stage, int) or isinstance(stage, bool):
            raise TypeError("stage must be an int, not %s" % type(stage).__name__)
        m = _enc(model, "model")
        rows = self._call(lambda p: _json_call(_lib.lib.starling_swarm_holders, p, m, stage))
        fields = [f.name for f in dataclasses.fields(Holder)]
        return [Holder(**{k: r.get(k) for k in fields}) for r in rows]

    def get(self, key):
        """The raw DHT record under key (a string hashed as the peers do, or
        "0x" + 40 hex digits): a list of Record."""
        k = _enc(key, "key")
        rows = self._call(lambda p: _json_call(_lib.lib.starling_swarm_get, p, k))
        return [Record(subkey=bytes.fromhex(r["subkey"]), value=bytes.fromhex(r["value"]),
                       signed=bool(r["signed"]), expires_in_s=float(r["expires_in_s"])) for r in rows]

    def put(self, key, value, ttl=60.0):
        """Stores value (bytes, at most 768: a DHT value) under key for ttl seconds
        (1..86400), signed with our identity; returns the number of nodes
        that stored it."""
        k = _enc(key, "key")
        if not isinstance(value, (bytes, bytearray, memoryview)):
            raise TypeError("value must be bytes, not %s" % type(value).__name__)
        value = bytes(value)
        if len(value) > 768:
            raise ValueError("value is %d bytes; at most 768" % len(value))
        if not isinstance(ttl, (int, float)) or not 1 <= ttl <= 86400:
            raise ValueError("ttl must be 1..86400 seconds, not %r" % (ttl,))
        err = _lib.errbuf()
        buf = ctypes.create_string_buffer(value, len(value))
        rc = self._call(lambda p: _lib.lib.starling_swarm_put(p, k, buf, len(value), float(ttl), err,
                                                              _lib.ERR_LEN))
        return _check(rc, err)

    def model_info(self, name):
        """A model's facts as a dict: name, description, task, stages (each:
        index, kind, in_shape, out_shape, params, tensors). A model the
        swarm publishes is fetched."""
        return self._call(lambda p: _model_info(p, name))

    def init_params(self, model, stage):
        """Stage `stage`'s initial parameters (what a peer starts from with no
        state to download) as {name: torch.Tensor}, shaped as model_info's
        tensors list says. When a name repeats in the stage (a decoder stage
        of several layers), each occurrence is keyed "<i>.<name>", i counting
        that name's occurrences from 0 (layer i); names that occur once keep
        their plain name. Matrices are (rows, cols) as torch's Linear.weight
        (out, in); vectors (biases, LayerNorm's weight and bias: [n, 1] in
        model_info) are 1-D. The tensors are views of one flat float32
        tensor in the stage's parameter order."""
        return self._call(lambda p: _init_params(p, model, stage, _model_info(p, model)))

    def stages(self, model, stages):
        """RemoteStages(self, model, stages)."""
        from .remote import RemoteStages
        return RemoteStages(self, model, stages)
