# The asyncio glue's C helpers (pyglue.h) and the CPython calls it declares
# itself (Cython's cpython/ has no declaration of them).
from cpython.object cimport PyObject


cdef extern from "pyglue.h":
    ctypedef PyObject *(*iternextfunc)(PyObject *)
    ctypedef int (*aionvme_sendfunc)(PyObject *, PyObject *, PyObject **)

    void aionvme_set_iternext(object t, iternextfunc f)
    int aionvme_set_am_send(object t, aionvme_sendfunc f)
    PyObject *aionvme_hook_owner()
    bint aionvme_is_task_wakeup(object fn)
    bint aionvme_finalizing()
    PyObject *PyObject_CallMethodOneArg(object obj, object name, object arg)   # NULL: raised
    void PyErr_WriteUnraisable(object obj)
