# The dynamic loader (dlopen(3)): optional native libraries (cuFile, the CUDA
# driver) are loaded at run time, so neither is needed to build or import.
cdef extern from "<dlfcn.h>" nogil:
    void *dlopen(const char *filename, int flags)
    void *dlsym(void *handle, const char *symbol)
    char *dlerror()
    int dlclose(void *handle)
    enum:
        RTLD_LAZY
        RTLD_NOW
        RTLD_LOCAL
        RTLD_GLOBAL
        RTLD_NOLOAD
