# Buffers: what the caller passes (buffer-protocol objects, torch tensors) and
# what we allocate (page-aligned memory that O_DIRECT can DMA into directly).

cdef long _PAGE = sysconf(_SC_PAGESIZE)
cdef object _torch_tensor_type = None


cdef bint _is_torch_tensor(object obj):
    # torch is never imported here: a tensor can only exist if the caller did.
    global _torch_tensor_type
    if _torch_tensor_type is None:
        torch = sys.modules.get("torch")
        if torch is None:
            return False
        _torch_tensor_type = torch.Tensor
    return isinstance(obj, _torch_tensor_type)


cdef int _diagnose_buffer(object buf, bint writable) except -1:
    """Raise the precise error for a buffer that PyObject_GetBuffer refused."""
    cdef Py_buffer probe
    if not PyObject_CheckBuffer(buf):
        raise _exc.BufferTypeError(
            f"expected a numpy array, torch tensor or bytes-like object, got {type(buf).__name__}")
    try:
        PyObject_GetBuffer(buf, &probe, PyBUF_FULL_RO)
    except Exception:
        return 0   # the exporter's own error stands
    try:
        if writable and probe.readonly:
            raise _exc.ReadOnlyBufferError(
                f"cannot read into a read-only {type(buf).__name__}")
        raise _exc.NonContiguousBufferError(
            f"{type(buf).__name__} is not contiguous; pass a contiguous copy")
    finally:
        PyBuffer_Release(&probe)


cdef int _buffer_address(object buf, bint writable, Py_buffer *view,
                         char **addr, int64_t *nbytes) except -1:
    """Resolve buf to (address, size). Fills view (to release later) and
    returns 0, or returns 1: the caller must keep buf referenced instead.
    Either way the memory stays alive and pinned in place until the request
    is finished."""
    if PyObject_CheckBuffer(buf):
        try:
            PyObject_GetBuffer(buf, view, PyBUF_ANY_CONTIGUOUS | (PyBUF_WRITABLE if writable else 0))
        except (BufferError, ValueError, TypeError):
            _diagnose_buffer(buf, writable)
            raise
        addr[0] = <char *>view.buf
        nbytes[0] = view.len
        return 0
    if _is_torch_tensor(buf):
        if buf.device.type != "cpu":
            raise _exc.DeviceError(
                f"tensor is on {buf.device}; this call moves host memory (use the GPU path for CUDA tensors)")
        if not buf.is_contiguous():
            raise _exc.NonContiguousBufferError("tensor is not contiguous; pass tensor.contiguous()")
        addr[0] = <char *><uintptr_t>buf.data_ptr()
        nbytes[0] = buf.numel() * buf.element_size()
        return 1
    _diagnose_buffer(buf, writable)
    return -1


def buffer_info(object buf, bint writable=False):
    """(address, nbytes) of a buffer as the engine sees it (for tests and tools)."""
    cdef Py_buffer view
    cdef char *addr
    cdef int64_t n
    memset(&view, 0, sizeof(Py_buffer))
    _buffer_address(buf, writable, &view, &addr, &n)
    if <PyObject *>view.obj != NULL:
        PyBuffer_Release(&view)
    return <uintptr_t>addr, n


# Mappings given back by AlignedBuffer(recycle=True) when their last user went,
# kept for the next recycled buffer of the same mapped size: a result that is
# read whole into such memory pays no page faults and no zeroing of fresh pages
# (for a 64 MiB result here: ~23 ms of CPU per fresh mapping against ~1 ms).
# Touched only with the GIL held (construction and deallocation).
cdef enum:
    _RECYCLE_SLOTS = 64
cdef void *_recycled_ptr[_RECYCLE_SLOTS]
cdef Py_ssize_t _recycled_size[_RECYCLE_SLOTS]
cdef int _recycled_n = 0
cdef Py_ssize_t _recycled_bytes = 0
cdef Py_ssize_t _recycle_limit = 256 * 1024 * 1024


cdef void *_recycled_take(Py_ssize_t mapped):
    global _recycled_n, _recycled_bytes
    cdef int i
    cdef void *p
    for i in range(_recycled_n - 1, -1, -1):   # the latest first: the warmest in cache
        if _recycled_size[i] == mapped:
            p = _recycled_ptr[i]
            _recycled_n -= 1
            _recycled_ptr[i] = _recycled_ptr[_recycled_n]
            _recycled_size[i] = _recycled_size[_recycled_n]
            _recycled_bytes -= mapped
            return p
    return NULL


cdef bint _recycled_give(void *p, Py_ssize_t mapped):
    global _recycled_n, _recycled_bytes
    if _recycled_n >= _RECYCLE_SLOTS or _recycled_bytes + mapped > _recycle_limit:
        return False
    _recycled_ptr[_recycled_n] = p
    _recycled_size[_recycled_n] = mapped
    _recycled_n += 1
    _recycled_bytes += mapped
    return True


def recycle_limit(object nbytes=None):
    """The bytes of freed recycled buffers kept for reuse (default 256 MiB);
    with ``nbytes``, set it first (0 keeps none), unmapping what is over it.
    Returns the limit and the bytes kept now."""
    global _recycle_limit, _recycled_n, _recycled_bytes
    if nbytes is not None:
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        _recycle_limit = nbytes
        while _recycled_n and _recycled_bytes > _recycle_limit:
            _recycled_n -= 1
            munmap(_recycled_ptr[_recycled_n], _recycled_size[_recycled_n])
            _recycled_bytes -= _recycled_size[_recycled_n]
    return _recycle_limit, _recycled_bytes


