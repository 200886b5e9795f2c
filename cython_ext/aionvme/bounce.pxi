# Bounce buffers: a chunk slot's own aligned buffer, for the parts of a
# transfer the caller's buffer cannot take directly (an unaligned head or
# tail, an unaligned address, a write that copies: see planning.pxi). Kept
# with the slot and reused; freed at teardown.

# Bounce copies up to this size run inline on the loop thread (a few µs);
# larger ones go to a worker (see PH_*).
cdef int64_t COPY_INLINE_MAX = 64 * 1024
cdef int64_t HUGE_BOUNCE = 2 * 1024 * 1024   # bounce buffers this large get huge pages


cdef inline void _free_bounce(Chunk *ch) noexcept nogil:
    if ch.bounce != NULL:
        free(ch.bounce)
        aionvme_atomic_add(&_live_bounce, -1)
        aionvme_atomic_add(&_live_bounce_bytes, -ch.bounce_size)
    ch.bounce = NULL
    ch.bounce_size = 0


cdef int _bounce_ensure(Engine e, ReqC *r, Chunk *ch) noexcept nogil:
    """Give ch a bounce buffer of at least one block of r (its own, if big
    enough already). 0, or -ENOMEM."""
    cdef void *mem
    cdef int64_t need = r.block if r.block > r.align else r.align
    if ch.bounce == NULL or ch.bounce_size < need:
        _free_bounce(ch)
        mem = NULL
        if need >= HUGE_BOUNCE:
            # Huge pages where the kernel gives them: one physically
            # contiguous 2 MiB run is one segment of a request, so a
            # transfer goes to the device in requests of max_sectors_kb
            # (pages faulted by 4 KiB, by threads faulting at once, end
            # up scattered, and requests hold at most max_segments).
            if posix_memalign(&mem, HUGE_BOUNCE, need) != 0:
                return -ENOMEM
            madvise(mem, need - need % HUGE_BOUNCE, MADV_HUGEPAGE)   # a hint
        elif posix_memalign(&mem, 4096 if r.mem_align <= 4096 else r.mem_align, need) != 0:
            return -ENOMEM
        ch.bounce = <char *>mem
        ch.bounce_size = need
        e.n_bounce_buffers += 1
        aionvme_atomic_add(&_live_bounce, 1)
        aionvme_atomic_add(&_live_bounce_bytes, need)
    return 0
