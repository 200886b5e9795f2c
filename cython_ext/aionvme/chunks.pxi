# A chunk's life in the engine: cut from its request's next segment
# (_gen_chunk: which backend takes it, a bounce buffer or not, a preparing
# fallocate first for writes past EOF), and its result folded back into the
# request (_complete_chunk: errors, short reads and writes, the slot freed).

cdef int _gen_chunk(Engine e, ReqC *r, Chunk *ch) noexcept nogil:
    cdef Seg *s
    cdef Plan p
    cdef int64_t lo
    cdef int32_t i
    if r.flags & RF_GEN_DONE:
        return GEN_DONE
    ch.req = r
    ch.fd = r.fd
    ch.user = NULL
    ch.phase = PH_NONE
    ch.uskip = 0
    ch.ulen = 0
    ch.seg = 0
    if r.op == OP_FSYNC or r.op == OP_FDATASYNC:
        ch.op = CH_FSYNC if r.op == OP_FSYNC else CH_FDATASYNC
        ch.kind = KIND_THREAD
        ch.foff = 0
        ch.len = 0
        r.flags |= RF_GEN_DONE
        return GEN_CHUNK
    if r.cur >= r.nsegs:
        r.flags |= RF_GEN_DONE
        return GEN_DONE
    if r.op == OP_WRITE and r.align > 1 and r.inode != NULL and not (r.flags & RF_PREP_DONE):
        if r.flags & RF_PREP_WAIT:
            return GEN_BLOCKED
        if r.end_max > r.inode.known_size:
            # Data chunks wait until the range beyond EOF exists (see _job_prep).
            lo = r.end_max
            for i in range(r.nsegs):
                if r.segs[i].nbytes > 0 and r.segs[i].offset < lo:
                    lo = r.segs[i].offset
            ch.op = CH_PREP
            ch.kind = KIND_THREAD
            ch.foff = lo
            ch.len = r.end_max - lo
            r.flags |= RF_PREP_WAIT
            return GEN_CHUNK
        r.flags |= RF_PREP_DONE
    # skip empty segments
    while r.cur < r.nsegs and r.pos >= r.segs[r.cur].offset + r.segs[r.cur].nbytes:
        r.cur += 1
        if r.cur < r.nsegs:
            r.pos = r.segs[r.cur].offset
    if r.cur >= r.nsegs:
        r.flags |= RF_GEN_DONE
        return GEN_DONE
    s = &r.segs[r.cur]
    _plan_chunk(s.offset, s.nbytes, <uintptr_t>s.addr, r.pos, r.align, r.mem_align,
                r.block, r.op == OP_WRITE, &p)
    if r.op == OP_READ and p.len > _INT64_MAX - p.foff:
        # The block reaches 2**63: the kernel refuses a transfer whose end
        # overflows loff_t (EINVAL, rw_verify_area), and no file holds a
        # byte there (MAX_LFS_FILESIZE is 2**63 - 1). Read the aligned part
        # that fits; the rest is past the end of any file: a short read.
        p.len = (_INT64_MAX - p.foff) - (_INT64_MAX - p.foff) % r.align
    if ((r.flags & RF_COPY) and r.op == OP_WRITE and not p.bounce and not p.rmw and r.align > 1
            and not (r.flags & RF_GDS)):
        # The caller's pages may be scattered in physical memory: the kernel
        # then builds requests of at most max_segments pages each (~1 MiB on
        # virtio-blk) where the slot's own buffer, physically contiguous in
        # long runs, goes out in requests of max_sectors_kb.
        p.bounce = 1
    ch.seg = r.cur
    ch.foff = p.foff
    ch.len = p.len
    ch.uskip = p.uskip
    ch.ulen = p.ulen
    if r.path == PATH_AIO and e.use_aio and p.len > 0:
        ch.kind = KIND_AIO
        ch.ring = e.uring_direct
    elif e.use_uring and (r.flags & RF_RING_OK) and not (r.flags & RF_GDS) and p.len > 0:
        # Buffered files through io_uring: a page-cache hit completes
        # inside io_uring_enter, with no worker hand-off; a miss goes to
        # io_uring's own workers. (Kernel AIO would copy synchronously.)
        ch.kind = KIND_AIO
        ch.ring = 1
    else:
        ch.kind = KIND_THREAD
        ch.ring = 0
    if p.rmw:
        ch.op = CH_RMW
        ch.kind = KIND_THREAD
    else:
        ch.op = CH_READ if r.op == OP_READ else CH_WRITE
    if p.bounce:
        if _bounce_ensure(e, r, ch) != 0:
            return -ENOMEM
        ch.buf = ch.bounce
        ch.user = s.addr + (p.upos - s.offset)
        if ch.op == CH_WRITE:
            if ch.kind == KIND_THREAD or p.ulen > COPY_INLINE_MAX:
                ch.phase = PH_FILL
            else:
                memcpy(ch.bounce, ch.user, p.ulen)
    else:
        ch.buf = s.addr + (p.upos - s.offset)
    if r.flags & RF_GDS:
        _gds_chunk(r, s, &p, ch)
    r.pos = p.upos + p.ulen
    if r.pos >= s.offset + s.nbytes:
        r.cur += 1
        if r.cur < r.nsegs:
            r.pos = r.segs[r.cur].offset
        else:
            r.flags |= RF_GEN_DONE
    return GEN_CHUNK


