/* C helpers of the asyncio glue (cython_ext/aionvme/glue/): type slots Cython
   does not fill, the running loop from this thread's async-generator hook, a
   Task's wakeup recognised, interpreter shutdown. Included after Python.h. */
#ifndef AIONVME_PYGLUE_H
#define AIONVME_PYGLUE_H

#include <string.h>

static void aionvme_set_iternext(PyObject *t, iternextfunc f) {
    ((PyTypeObject *)t)->tp_iternext = f;
    PyType_Modified((PyTypeObject *)t);
}

/* The owner of this thread's async-generator firstiter hook: asyncio's and
   uvloop's loops install bound methods of themselves while they run. */
static PyObject *aionvme_hook_owner(void) {
    PyObject *h = PyThreadState_Get()->async_gen_firstiter;
    if (h != NULL && PyMethod_Check(h)) return PyMethod_GET_SELF(h);
    return NULL;
}

/* Is fn the wakeup of a C asyncio Task (what Task passes to
   add_done_callback of what it awaits)? On 3.11 an object of type
   TaskWakeupMethWrapper, on 3.12+ a builtin function named task_wakeup
   bound to the task. Either way it only asks the future for its result()
   and steps the task. */
static PyTypeObject *aionvme_wakeup_type = NULL;
static PyMethodDef *aionvme_wakeup_def = NULL;
static int aionvme_is_task_wakeup(PyObject *fn) {
    PyTypeObject *tp = Py_TYPE(fn);
    if (tp == aionvme_wakeup_type) return 1;
    if (PyCFunction_Check(fn)) {
        PyMethodDef *ml = ((PyCFunctionObject *)fn)->m_ml;
        if (ml == aionvme_wakeup_def) return 1;
        if (aionvme_wakeup_def == NULL && ml != NULL && ml->ml_name != NULL
                && strcmp(ml->ml_name, "task_wakeup") == 0) {
            PyObject *self = PyCFunction_GET_SELF(fn);
            if (self != NULL && strcmp(Py_TYPE(self)->tp_name, "_asyncio.Task") == 0) {
                aionvme_wakeup_def = ml;
                return 1;
            }
        }
        return 0;
    }
    if (aionvme_wakeup_type == NULL && strcmp(tp->tp_name, "TaskWakeupMethWrapper") == 0) {
        aionvme_wakeup_type = tp;
        return 1;
    }
    return 0;
}

typedef int (*aionvme_sendfunc)(PyObject *, PyObject *, PyObject **);
/* Give a type with an am_await slot (Cython made its PyAsyncMethods) an
   am_send: what an awaiting coroutine calls instead of tp_iternext, and
   which returns the result without raising StopIteration. */
static int aionvme_set_am_send(PyObject *t, aionvme_sendfunc f) {
    PyTypeObject *tp = (PyTypeObject *)t;
    if (tp->tp_as_async == NULL) return 0;
    tp->tp_as_async->am_send = (sendfunc)f;
#ifdef Py_TPFLAGS_HAVE_AM_SEND
    tp->tp_flags |= Py_TPFLAGS_HAVE_AM_SEND;
#endif
    PyType_Modified(tp);
    return 1;
}

static int aionvme_finalizing(void) {
#if PY_VERSION_HEX >= 0x030D0000
    return Py_IsFinalizing();
#else
    return _Py_IsFinalizing();
#endif
}

#endif
