"""Exceptions raised by the starling package.

Every failure of a C call becomes a StarlingError (or one of its
subclasses, chosen by the errno the call returned) carrying the errno and
the library's own sentence. Bad arguments that Python can see before the
call (a tensor's dtype, device or shape, a stage outside the model) are
ValueError or TypeError and never reach the library.
"""
import errno as _errno
import os as _os

__all__ = [
    "StarlingError",
    "UnknownModelError",
    "UnreachableError",
    "SwarmKeyError",
    "StarlingTimeoutError",
    "ClosedError",
    "RefusedError",
    "InvalidArgumentError",
    "error_from_code",
]


class StarlingError(Exception):
    """A call into libstarling failed.

    .errno is the positive errno the library returned (e.g. errno.ENOENT)
    and .message its sentence (str(err) is the message followed by the
    errno's name).
    """

    def __init__(self, errno, message):
        errno = int(errno)
        message = message or _os.strerror(errno)
        name = _errno.errorcode.get(errno, str(errno))
        super().__init__("%s [%s]" % (message, name))
        # After the base's __init__: OSError's (StarlingTimeoutError is a
        # TimeoutError) would reset errno.
        self.errno = errno
        self.message = message

    def __reduce__(self):  # pickles (e.g. across multiprocessing) as (errno, message)
        return (self.__class__, (self.errno, self.message))


class UnknownModelError(StarlingError):
    """ENOENT: the model is neither built in, nor registered, nor published
    in the swarm."""


class UnreachableError(StarlingError):
    """EHOSTUNREACH / EADDRNOTAVAIL: no initial peer answered, or one
    answered with another node ID than the address string names."""


class SwarmKeyError(StarlingError):
    """EKEYREJECTED: the swarm runs under another swarm key (or none)."""


class StarlingTimeoutError(StarlingError, TimeoutError):
    """ETIMEDOUT: a stage had no reachable holder within max_wait, or a
    query got no answer in time."""

    def __init__(self, errno, message):
        StarlingError.__init__(self, errno, message)


class ClosedError(StarlingError):
    """ECANCELED: the swarm (or the stages) was closed while the call
    waited, or is closed already."""


class RefusedError(StarlingError):
    """ERANGE: a holder refused the gradient (its gradient checks failed)
    three times."""


class InvalidArgumentError(StarlingError, ValueError):
    """EINVAL: the library refused an argument Python could not check
    (a malformed address list, a stage out of range, ...). Also a
    ValueError."""

    def __init__(self, errno, message):
        StarlingError.__init__(self, errno, message)


_BY_ERRNO = {
    _errno.EINVAL: InvalidArgumentError,
    _errno.ENOENT: UnknownModelError,
    _errno.EHOSTUNREACH: UnreachableError,
    _errno.EADDRNOTAVAIL: UnreachableError,
    _errno.ETIMEDOUT: StarlingTimeoutError,
    _errno.ECANCELED: ClosedError,
    _errno.ERANGE: RefusedError,
}
if hasattr(_errno, "EKEYREJECTED"):
    _BY_ERRNO[_errno.EKEYREJECTED] = SwarmKeyError


def error_from_code(rc, message):
    """The exception for a C function's negative return rc and its err
    buffer's sentence (bytes or str)."""
    if isinstance(message, (bytes, bytearray)):
        message = bytes(message).split(b"\0", 1)[0].decode("utf-8", "replace")
    code = -int(rc) if rc < 0 else int(rc)
    return _BY_ERRNO.get(code, StarlingError)(code, message)
