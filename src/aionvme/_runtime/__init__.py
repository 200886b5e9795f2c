"""The private runtime between the public API and the Cython engine.

Public modules (file, handle, gpu, formats, compat) call into this package;
nothing here imports them. Modules inside may use each other's private names.
"""
