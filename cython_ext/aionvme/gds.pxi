# cuFile (GPUDirect Storage): the library loaded with dlopen, the driver opened
# with a reference count, file handles registered per FileHandle, and the
# CH_GDS_* chunks that workers run with cuFileRead/cuFileWrite.
#
# Facts this relies on (cufile.h of cuFile 1.15; includes/cufile_abi.h):
# - cuFileRead/cuFileWrite block until the transfer is done, so they run on
#   the worker pool like buffered I/O and complete through the same eventfd.
# - They return bytes moved (>= 0), -1 with errno set (filesystem errors), or
#   a negative CUfileOpError (values CUFILEOP_BASE_ERR + n, n >= 1). The chunk
#   keeps that as res: -errno stays < 5000, cuFile's codes are >= 5000, so
#   Request.exception() tells them apart.
# - cuFileHandleRegister needs the fd open with O_DIRECT; the handle must be
#   deregistered before the fd is closed (or the number reused).
# - cuFileDriverOpen has been seen to close fd 0 (NVIDIA/DALI#5902): fd 0 is
#   duplicated before and put back if it is gone after.
# - A worker thread calling cuFile with a device pointer needs the CUDA
#   context of that memory current (rapidsai/kvikio pushes it in every task):
#   it is looked up once per segment with cuPointerGetAttribute in libcuda,
#   which is only found if the process already loaded it (RTLD_NOLOAD).

cdef void *_cf_lib = NULL
cdef object _cf_path = None
cdef int _cf_version = 0
cdef cuFileDriverOpen_t _cf_driver_open = NULL
cdef cuFileDriverClose_t _cf_driver_close = NULL
cdef cuFileHandleRegister_t _cf_handle_register = NULL
cdef cuFileHandleDeregister_t _cf_handle_deregister = NULL
cdef cuFileBufRegister_t _cf_buf_register = NULL
cdef cuFileBufDeregister_t _cf_buf_deregister = NULL
cdef cuFileRead_t _cf_read = NULL
cdef cuFileWrite_t _cf_write = NULL
cdef cuFileGetVersion_t _cf_get_version = NULL
cdef cuFileDriverGetProperties_t _cf_get_properties = NULL

cdef pthread_mutex_t _cf_mu            # serializes driver open/close across threads
pthread_mutex_init(&_cf_mu, NULL)
cdef long _cf_driver_refs = 0
cdef int _cf_pid = 0                   # process that opened the driver (a forked child must not use it)
cdef long _cf_handles = 0              # file handles registered
cdef long _cf_buffers = 0              # buffers registered
cdef long _cf_stdin_restored = 0

cdef void *_cu_lib = NULL
cdef cuPointerGetAttribute_t _cu_pointer_attr = NULL
cdef cuCtxSetCurrent_t _cu_set_current = NULL

# The symbols aionvme needs, and the optional ones.
_CF_REQUIRED = ("cuFileDriverOpen", "cuFileHandleRegister", "cuFileHandleDeregister",
                "cuFileBufRegister", "cuFileBufDeregister", "cuFileRead", "cuFileWrite")


cdef object _gds_error(int code, object path, object offset, object nbytes, object op):
    """The exception for a cuFile failure: CuFileError for cuFile's own codes,
    the errno's OSError subclass for -1 + errno."""
    return _exc.cufile_error(code, path, offset=offset, nbytes=nbytes, op=op)


cdef object _gds_status_error(CUfileError_t e, object op, object path=None):
    return _exc.cufile_error(e.err, path, op=op, cu_err=e.cu_err)


cdef void *_sym(void *lib, const char *name) noexcept:
    dlerror()
    return dlsym(lib, name)


