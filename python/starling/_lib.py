"""Loading libstarling.so through ctypes, and the C declarations.

Where the library is looked for, in order:

1. the file named by the environment variable STARLING_LIBRARY (when it
   is set, nothing else is tried: a wrong path is an ImportError);
2. the copy installed inside this package (setup.py puts the library it
   was built with there);
3. when the package is imported from a checkout (python/starling), the
   checkout's build directories: $STARLING_BUILD_DIR/capi, build/capi,
   build-release/capi.

The functions are declared with their argument and return types, so a
wrong type is a ctypes error in Python, not a crash in C. ctypes releases
the GIL around every call of a CDLL function, so calls that block (a stage
forward waiting for its holder) let other Python threads run.
"""
import ctypes
import os
import threading

API_VERSION = 1
ID_LEN = 20
ERR_LEN = 1024
_HERE = os.path.dirname(os.path.abspath(__file__))
_LIBNAME = "libstarling.so"

_BUILD_HINT = ("build Starling first (meson setup build && ninja -C build), install the package "
               "(python3 -m pip install --no-build-isolation --no-index ./python), or point "
               "STARLING_LIBRARY at a libstarling.so")


class SwarmOptions(ctypes.Structure):
    """struct starling_swarm_options."""
    _fields_ = [
        ("swarm_key_file", ctypes.c_char_p),
        ("identity_file", ctypes.c_char_p),
        ("listen", ctypes.c_char_p),
        ("join_timeout_s", ctypes.c_double),
        ("call_timeout_s", ctypes.c_double),
        ("max_wait_s", ctypes.c_double),
        ("seed", ctypes.c_uint64),
    ]


class Served(ctypes.Structure):
    """struct starling_served: who served a forward."""
    _fields_ = [
        ("holder", ctypes.c_uint8 * ID_LEN),
        ("weight_version", ctypes.c_uint64),
        ("version_known", ctypes.c_int32),
        ("attempts", ctypes.c_int32),
    ]

    def holder_hex(self):
        return bytes(self.holder).hex()


def _candidates():
    """(path, why) pairs, in the order they are tried (after STARLING_LIBRARY)."""
    out = [(os.path.join(_HERE, _LIBNAME), "the package's own copy")]
    root = os.path.dirname(os.path.dirname(_HERE))  # python/starling -> the checkout
    if os.path.isfile(os.path.join(root, "meson.build")) and os.path.isdir(os.path.join(root, "capi")):
        dirs = []
        bd = os.environ.get("STARLING_BUILD_DIR")
        if bd:
            dirs.append(bd if os.path.isabs(bd) else os.path.join(root, bd))
        dirs += [os.path.join(root, "build"), os.path.join(root, "build-release")]
        for d in dirs:
            out.append((os.path.join(d, "capi", _LIBNAME), "the checkout's build directory %s" % d))
    return out


def _declare(lib):
    c_int, c_char_p, c_size_t, c_double = ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_double
    c_void_p, c_int64, c_uint64 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_uint64
    P = ctypes.POINTER
    # Handles are opaque: kept as c_void_p.
    decl = {
        "starling_version": (c_char_p, []),
        "starling_api_version": (c_int, []),
        "starling_free": (None, [c_void_p]),
        "starling_swarm_open": (c_int, [P(c_void_p), c_char_p, P(SwarmOptions), c_char_p, c_size_t]),
        "starling_swarm_close": (None, [c_void_p]),
        "starling_swarm_node_id": (None, [c_void_p, c_char_p]),
        "starling_swarm_models": (c_int, [c_void_p, P(c_void_p), c_char_p, c_size_t]),
        "starling_swarm_holders": (c_int, [c_void_p, c_char_p, c_int, P(c_void_p), c_char_p, c_size_t]),
        "starling_swarm_get": (c_int, [c_void_p, c_char_p, P(c_void_p), c_char_p, c_size_t]),
        "starling_swarm_put": (c_int, [c_void_p, c_char_p, c_void_p, c_size_t, c_double, c_char_p, c_size_t]),
        "starling_model_info": (c_int, [c_void_p, c_char_p, P(c_void_p), c_char_p, c_size_t]),
        "starling_stage_init_params": (c_int, [c_void_p, c_char_p, c_int, c_void_p, c_size_t, c_char_p,
                                               c_size_t]),
        "starling_stages_open": (c_int, [P(c_void_p), c_void_p, c_char_p, c_int, c_int, c_char_p, c_size_t]),
        "starling_stages_close": (None, [c_void_p]),
        "starling_stages_widths": (c_int, [c_void_p, c_int, P(c_int64), P(c_int64)]),
        "starling_stage_forward": (c_int, [c_void_p, c_int, c_void_p, c_int64, c_void_p, c_int, P(Served),
                                           c_char_p, c_size_t]),
        "starling_stage_backward": (c_int, [c_void_p, c_int, c_void_p, c_void_p, c_int64, c_void_p, P(Served),
                                            c_char_p, c_size_t]),
        "starling_stages_counters": (None, [c_void_p, P(c_uint64), P(c_uint64)]),
        "starling_stages_max_rows": (c_int, [c_void_p]),
    }
    missing = []
    for name, (res, args) in decl.items():
        try:
            f = getattr(lib, name)
        except AttributeError:
            missing.append(name)
            continue
        f.restype = res
        f.argtypes = args
    return missing


