"""The one compiled part of the package: the CTF reader's core (src/tracesynth/io/ctf/_core.pyx),
cythonized at build time (Cython is a build requirement in pyproject.toml). The extension is
optional: where Cython or a C compiler is missing the package installs without it, and the reader
uses numba or its Python decoder (tracesynth.io.ctf.fast.kernels). Everything else is in
pyproject.toml.
"""

import os
import sys

from setuptools import Extension, setup

CORE = "src/tracesynth/io/ctf/_core.pyx"


def extensions() -> list:
    try:
        from Cython.Build import cythonize
    except ImportError:
        print("setup.py: Cython is not installed; building without the compiled CTF core", file=sys.stderr)
        return []
    args = [] if sys.platform == "win32" else ["-O3", "-fwrapv"]  # the kernels' integers wrap as numba's do
    ext = Extension("tracesynth.io.ctf._core", [CORE], extra_compile_args=args, optional=True)
    # the generated C goes under build/, not beside the source
    exts = cythonize([ext], build_dir=os.path.join("build", "cython"), quiet=True, language_level=3)
    for e in exts:  # cythonize's copies lose `optional`: a failed compile would fail the install
        e.optional = True
    return exts


setup(ext_modules=extensions())
