# Type stubs for the Cython extension aionvme._engine (kept true by mypy.stubtest).
from collections.abc import Callable, Iterable
from typing import Any

from typing_extensions import disjoint_base

KERNEL_AIO: int
WORKER_POOL: int
PAGE_SIZE: int
MODE_SINGLE_SUBMIT: int
MODE_NO_OVERLAP: int

def open_handles() -> int: ...
def counters() -> dict[str, Any]: ...
def fstatx(fd: int) -> dict[str, Any]: ...
def fs_type(fd: int) -> int: ...
def aio_probe() -> OSError | None: ...
def uring_probe() -> OSError | None: ...
def buffer_info(buf: object, writable: bool = ...) -> tuple[int, int]: ...
def gds_load(candidates: Iterable[str]) -> tuple[str | None, str | None]: ...
def gds_unload() -> bool: ...
def gds_driver_open() -> None: ...
def gds_driver_close() -> bool: ...
def gds_driver_properties() -> dict[str, Any] | None: ...
def gds_status() -> dict[str, Any]: ...
def gds_forget() -> None: ...
def gds_register_file(f: FileHandle) -> None: ...
def gds_file_registered(f: FileHandle) -> bool: ...
def gds_refuse_file(f: FileHandle, reason: OSError) -> None: ...
def gds_buf_register(ptr: int, nbytes: int, flags: int = ...) -> None: ...
def gds_buf_deregister(ptr: int) -> None: ...
def gds_submit(
    eng: Engine,
    f: FileHandle,
    items: Iterable[tuple[Any, int, int, int, int]],
    write: bool = ...,
    block: int = ...,
    max_inflight: int = ...,
) -> Request: ...
def plan(
    addr: int,
    nbytes: int,
    offset: int,
    align: int = ...,
    mem_align: int = ...,
    block: int = ...,
    write: bool = ...,
) -> list[dict[str, Any]]: ...

@disjoint_base
class AlignedBuffer:
    nbytes: int
    locked: bool
    def __new__(cls, nbytes: int, lock: bool = ...) -> AlignedBuffer: ...
    @property
    def address(self) -> int: ...
    def __len__(self) -> int: ...
    def set_release_hook(self, hook: Callable[[int], None] | None) -> None: ...
    def __buffer__(self, flags: int, /) -> memoryview: ...
    def __release_buffer__(self, buffer: memoryview, /) -> None: ...

@disjoint_base
class Inode:
    def __new__(cls, known_size: int = ...) -> Inode: ...
    @property
    def known_size(self) -> int: ...
    def reset_size(self, size: int) -> None: ...

@disjoint_base
class FileHandle:
    fd: int
    path_kind: int
    direct: bool
    readable: bool
    writable: bool
    align: int
    mem_align: int
    path: Any
    inode: Inode
    active: int
    closing: bool
    closed: bool
    owner: Any
    gds_refused: OSError | None
    ring_ok: bool
    def __new__(
        cls,
        fd: int,
        path: object,
        path_kind: int,
        direct: bool,
        readable: bool,
        writable: bool,
        align: int,
        mem_align: int,
        inode: Inode,
        owner: object = ...,
    ) -> FileHandle: ...
    def close(self) -> bool: ...
    def detach(self) -> None: ...

@disjoint_base
class Request:
    file: FileHandle
    engine: Engine
    future: Any
    callback: Any
    cancel_requested: bool
    cancel_msg: Any
    @property
    def nbytes(self) -> int: ...
    @property
    def nsegments(self) -> int: ...
    @property
    def op(self) -> str: ...
    @property
    def finished(self) -> bool: ...
    @property
    def cancelled(self) -> bool: ...
    @property
    def ok(self) -> bool: ...
    def exception(self) -> BaseException | None: ...

@disjoint_base
class Engine:
    owner: Any
    use_aio: bool
    aio_error: OSError | None
    use_uring: bool
    uring_direct: bool
    uring_lazy: bool
    backlog: bool
    uring_error: OSError | None
    efd: int
    queue_depth: int
    n_inline_submits: int
    n_thread_submits: int
    inline_submit_max: int
    max_inflight_bytes: int
    adaptive: bool
    n_completed: int
    n_thread_jobs: int
    n_requests: int
    n_live_requests: int
    n_bounce_buffers: int
    n_ring_reaps: int
    submit_budget: int
    more: bool
    def __new__(
        cls,
        queue_depth: int = ...,
        threads: int = ...,
        use_aio: bool = ...,
        ring_reap: bool = ...,
        submit_budget: int = ...,
        max_inflight_bytes: int = ...,
        inline_submit_max: int = ...,
        aio_nr: int = ...,
        submit_ramp: int = ...,
        uring: int = ...,
    ) -> Engine: ...
    @property
    def backend(self) -> str: ...
    def read(
        self,
        f: FileHandle,
        buf: object,
        offset: int = ...,
        block: int = ...,
        max_inflight: int = ...,
        mode: int = ...,
    ) -> Request: ...
    def write(
        self,
        f: FileHandle,
        buf: object,
        offset: int = ...,
        block: int = ...,
        max_inflight: int = ...,
        mode: int = ...,
    ) -> Request: ...
    def readv(
        self,
        f: FileHandle,
        items: Iterable[tuple[Any, int]],
        block: int = ...,
        max_inflight: int = ...,
        mode: int = ...,
    ) -> Request: ...
    def writev(
        self,
        f: FileHandle,
        items: Iterable[tuple[Any, int]],
        block: int = ...,
        max_inflight: int = ...,
        mode: int = ...,
    ) -> Request: ...
    def fsync(self, f: FileHandle, datasync: bool = ...) -> Request: ...
    def cancel(self, req: Request) -> bool: ...
    def pump(self) -> list[Request]: ...
    def flush(self) -> list[Request]: ...
    def wait(self, timeout: float = ...) -> None: ...
    def run(self, req: Request) -> Request: ...
    def fileno(self) -> int: ...
    def _uring_refuse(self, n: int) -> None: ...
    @property
    def inflight(self) -> int: ...
    @property
    def pending(self) -> int: ...
    @property
    def threads_started(self) -> int: ...
    @property
    def is_closed(self) -> bool: ...
    def stats(self) -> dict[str, Any]: ...
    def close(self) -> list[Request]: ...
    def abandon(self) -> None: ...