def _try_load(path):
    lib = ctypes.CDLL(path)
    missing = _declare(lib)
    if missing:
        raise OSError("%s lacks %s: not a libstarling of this API" % (path, ", ".join(missing)))
    v = lib.starling_api_version()
    if v != API_VERSION:
        raise OSError("%s has API version %d; this package speaks version %d" % (path, v, API_VERSION))
    return lib


def _load():
    env = os.environ.get("STARLING_LIBRARY")
    if env:
        try:
            return _try_load(env), os.path.abspath(env)
        except OSError as e:
            raise ImportError("starling: cannot load the library named by STARLING_LIBRARY (%s): %s. "
                              "Unset it or %s" % (env, e, _BUILD_HINT)) from None
    tried = []
    for path, why in _candidates():
        if not os.path.exists(path):
            tried.append("%s (%s: not there)" % (path, why))
            continue
        try:
            return _try_load(path), path
        except OSError as e:
            tried.append("%s (%s: %s)" % (path, why, e))
    raise ImportError("starling: libstarling.so not found; tried: %s. To fix: %s"
                      % ("; ".join(tried), _BUILD_HINT))


lib, path = _load()


def errbuf():
    """A fresh error buffer (one per call: calls may run on several threads)."""
    return ctypes.create_string_buffer(ERR_LEN)


def take_string(ptr):
    """The library's malloc'd string at ptr (a c_void_p) as str; frees it."""
    if not ptr.value:
        return ""
    try:
        return ctypes.string_at(ptr.value).decode("utf-8", errors="replace")
    finally:
        lib.starling_free(ptr)


class Guard:
    """Keeps a C handle from being closed while calls on it run.

    Calls enter() and leave() around their C call; close() marks the
    handle closed (new calls raise ClosedError), waits for the calls in
    flight to return (each is bounded by the swarm's timeouts), then runs
    the close function once.
    """

    def __init__(self, ptr):
        self.ptr = ptr
        self.closed = False
        self._busy = 0
        self._cond = threading.Condition()

    def enter(self, what):
        from .errors import ClosedError
        import errno
        with self._cond:
            if self.closed or not self.ptr:
                raise ClosedError(errno.ECANCELED, "%s is closed" % what)
            self._busy += 1
            return self.ptr

    def leave(self):
        with self._cond:
            self._busy -= 1
            if self._busy == 0:
                self._cond.notify_all()

    def close(self, fn):
        with self._cond:
            if self.closed:
                return False
            self.closed = True
            while self._busy:
                self._cond.wait()
            ptr, self.ptr = self.ptr, None
        if ptr:
            fn(ptr)
        return True


class Closable:
    """What Swarm and RemoteStages share: close() runs the object's
    finalizer (self._finalizer, a weakref.finalize), so it is idempotent
    and also runs when the object is collected; `closed`; a context
    manager."""

    def close(self):
        self._finalizer()

    @property
    def closed(self):
        return self._guard.closed

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