cdef void _complete_chunk(Engine e, Chunk *ch) noexcept nogil:
    cdef ReqC *r = ch.req
    cdef int64_t res = ch.res
    cdef int64_t got, first_missing
    cdef int32_t slot
    if ch.op == CH_READ or ch.op == CH_GDS_READ:
        if res < 0:
            if r.err == 0:
                r.err = <int32_t>-res
                r.err_off = ch.foff + ch.uskip
            e._stop_generating(r)
        else:
            if ch.user != NULL:
                # bounce read: hand the caller the part of the block it asked for
                got = _bounce_got(ch, res)
                if got > 0 and ch.phase != PH_DRAINED:
                    memcpy(ch.user, ch.bounce + ch.uskip, got)
            else:
                got = res
            if got < ch.ulen:
                first_missing = ch.foff + ch.uskip + got
                if (r.short_seg < 0 or ch.seg < r.short_seg
                        or (ch.seg == r.short_seg and first_missing < r.short_at)):
                    r.short_seg = ch.seg
                    r.short_at = first_missing
                e._stop_generating(r)
    elif ch.op == CH_WRITE or ch.op == CH_RMW or ch.op == CH_GDS_WRITE:
        if res < 0:
            if r.err == 0:
                r.err = <int32_t>-res
                r.err_off = ch.foff + ch.uskip
            e._stop_generating(r)
        elif res < ch.len:
            if r.err == 0 and not (r.flags & RF_SHORT_WRITE):
                r.flags |= RF_SHORT_WRITE
                r.err_off = ch.foff + res
            e._stop_generating(r)
    elif ch.op == CH_PREP:
        r.flags &= ~RF_PREP_WAIT
        r.flags |= RF_PREP_DONE
        if res < 0:
            if r.err == 0:
                r.err = <int32_t>-res
                r.err_off = ch.foff
            e._stop_generating(r)
    else:   # CH_FSYNC / CH_FDATASYNC
        if res < 0 and r.err == 0:
            r.err = <int32_t>-res
            r.err_off = 0
    if AIONVME_DEBUG:
        _dbg_check(r.inflight > 0 and not (r.flags & RF_FINISHED) and e.nfree < e.queue_depth)
        aionvme_atomic_add(&_dbg_chunks, -1)
        aionvme_atomic_add(&_dbg_completed, 1)
    e.n_completed += 1
    e.done_bytes += ch.acct
    e.inflight_bytes -= ch.acct
    ch.acct = 0
    r.inflight -= 1
    slot = <int32_t>(ch - e.chunks)
    ch.req = NULL
    ch.user = NULL
    ch.phase = PH_NONE
    ch.next_free = e.free_head
    e.free_head = slot
    e.nfree += 1
    if r.inflight == 0 and (r.flags & RF_GEN_DONE) and not (r.flags & RF_FINISHED):
        e._finish(r)
