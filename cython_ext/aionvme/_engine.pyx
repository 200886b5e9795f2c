# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
# cython: initializedcheck=False, embedsignature=True
"""aionvme's engine: kernel AIO, a C worker pool, buffer handling and cuFile.

Mechanism only. The engine splits requests into chunks, submits them in
batches, reaps completions and reports one finished Request per call; it never
imports asyncio. Policy (when to pump, which engine serves a loop, how errors
reach the caller) lives in the Python package.
"""
from cpython.buffer cimport (PyBUF_ANY_CONTIGUOUS, PyBUF_FORMAT, PyBUF_FULL_RO, PyBUF_WRITABLE,
                             PyBuffer_Release, PyObject_CheckBuffer, PyObject_GetBuffer)
from cpython.object cimport PyObject
from cpython.ref cimport Py_DECREF, Py_INCREF
from libc.errno cimport EAGAIN, EBADF, EINTR, EINVAL, EIO, ENOMEM, EOPNOTSUPP, errno
from libc.stdint cimport int32_t, int64_t, uint64_t, uintptr_t
from libc.stdlib cimport calloc, free
from libc.string cimport memcpy, memmove, memset

from aionvme.includes.cufile cimport *
from aionvme.includes.dlfcn cimport *
from aionvme.includes.linux cimport *
from aionvme.includes.pthread cimport *

import os
import sys
from operator import index as _index

from aionvme import exceptions as _exc

include "_errors.pxi"
include "_buffers.pxi"
include "_threads.pxi"
include "_plan.pxi"
include "_requests.pxi"
include "_aio.pxi"
include "_gds.pxi"
include "_info.pxi"
