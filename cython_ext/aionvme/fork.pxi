# fork(): a child gets a copy of every mutex in the state it had at the
# instant of fork(), but only the thread that called fork(). A lock that a
# worker, the submitter or another Python thread held then stays held in the
# child for good (pthread_atfork(3), "fork(2): the child process is created
# with a single thread"). These handlers run inside fork() itself, before any
# code of the child, Python's after-fork hooks included.
#
# - Per-inode read-modify-write locks (InodeC.lock): held during every
#   unaligned write and while open() records the file size. Re-initialised.
# - The list of inodes (_inodes_mu): taken before fork() so the child sees a
#   whole list, released in the parent, re-initialised in the child.
# - The cuFile driver lock (_cf_mu): re-initialised.
# - Engines' pool and submitter locks: a child never touches a parent's
#   engine (the reactor's after-fork hook abandons them, and _pool_free /
#   _submitter_free leave the locks alone when forked).


cdef void _atfork_prepare() noexcept nogil:
    pthread_mutex_lock(&_inodes_mu)


cdef void _atfork_parent() noexcept nogil:
    pthread_mutex_unlock(&_inodes_mu)


cdef void _atfork_child() noexcept nogil:
    cdef InodeC *ino = _inodes_head
    pthread_mutex_init(&_inodes_mu, NULL)
    while ino != NULL:
        pthread_mutex_init(&ino.lock, NULL)
        ino = ino.all_next
    pthread_mutex_init(&_cf_mu, NULL)


pthread_atfork(_atfork_prepare, _atfork_parent, _atfork_child)
