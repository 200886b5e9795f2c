"""Build aionvme's one extension, aionvme._engine, from cython_ext/.

Needs only a C compiler and Cython: kernel AIO is called through syscall(2)
and cuFile is loaded with dlopen at run time, so neither libaio nor CUDA is
needed to build. AIONVME_CYTHON_TRACE=1 builds with line tracing for coverage;
AIONVME_DEBUG=1 builds the debug engine (counters and checks on the hot path).
"""

import os

from Cython.Build import cythonize
from setuptools import Extension, setup

macros = [("_GNU_SOURCE", "1")]
directives = {}
if os.environ.get("AIONVME_DEBUG"):
    # the debug build: per-chunk counters and invariant checks (counters.pxi)
    macros.append(("AIONVME_DEBUG", "1"))
if os.environ.get("AIONVME_CYTHON_TRACE"):
    macros.append(("CYTHON_TRACE_NOGIL", "1"))
    directives["linetrace"] = True

ext = Extension(
    "aionvme._engine",
    ["cython_ext/aionvme/_engine.pyx"],
    include_dirs=["cython_ext/aionvme/includes"],
    define_macros=macros,
    libraries=["dl", "pthread"],
    extra_compile_args=["-O2", "-fno-strict-aliasing"],
)

setup(
    ext_modules=cythonize(
        [ext],
        include_path=["cython_ext"],
        compiler_directives={"language_level": "3", **directives},
    ),
)
