# Errors leave the engine through aionvme.exceptions, the one place that turns
# an errno into the matching OSError subclass.

cdef object _os_error(int err, object path, object offset=None, object nbytes=None, object op=None):
    return _exc.os_error(err, path, offset=offset, nbytes=nbytes, op=op)


cdef int _raise_errno(int err, object path=None) except -1:
    raise _os_error(err, path)
