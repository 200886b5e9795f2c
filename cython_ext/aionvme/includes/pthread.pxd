# POSIX threads, for the engine's worker pool (C threads that never take the GIL).
cdef extern from "<pthread.h>" nogil:
    ctypedef unsigned long pthread_t
    ctypedef struct pthread_attr_t:
        pass
    ctypedef struct pthread_mutex_t:
        pass
    ctypedef struct pthread_mutexattr_t:
        pass
    ctypedef struct pthread_cond_t:
        pass
    ctypedef struct pthread_condattr_t:
        pass

    int pthread_create(pthread_t *thread, const pthread_attr_t *attr,
                       void *(*start_routine)(void *) noexcept nogil, void *arg)
    int pthread_join(pthread_t thread, void **retval)
    int pthread_detach(pthread_t thread)
    pthread_t pthread_self()
    int pthread_setname_np(pthread_t thread, const char *name)
    int pthread_mutex_init(pthread_mutex_t *mutex, const pthread_mutexattr_t *attr)
    int pthread_mutex_destroy(pthread_mutex_t *mutex)
    int pthread_mutex_lock(pthread_mutex_t *mutex)
    int pthread_mutex_trylock(pthread_mutex_t *mutex)
    int pthread_mutex_unlock(pthread_mutex_t *mutex)
    int pthread_cond_init(pthread_cond_t *cond, const pthread_condattr_t *attr)
    int pthread_cond_destroy(pthread_cond_t *cond)
    int pthread_cond_wait(pthread_cond_t *cond, pthread_mutex_t *mutex)
    int pthread_cond_signal(pthread_cond_t *cond)
    int pthread_cond_broadcast(pthread_cond_t *cond)
    int pthread_atfork(void (*prepare)() noexcept nogil, void (*parent)() noexcept nogil,
                       void (*child)() noexcept nogil)


cdef extern from "<sched.h>" nogil:
    int sched_yield()


cdef extern from "<signal.h>" nogil:
    ctypedef struct sigset_t:
        pass
    int sigfillset(sigset_t *set)
    int pthread_sigmask(int how, const sigset_t *set, sigset_t *oldset)
    enum: SIG_SETMASK
