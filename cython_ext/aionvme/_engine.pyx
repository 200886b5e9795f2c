# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
# cython: initializedcheck=False, embedsignature=True
"""aionvme's engine: kernel AIO, a C worker pool, buffer handling and cuFile.

Mechanism only. The engine splits requests into chunks, submits them in
batches, reaps completions and reports one finished Request per call; it never
imports asyncio. Policy (when to pump, which engine serves a loop, how errors
reach the caller) lives in the Python package.
"""
cimport cython
from cpython.buffer cimport (PyBUF_ANY_CONTIGUOUS, PyBUF_FORMAT, PyBUF_FULL_RO, PyBUF_WRITABLE,
                             PyBuffer_Release, PyObject_CheckBuffer, PyObject_GetBuffer)
from cpython.exc cimport PyErr_CheckSignals, PyErr_Fetch, PyErr_Restore, PyErr_SetObject
from cpython.object cimport PyObject
from cpython.contextvars cimport PyContext_CopyCurrent, PyContext_Enter, PyContext_Exit
from cpython.ref cimport Py_DECREF, Py_INCREF, Py_XDECREF
from libc.errno cimport EAGAIN, EBADF, EBUSY, EINTR, EINVAL, EIO, ENOMEM, EOPNOTSUPP, ESPIPE, errno
from libc.stdint cimport int32_t, int64_t, uint64_t, uintptr_t
from libc.stdlib cimport calloc, free
from libc.string cimport memcpy, memmove, memset

from aionvme.includes.cufile cimport *
from aionvme.includes.dlfcn cimport *
from aionvme.includes.linux cimport *
from aionvme.includes.pthread cimport *
from aionvme.includes.pyglue cimport *
from aionvme.includes.uring cimport *

import os
import sys
from operator import index as _index

import aionvme.exceptions as _exc

# The parts, in dependency order: counters (leak counters, the debug build),
# errors (errno -> OSError subclass), buffers (caller buffers, AlignedBuffer),
# workers (the C worker pool and its jobs), kernel_aio (io_submit, inline or on
# the submitter thread, and the engine's AIO context: setup, submit, reap),
# uring (the same for io_uring), planning (cutting a segment into aligned
# transfers), requests (Inode, FileHandle, Request), bounce (a chunk slot's
# bounce buffer), adaptive (the window of blocking calls' engines), chunks (a
# chunk cut from its request, its result folded back), engine (Engine: the
# story of a request, and its Python API), refill (the refill thread); then
# the asyncio glue, a part of its own under glue/ (it never imports asyncio
# either: the reactor binds the few names it needs): transfer (Transfer, what
# an async call returns), delivery (resolving Transfers, waking their tasks),
# hub (a reactor's submitting half, and the Route of an open File); gds
# (cuFile by dlopen), probes (statx/statfs/io_setup for the Python layer), fork
# (locks a forked child re-initialises).
include "counters.pxi"
include "errors.pxi"
include "buffers.pxi"
include "workers.pxi"
include "kernel_aio.pxi"
include "uring.pxi"
include "planning.pxi"
include "requests.pxi"
include "bounce.pxi"
include "adaptive.pxi"
include "chunks.pxi"
include "engine.pxi"
include "refill.pxi"
include "glue/transfer.pxi"
include "glue/delivery.pxi"
include "glue/hub.pxi"
include "gds.pxi"
include "probes.pxi"
include "fork.pxi"