# Mappings of this size or more start on a 2 MiB boundary (mapped 2 MiB larger,
# the slack before and after unmapped again) and ask for transparent huge
# pages: then every whole 2 MiB of the buffer can be one huge page, where a
# mapping placed wherever mmap puts it gets them only for the 2 MiB runs that
# happen to fall inside it. An O_DIRECT read into huge pages is one segment
# per 2 MiB, not one per 4 KiB page (see bounce.pxi): bench/probes/
# hugepage_reads.py, a cold 16 MiB read took 6.2 ms into huge pages and 15.2
# ms into 4 KiB ones on bench/README.md's virtual disk.
cdef Py_ssize_t _HUGE = 2 * 1024 * 1024


cdef void *_map_aligned(Py_ssize_t mapped) noexcept nogil:
    """An anonymous private mapping of ``mapped`` bytes (a multiple of the
    page size) starting on a 2 MiB boundary where mapped >= 2 MiB, with the
    huge-page hint (else where mmap puts it); MAP_FAILED if mmap fails."""
    cdef char *p
    cdef Py_ssize_t head
    p = <char *>MAP_FAILED
    if _HUGE <= mapped <= (<Py_ssize_t>0x7fffffffffffffff) - _HUGE:
        p = <char *>mmap(NULL, mapped + _HUGE, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0)
    if <void *>p == MAP_FAILED:   # small, or no room for the slack: wherever mmap puts it
        return mmap(NULL, mapped, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0)
    head = <Py_ssize_t>((_HUGE - <uintptr_t>p % _HUGE) % _HUGE)
    if head:
        munmap(p, head)
    if _HUGE - head:
        munmap(p + head + mapped, _HUGE - head)
    madvise(p + head, mapped, MADV_HUGEPAGE)   # a hint; failure is harmless
    return p + head


cdef class AlignedBuffer:
    """Page-aligned, zero-filled memory with the buffer protocol.

    Backed by an anonymous mmap, so it is aligned for any O_DIRECT device;
    one of 2 MiB or more starts on a 2 MiB boundary and asks for transparent
    huge pages. numpy arrays and torch tensors
    made from it keep it alive.

    ``recycle=True``: the memory may come from an earlier recycled buffer of
    the same page-rounded size, with its old bytes (not zero-filled), and goes
    back for reuse when this one is freed (up to :func:`recycle_limit`), so
    only for memory the caller overwrites whole before anyone reads it.
    """
    cdef char *ptr
    cdef readonly Py_ssize_t nbytes
    cdef Py_ssize_t mapped
    cdef Py_ssize_t shape[1]
    cdef Py_ssize_t strides[1]
    cdef int exports
    cdef readonly bint locked
    cdef readonly bint recycle
    cdef object release_hook

    def __cinit__(self, Py_ssize_t nbytes, bint lock=False, bint recycle=False):
        cdef void *p
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        if nbytes > (<Py_ssize_t>0x7fffffffffffffff) - _PAGE:
            raise MemoryError(f"cannot map {nbytes} bytes")
        self.nbytes = nbytes
        self.mapped = max(_PAGE, (nbytes + _PAGE - 1) // _PAGE * _PAGE)
        self.recycle = recycle and not lock
        if self.recycle:
            p = _recycled_take(self.mapped)
            if p != NULL:
                self.ptr = <char *>p
                aionvme_atomic_add(&_live_aligned, 1)
                aionvme_atomic_add(&_live_aligned_bytes, self.mapped)
                return
        with nogil:
            p = _map_aligned(self.mapped)
        if p == MAP_FAILED:
            self.ptr = NULL
            raise MemoryError(f"cannot map {nbytes} bytes: {os.strerror(errno)}")
        self.ptr = <char *>p
        aionvme_atomic_add(&_live_aligned, 1)
        aionvme_atomic_add(&_live_aligned_bytes, self.mapped)
        if lock:
            with nogil:
                rc = mlock(p, self.mapped)
            if rc != 0:
                err = errno
                munmap(p, self.mapped)
                self.ptr = NULL
                aionvme_atomic_add(&_live_aligned, -1)
                aionvme_atomic_add(&_live_aligned_bytes, -self.mapped)
                raise _exc.os_error(err, None, op="mlock", nbytes=nbytes)
            self.locked = True

    def __dealloc__(self):
        hook = self.release_hook
        self.release_hook = None
        if hook is not None and self.ptr != NULL:
            hook(<uintptr_t>self.ptr)   # e.g. cudaHostUnregister: before the pages go
        if self.ptr != NULL:
            if not (self.recycle and hook is None and _recycled_give(self.ptr, self.mapped)):
                munmap(self.ptr, self.mapped)
            self.ptr = NULL
            aionvme_atomic_add(&_live_aligned, -1)
            aionvme_atomic_add(&_live_aligned_bytes, -self.mapped)

    def set_release_hook(self, object hook):
        """Call hook(address) when the memory is about to be unmapped (once,
        from the deallocator: it must not raise). For registrations with
        other runtimes (cudaHostRegister) that must end before the pages go."""
        if hook is not None and not callable(hook):
            raise TypeError("hook must be callable or None")
        self.release_hook = hook

    @property
    def address(self):
        return <uintptr_t>self.ptr

    def __len__(self):
        return self.nbytes

    def __getbuffer__(self, Py_buffer *view, int flags):
        self.shape[0] = self.nbytes
        self.strides[0] = 1
        view.buf = self.ptr
        view.obj = self
        view.len = self.nbytes
        view.readonly = 0
        view.itemsize = 1
        if flags & PyBUF_FORMAT:
            view.format = "B"
        else:
            view.format = NULL
        view.ndim = 1
        view.shape = self.shape
        view.strides = self.strides
        view.suboffsets = NULL
        view.internal = NULL
        self.exports += 1

    def __releasebuffer__(self, Py_buffer *view):
        self.exports -= 1
