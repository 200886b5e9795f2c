# Planning: how one segment [offset, offset+nbytes) of a request is cut into
# kernel transfers. Pure arithmetic, no I/O; the engine calls it once per chunk
# and plan() exposes the same code to tests.
#
# With O_DIRECT the file offset and length of every transfer must be multiples
# of `align` (statx stx_dio_offset_align) and the memory address a multiple of
# `mem_align` (stx_dio_mem_align). A segment is cut as:
#   head   the block holding an unaligned start: one `align` block through a
#          bounce buffer (reads copy the part asked for; writes read-modify-write)
#   middle aligned [ceil(offset), floor(end)) in chunks of at most `block`,
#          straight into the caller's memory when that address is aligned,
#          else through a bounce buffer (never a transfer past the caller's end)
#   tail   the block holding an unaligned end, like the head
# align == 1 (buffered fd) makes every chunk a direct middle chunk.

cdef struct Plan:
    int64_t foff        # file offset of the kernel transfer
    int64_t len         # length of the kernel transfer
    int64_t upos        # first user byte's file offset
    int64_t ulen        # user bytes covered
    int64_t uskip       # bounce: where the user's bytes start in it
    int bounce          # 1 if the transfer goes through a bounce buffer
    int rmw             # 1 if a write must read-modify-write the block


cdef inline void _plan_chunk(int64_t offset, int64_t nbytes, uintptr_t addr, int64_t pos,
                             int64_t align, int64_t mem_align, int64_t block, bint write,
                             Plan *p) noexcept nogil:
    cdef int64_t end = offset + nbytes
    cdef int64_t blk, uend, tail_start
    cdef uintptr_t ua
    if pos % align != 0:
        # head: pos == offset here, the only unaligned position
        blk = pos - pos % align
        # min(blk + align, end), without computing blk + align: it overflows
        # for the block that ends at 2**63
        uend = end if end - blk <= align else blk + align
        p.foff = blk
        p.len = align
        p.upos = pos
        p.ulen = uend - pos
        p.uskip = pos - blk
        p.bounce = 1
        p.rmw = write
        return
    tail_start = end - end % align
    if pos < tail_start:
        p.foff = pos
        p.len = tail_start - pos
        if p.len > block:
            p.len = block
        p.upos = pos
        p.ulen = p.len
        p.uskip = 0
        p.rmw = 0
        ua = addr + <uintptr_t>(pos - offset)
        p.bounce = 0 if ua % <uintptr_t>mem_align == 0 else 1
        return
    # tail: pos aligned, fewer than align bytes left
    p.foff = pos
    p.len = align
    p.upos = pos
    p.ulen = end - pos
    p.uskip = 0
    p.bounce = 1
    p.rmw = write


def plan(uintptr_t addr, int64_t nbytes, int64_t offset, int64_t align=512,
         int64_t mem_align=512, int64_t block=1 << 20, bint write=False):
    """The chunks the engine would issue for one segment, as a list of dicts
    (foff, len, upos, ulen, uskip, bounce, rmw). For tests and tools."""
    cdef Plan p
    cdef int64_t pos = offset
    cdef list out = []
    if align < 1 or mem_align < 1 or block < align or block % align:
        raise ValueError("need align >= 1, mem_align >= 1 and block a positive multiple of align")
    while pos < offset + nbytes:
        _plan_chunk(offset, nbytes, addr, pos, align, mem_align, block, write, &p)
        out.append(dict(foff=p.foff, len=p.len, upos=p.upos, ulen=p.ulen, uskip=p.uskip,
                        bounce=bool(p.bounce), rmw=bool(p.rmw)))
        pos = p.upos + p.ulen
    return out