def gds_load(object candidates):
    """Open the first cuFile library of candidates (sonames or paths) that
    loads and has every entry point aionvme uses. Returns (path, None) or
    (None, reason); a loaded library stays loaded (later calls return it)."""
    global _cf_lib, _cf_path, _cf_version
    global _cf_driver_open, _cf_driver_close, _cf_handle_register, _cf_handle_deregister
    global _cf_buf_register, _cf_buf_deregister, _cf_read, _cf_write, _cf_get_version
    global _cf_get_properties
    cdef void *lib
    cdef bytes name_b
    cdef const char *cname
    cdef int ver = 0
    cdef CUfileError_t e
    if _cf_lib != NULL:
        return _cf_path, None
    reasons = []
    for cand in candidates:
        name_b = os.fsencode(cand)
        cname = name_b
        with nogil:
            lib = dlopen(cname, RTLD_NOW | RTLD_LOCAL)
        if lib == NULL:
            err = dlerror()
            reasons.append(err.decode(errors="replace") if err != NULL else f"{cand}: cannot be loaded")
            continue
        missing = [s for s in _CF_REQUIRED if _sym(lib, s.encode()) == NULL]
        close_v2 = _sym(lib, b"cuFileDriverClose_v2")   # what cufile.h's cuFileDriverClose names
        close_v1 = _sym(lib, b"cuFileDriverClose")
        if close_v2 == NULL and close_v1 == NULL:
            missing.append("cuFileDriverClose")
        if missing:
            dlclose(lib)
            reasons.append(f"{cand}: no {', '.join(missing)} (not a cuFile library, or too old)")
            continue
        _cf_lib = lib
        _cf_path = os.fsdecode(cand)
        _cf_driver_open = <cuFileDriverOpen_t>_sym(lib, b"cuFileDriverOpen")
        _cf_driver_close = <cuFileDriverClose_t>(close_v2 if close_v2 != NULL else close_v1)
        _cf_handle_register = <cuFileHandleRegister_t>_sym(lib, b"cuFileHandleRegister")
        _cf_handle_deregister = <cuFileHandleDeregister_t>_sym(lib, b"cuFileHandleDeregister")
        _cf_buf_register = <cuFileBufRegister_t>_sym(lib, b"cuFileBufRegister")
        _cf_buf_deregister = <cuFileBufDeregister_t>_sym(lib, b"cuFileBufDeregister")
        _cf_read = <cuFileRead_t>_sym(lib, b"cuFileRead")
        _cf_write = <cuFileWrite_t>_sym(lib, b"cuFileWrite")
        _cf_get_version = <cuFileGetVersion_t>_sym(lib, b"cuFileGetVersion")        # cuFile >= 1.8
        _cf_get_properties = <cuFileDriverGetProperties_t>_sym(lib, b"cuFileDriverGetProperties")
        _cf_version = 0
        if _cf_get_version != NULL:
            with nogil:
                e = _cf_get_version(&ver)
            if e.err == CU_FILE_SUCCESS:
                _cf_version = ver    # 1000 * major + 10 * minor
        return _cf_path, None
    if not reasons:
        reasons.append("no candidate library")
    return None, "; ".join(reasons)


def gds_unload():
    """dlclose the library if nothing uses it (driver closed, nothing registered).
    Returns True if no library is loaded on return."""
    global _cf_lib, _cf_path, _cf_version
    if _cf_lib == NULL:
        return True
    if _cf_driver_refs > 0 or _cf_handles > 0 or _cf_buffers > 0:
        return False
    dlclose(_cf_lib)
    _cf_lib = NULL
    _cf_path = None
    _cf_version = 0
    return True


cdef int _cf_check_loaded() except -1:
    if _cf_lib == NULL:
        raise _exc.DeviceError("cuFile is not loaded (aionvme.gpu loads it on first use)")
    if _cf_pid and _cf_pid != getpid():
        raise _exc.DeviceError("cuFile was opened by the parent process; a forked child cannot use it")
    return 0


def gds_driver_open():
    """cuFileDriverOpen, reference-counted: the first call opens the driver,
    later ones count. Raises CuFileError; fd 0 survives it."""
    global _cf_driver_refs, _cf_pid, _cf_stdin_restored
    cdef CUfileError_t e
    cdef int saved = -1
    cdef bint restored = False
    _cf_check_loaded()
    with nogil:
        pthread_mutex_lock(&_cf_mu)
        if _cf_driver_refs == 0:
            saved = fcntl(0, F_DUPFD_CLOEXEC, 3)    # -1: there was no stdin to keep
            e = _cf_driver_open()
            if saved >= 0:
                if fcntl(0, F_GETFD) == -1 and errno == EBADF:
                    dup2(saved, 0)
                    restored = True
                close(saved)
        else:
            e.err = CU_FILE_SUCCESS
            e.cu_err = 0
        if e.err == CU_FILE_SUCCESS:
            _cf_driver_refs += 1
        pthread_mutex_unlock(&_cf_mu)
    if restored:
        _cf_stdin_restored += 1
    if e.err != CU_FILE_SUCCESS:
        raise _gds_status_error(e, "cuFileDriverOpen")
    _cf_pid = getpid()


