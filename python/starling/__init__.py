"""Starling for PyTorch users: a swarm's remote stages as torch modules.

    import starling, torch
    with starling.Swarm("127.0.0.1:4000/<node id>") as swarm:
        body = starling.RemoteStages(swarm, "fmnist-mlp", range(1, 5))
        y = body(torch.randn(8, 512))      # through the peers holding stages 1..4
        y.sum().backward()                 # their gradients go back to those peers

The package calls libstarling.so (the C core) through ctypes; see
docs/python.md. RemoteStages needs torch; the rest does not.
"""
from . import _lib
from .errors import (ClosedError, InvalidArgumentError, RefusedError, StarlingError, StarlingTimeoutError,
                     SwarmKeyError, UnknownModelError, UnreachableError)
from .swarm import Holder, ModelInfo, Record, Swarm, init_params, model_info

__version__ = _lib.lib.starling_version().decode()
API_VERSION = _lib.API_VERSION

__all__ = [
    "Swarm", "RemoteStages", "Served", "ModelInfo", "Holder", "Record", "model_info", "init_params",
    "StarlingError", "UnknownModelError", "UnreachableError", "SwarmKeyError", "StarlingTimeoutError",
    "ClosedError", "RefusedError", "InvalidArgumentError", "library_path", "version", "api_version",
]


def library_path():
    """The path of the libstarling.so this package loaded."""
    return _lib.path


def version():
    """The C library's version ("0.1.0")."""
    return __version__


def api_version():
    """The C library's API version (starling_api_version())."""
    return _lib.lib.starling_api_version()


def __getattr__(name):
    # RemoteStages imports torch: only when asked for.
    if name in ("RemoteStages", "Served"):
        from . import remote
        return getattr(remote, name)
    raise AttributeError("module 'starling' has no attribute %r" % name)
