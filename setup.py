"""Install-time build of the native CPU kernels (the rest of the metadata is in pyproject.toml).

`pip install .` / `pip install -e .` compile the three C libraries of engramflow/kernels
(native_kernels.c, native_io.c, block_scaled.c, each with kernel_common.h) into
engramflow/kernels/_<name>-<machine>.so, ctypes libraries (not CPython extensions): into the
wheel, or in place in the source tree for an editable install, each by its module's
build_library, i.e. by engramflow/kernels/native_build.py, the one loader that also builds them
at first use. The build never fails the install: without a C compiler (or when compiling fails)
the package installs without a library, and it is built at first use or its callers fall back
(numpy/torch, a pread pool) with a warning. ENGRAMFLOW_NO_NATIVE_BUILD=1 skips the build here.
"""
from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

from setuptools import Command, setup
from setuptools.command.build import build
from setuptools.dist import Distribution

HERE = Path(__file__).resolve().parent
KERNELS = Path("engramflow", "kernels")


def _by_path(module_name: str, file: str):
    spec = importlib.util.spec_from_file_location(module_name, HERE / KERNELS / file)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # (dataclasses look their module up there)
    spec.loader.exec_module(module)
    return module


def _native(name: str = "native"):
    """engramflow/kernels/<name>.py, loaded by path: it needs only the standard library, while
    importing the package would need its dependencies, absent in an isolated build env. The
    loader every library module uses (native_build.py) is loaded first, under the name they fall
    back to."""
    if "_engramflow_build_helper" not in sys.modules:
        _by_path("_engramflow_build_helper", "native_build.py")
    return _by_path(f"_engramflow_{name}_build", f"{name}.py")


class build_native(Command):
    description = "compile the native CPU kernels (skipped, with a warning, without a C compiler)"
    user_options: list = []

    def initialize_options(self):
        self.build_lib = None
        self.editable_mode = False

    def finalize_options(self):
        self.set_undefined_options("build_py", ("build_lib", "build_lib"))

    def _target(self) -> Path:
        name = _native().INSTALLED_NAME
        # editable: next to the sources, where the package is imported from
        return HERE / KERNELS / name if self.editable_mode else Path(self.build_lib) / KERNELS / name

    def run(self):
        if os.environ.get("ENGRAMFLOW_NO_NATIVE_BUILD") == "1":
            self.announce("engramflow: ENGRAMFLOW_NO_NATIVE_BUILD=1, native kernels not built", level=2)
            return
        native = _native()
        target = self._target()
        try:
            ok, log = native.build_library(target, source=HERE / KERNELS / "native_kernels.c")
        except Exception as e:  # never fail the install over an optional library
            ok, log = False, repr(e)
        if ok:
            print(f"engramflow: built native kernels {target}")
            if log:
                print(f"engramflow: some kernel variants did not build with this compiler:\n{log}")
        else:
            target.unlink(missing_ok=True)  # a library left in build/ by an earlier build is not this one
            print(f"WARNING: engramflow: native kernels not built ({log.strip()[:2000]}); they are built at first "
                  f"use if a compiler appears, else the slower numpy/torch paths run")
        self._build_io()

    def _build_io(self):
        """The batched-read library (io_uring) of the SSD tier and the block-scaled GEMM, the same way."""
        for module, source, what, without in (
                ("native_io", "native_io.c", "the batched-read library", "the SSD tier reads with a thread pool"),
                ("block_scaled_lib", "block_scaled.c", "the block-scaled GEMM",
                 "quantised linears run their torch reference")):
            lib = _native(module)
            target = self._target().with_name(lib.INSTALLED_NAME)
            try:
                ok, log = lib.build_library(target, source=HERE / KERNELS / source)
            except Exception as e:  # never fail the install over an optional library
                ok, log = False, repr(e)
            if ok:
                print(f"engramflow: built {what} {target}")
            else:
                target.unlink(missing_ok=True)
                print(f"WARNING: engramflow: {what} not built ({log.strip()[:2000]}); it is built at first use if a "
                      f"compiler appears, else {without}")

    def get_outputs(self):
        return [str(Path(self.build_lib) / KERNELS / _native(m).INSTALLED_NAME)
                for m in ("native", "native_io", "block_scaled_lib")]

    def get_output_mapping(self):
        return {}

    def get_source_files(self):
        return [str(KERNELS / name) for name in ("native_kernels.c", "native_io.c", "block_scaled.c", "kernel_common.h")]


class build_with_native(build):
    sub_commands = [*build.sub_commands, ("build_native", None)]


class PlatformDistribution(Distribution):
    """The wheel holds a machine-specific library: tag it for the platform, not py3-none-any."""

    def has_ext_modules(self):
        return True


setup(cmdclass={"build": build_with_native, "build_native": build_native}, distclass=PlatformDistribution)