def gds_driver_close():
    """Drop one reference; the last one closes the driver (cuFileDriverClose).
    Returns True if the driver is closed on return."""
    global _cf_driver_refs
    cdef CUfileError_t e
    cdef bint closed = False
    e.err = CU_FILE_SUCCESS
    e.cu_err = 0
    if _cf_lib == NULL or _cf_driver_refs == 0:
        return True
    if _cf_pid != getpid():
        _cf_driver_refs = 0   # the parent's: forget it
        return True
    with nogil:
        pthread_mutex_lock(&_cf_mu)
        if _cf_driver_refs > 0:   # checked again under the lock: a file may have let go meanwhile
            _cf_driver_refs -= 1
            if _cf_driver_refs == 0:
                e = _cf_driver_close()
                closed = True
        pthread_mutex_unlock(&_cf_mu)
    if e.err != CU_FILE_SUCCESS:
        raise _gds_status_error(e, "cuFileDriverClose")
    return closed


def gds_driver_properties():
    """cuFileDriverGetProperties as a dict (needs the driver open): the
    nvidia-fs version (0.0 when it is not loaded: cuFile runs in compatibility
    mode), status and control flags, limits."""
    cdef char raw[512]         # larger than any known CUfileDrvProps_t: newer libraries may add fields
    cdef CUfileDrvProps_t *p = <CUfileDrvProps_t *>raw
    cdef CUfileError_t e
    _cf_check_loaded()
    if _cf_get_properties == NULL:
        return None
    if _cf_driver_refs == 0:
        raise _exc.DeviceError("the cuFile driver is not open")
    memset(raw, 0, sizeof(raw))
    with nogil:
        e = _cf_get_properties(p)
    if e.err != CU_FILE_SUCCESS:
        raise _gds_status_error(e, "cuFileDriverGetProperties")
    return dict(nvfs_major=p.nvfs.major_version, nvfs_minor=p.nvfs.minor_version,
                poll_thresh_size_kb=p.nvfs.poll_thresh_size,
                max_direct_io_size_kb=p.nvfs.max_direct_io_size,
                dstatusflags=p.nvfs.dstatusflags, dcontrolflags=p.nvfs.dcontrolflags,
                nvme_supported=bool(p.nvfs.dstatusflags & (<unsigned int>1 << CU_FILE_NVME_SUPPORTED)),
                nvme_p2p_supported=bool(p.nvfs.dstatusflags & (<unsigned int>1 << CU_FILE_NVME_P2P_SUPPORTED)),
                poll_mode=bool(p.nvfs.dcontrolflags & (<unsigned int>1 << CU_FILE_USE_POLL_MODE)),
                allow_compat_mode=bool(p.nvfs.dcontrolflags & (<unsigned int>1 << CU_FILE_ALLOW_COMPAT_MODE)),
                fflags=p.fflags, max_device_cache_size_kb=p.max_device_cache_size,
                per_buffer_cache_size_kb=p.per_buffer_cache_size,
                max_device_pinned_mem_size_kb=p.max_device_pinned_mem_size,
                max_batch_io_size=p.max_batch_io_size)


def gds_status():
    """The loader's and driver's state in this process."""
    return dict(loaded=_cf_lib != NULL, path=_cf_path,
                version=_cf_version if _cf_version else None,
                driver_refs=_cf_driver_refs if _cf_pid == getpid() else 0,
                handles=_cf_handles, buffers=_cf_buffers, stdin_restored=_cf_stdin_restored,
                cuda_driver=_cu_set_current != NULL)


def gds_forget():
    """In a forked child: forget the parent's driver, handles and buffers
    without calling cuFile (its state belongs to the parent)."""
    global _cf_driver_refs, _cf_handles, _cf_buffers
    _cf_driver_refs = 0
    _cf_handles = 0
    _cf_buffers = 0
    pthread_mutex_init(&_cf_mu, NULL)   # it may have been held by another thread at fork


# -- files ---------------------------------------------------------------------------

