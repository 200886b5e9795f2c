"""The planner that cuts a segment into kernel transfers (the engine runs the
same C code): every byte covered once, transfers aligned, never past the
caller's buffer, bounce and read-modify-write only where needed."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from aionvme._engine import plan


@settings(max_examples=400, deadline=None)
@given(
    addr=st.integers(0, 1 << 20),
    nbytes=st.integers(1, 5 << 20),
    offset=st.integers(0, 1 << 30),
    align=st.sampled_from([512, 4096]),
    mem_align=st.sampled_from([4, 512, 4096]),
    block_pages=st.integers(1, 64),
    write=st.booleans(),
)
def test_plan_properties(addr, nbytes, offset, align, mem_align, block_pages, write):
    block = block_pages * 4096
    chunks = plan(addr, nbytes, offset, align, mem_align, block, write)
    pos = offset
    for c in chunks:
        # user ranges tile [offset, offset+nbytes) in order, without gaps or overlap
        assert c["upos"] == pos and c["ulen"] > 0
        pos += c["ulen"]
        # the kernel transfer is aligned and covers the user range
        assert c["foff"] % align == 0 and c["len"] % align == 0
        assert c["foff"] <= c["upos"] and c["upos"] + c["ulen"] <= c["foff"] + c["len"]
        assert c["len"] <= max(block, align)
        if not c["bounce"]:
            # straight into the caller's memory: exactly its bytes, aligned address
            assert c["foff"] == c["upos"] and c["len"] == c["ulen"]
            assert (addr + c["upos"] - offset) % mem_align == 0
        else:
            assert c["uskip"] == c["upos"] - c["foff"]
        partial = c["foff"] < c["upos"] or c["upos"] + c["ulen"] < c["foff"] + c["len"]
        assert c["rmw"] == (write and partial)
    assert pos == offset + nbytes


def test_aligned_request_is_all_zero_copy():
    chunks = plan(1 << 20, 8 << 20, 4096, 512, 512, 1 << 20)
    assert len(chunks) == 8 and not any(c["bounce"] for c in chunks)


def test_unaligned_head_and_tail_only_bounce_their_blocks():
    # Buffer at address 0 holding file offset 100: file 512 lands at address
    # 412, not aligned, so the middle has to bounce too.
    chunks = plan(0, 3 << 20, 100, 512, 512, 1 << 20)
    assert chunks[0]["bounce"] and chunks[0]["len"] == 512
    assert chunks[-1]["bounce"] and chunks[-1]["len"] == 512
    assert all(c["bounce"] for c in chunks)
    # Buffer at address 100 holding file offset 100: file 512 lands at 512,
    # so only the head and tail blocks bounce; the middle is zero-copy.
    chunks = plan(100, 3 << 20, 100, 512, 512, 1 << 20)
    assert chunks[0]["bounce"] and chunks[-1]["bounce"]
    assert all(not c["bounce"] for c in chunks[1:-1])


def test_buffered_files_have_no_alignment():
    chunks = plan(3, 10_000, 7, 1, 1, 4096)
    assert [c["len"] for c in chunks] == [4096, 4096, 10_000 - 8192]
    assert not any(c["bounce"] or c["rmw"] for c in chunks)