def gds_register_file(FileHandle f):
    """Register f's fd with cuFile (once; cached on f until its fd closes).
    Raises CuFileError when cuFile refuses the file (no O_DIRECT,
    unsupported filesystem...); the error is also kept as f.gds_refused."""
    global _cf_handles, _cf_driver_refs
    cdef CUfileDescr_t descr
    cdef CUfileHandle_t h = NULL
    cdef CUfileError_t e
    if f.cufh != NULL:
        return None
    if f.closed or f.closing:
        raise _exc.ClosedFileError(f"I/O on a closed file: {f.path!r}")
    if f.gds_refused is not None:
        raise f.gds_refused
    _cf_check_loaded()
    if _cf_driver_refs == 0:
        raise _exc.DeviceError("the cuFile driver is not open")
    memset(&descr, 0, sizeof(descr))
    descr.type = CU_FILE_HANDLE_TYPE_OPAQUE_FD
    descr.handle.fd = f.fd
    descr.fs_ops = NULL
    with nogil:
        e = _cf_handle_register(&h, &descr)
        if e.err == CU_FILE_SUCCESS:
            pthread_mutex_lock(&_cf_mu)
            _cf_driver_refs += 1    # the driver stays open while a handle is registered
            pthread_mutex_unlock(&_cf_mu)
    if e.err != CU_FILE_SUCCESS:
        f.gds_refused = _gds_status_error(e, "cuFileHandleRegister", f.path)
        raise f.gds_refused
    f.cufh = h
    _cf_handles += 1
    return None


def gds_refuse_file(FileHandle f, object reason):
    """Mark f as refused by cuFile (reason: the exception) without
    deregistering it: requests in flight may still use its handle."""
    f.gds_refused = reason


def gds_file_registered(FileHandle f):
    """Whether f holds a cuFile handle."""
    return f.cufh != NULL


cdef void _gds_drop_file(FileHandle f) noexcept:
    # Called before f's fd is closed: cuFile forgets the fd first.
    global _cf_handles, _cf_driver_refs
    cdef CUfileHandle_t h = f.cufh
    if h == NULL:
        return
    f.cufh = NULL
    if _cf_handles > 0:
        _cf_handles -= 1
    if _cf_lib == NULL or _cf_pid != getpid():
        return   # a forked child's copy: the handle is the parent's
    with nogil:
        _cf_handle_deregister(h)
        pthread_mutex_lock(&_cf_mu)
        if _cf_driver_refs > 0:
            _cf_driver_refs -= 1
            if _cf_driver_refs == 0:
                _cf_driver_close()     # the last user: a failure here has no one to report to
        pthread_mutex_unlock(&_cf_mu)


# -- buffers -------------------------------------------------------------------------

def gds_buf_register(uintptr_t ptr, size_t nbytes, int flags=0):
    """cuFileBufRegister(ptr, nbytes, flags): map a buffer reused in many
    transfers once instead of per call. Raises CuFileError."""
    global _cf_buffers
    cdef CUfileError_t e
    _cf_check_loaded()
    if _cf_driver_refs == 0:
        raise _exc.DeviceError("the cuFile driver is not open")
    with nogil:
        e = _cf_buf_register(<const void *>ptr, nbytes, flags)
    if e.err != CU_FILE_SUCCESS:
        raise _gds_status_error(e, "cuFileBufRegister")
    _cf_buffers += 1


def gds_buf_deregister(uintptr_t ptr):
    """cuFileBufDeregister(ptr). Raises CuFileError."""
    global _cf_buffers
    cdef CUfileError_t e
    _cf_check_loaded()
    with nogil:
        e = _cf_buf_deregister(<const void *>ptr)
    if e.err != CU_FILE_SUCCESS:
        raise _gds_status_error(e, "cuFileBufDeregister")
    if _cf_buffers > 0:
        _cf_buffers -= 1


# -- the CUDA context of device memory ----------------------------------------------------

cdef void *_cu_context_of(uintptr_t ptr) noexcept:
    global _cu_lib, _cu_pointer_attr, _cu_set_current
    cdef void *ctx = NULL
    if _cu_lib == NULL:
        _cu_lib = dlopen(b"libcuda.so.1", RTLD_NOW | RTLD_LOCAL | RTLD_NOLOAD)
        if _cu_lib == NULL:
            return NULL     # CUDA is not in this process: nothing to make current
        _cu_pointer_attr = <cuPointerGetAttribute_t>_sym(_cu_lib, b"cuPointerGetAttribute")
        _cu_set_current = <cuCtxSetCurrent_t>_sym(_cu_lib, b"cuCtxSetCurrent")
    if _cu_pointer_attr == NULL or _cu_set_current == NULL:
        return NULL
    if _cu_pointer_attr(&ctx, CU_POINTER_ATTRIBUTE_CONTEXT, <unsigned long long>ptr) != 0:
        return NULL
    return ctx


# -- requests and chunks ---------------------------------------------------------------

def gds_submit(Engine eng, FileHandle f, object items, bint write=False, long long block=4 << 20,
               int max_inflight=0):
    """Queue one request moving device memory through cuFile on eng's workers.

    items: (owner, base, boff, nbytes, offset) tuples: the nbytes at
    base + boff move to/from the file at offset; base is what cuFile is given
    (a buffer registered with cuFileBufRegister, or the memory itself) and
    owner is kept alive until the request finishes. f must be registered
    (gds_register_file). Chunks of block bytes run in parallel on workers
    (at most max_inflight at once; 0: one per worker thread) and complete
    like any request."""
    cdef list lst = items if type(items) is list else list(items)
    cdef Request req
    cdef int64_t boff, n, off
    cdef uintptr_t base
    cdef int i
    if f.cufh == NULL:
        raise _exc.DeviceError(f"{f.path!r} is not registered with cuFile")
    if block < 1:
        raise ValueError(f"block must be >= 1, got {block}")
    if max_inflight <= 0:
        # A cuFile call holds a worker for its whole transfer: more chunks in
        # flight than workers would only queue behind them, delay everything
        # else the pool serves and keep a cancelled request from stopping.
        max_inflight = eng.nthreads_max
    req = _new_request(f, OP_WRITE if write else OP_READ, len(lst), block, max_inflight, 0)
    req.c.flags |= RF_GDS
    req.c.align = 1
    req.c.mem_align = 1
    req.c.block = block
    req.c.path = PATH_THREAD
    req.c.cufh = f.cufh
    for i, item in enumerate(lst):
        owner, base, boff, n, offset = item
        if boff < 0 or n < 0:
            raise ValueError("boff and nbytes must be >= 0")
        off = _file_offset(offset)
        if req.keep is None:
            req.keep = []
        req.keep.append(owner)
        req._put_segment(<char *>base, boff, n, off)
        req.c.segs[i].cuctx = _cu_context_of(base + <uintptr_t>boff)
    if req.c.nsegs:
        req.c.pos = req.c.segs[0].offset
    eng._enqueue(req)
    return req


cdef inline void _gds_chunk(ReqC *r, Seg *s, Plan *p, Chunk *ch) noexcept nogil:
    # A planned chunk of a GDS request (align 1: never bounced): cuFile gets
    # the segment's base pointer and the chunk's offset from it.
    ch.op = CH_GDS_READ if r.op == OP_READ else CH_GDS_WRITE
    ch.kind = KIND_THREAD
    ch.buf = s.addr
    ch.doff = s.boff + (p.upos - s.offset)


cdef int64_t _gds_job(Chunk *ch) noexcept nogil:
    # Run on a worker: the whole chunk, looping over short counts. Returns
    # bytes moved, -errno, or -CUfileOpError.
    cdef ReqC *r = ch.req
    cdef void *ctx = r.segs[ch.seg].cuctx
    cdef int64_t done = 0
    cdef ssize_t k
    if ctx != NULL and _cu_set_current(ctx) != 0:
        return -CU_FILE_CUDA_DRIVER_ERROR   # the device memory's context cannot be made current
    while done < ch.len:
        aionvme_clear_errno()
        if ch.op == CH_GDS_READ:
            k = _cf_read(r.cufh, ch.buf, ch.len - done, ch.foff + done, ch.doff + done)
        else:
            k = _cf_write(r.cufh, ch.buf, ch.len - done, ch.foff + done, ch.doff + done)
        if k > 0:
            done += k
        elif k == 0:
            break             # end of file (reads) or nothing accepted (writes): a short count
        elif k == -1:
            if errno == EINTR:
                continue
            return -(errno if errno != 0 else EIO)
        else:
            return k          # -CUfileOpError
    return done
