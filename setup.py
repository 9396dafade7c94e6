# Builds the one native extension, cpu_offload._C: no torch headers, no torch library.
# kernels/isa_target.cpp is compiled once per ISA target with that target's flags and
# linked into the same module; the best target is chosen at import (csrc/dispatch.cpp).
# NOTE: never -march=native: the module must run on any x86-64 (or aarch64) CPU, whatever
# built it.
import os
import platform

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

COMMON_FLAGS = ["-std=c++17", "-O3", "-ffp-contract=off", "-fno-math-errno", "-fvisibility=hidden"]
X86_TARGETS = {
    "scalar": [],
    "avx2": ["-mavx2", "-mfma", "-mf16c"],
    "avx512": ["-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq"],
    "avx512_bf16": ["-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq",
                    "-mavx512bf16"],
}
TARGET_IDS = {"scalar": 0, "avx2": 1, "avx512": 2, "avx512_bf16": 3}
IS_X86 = platform.machine().lower() in ("x86_64", "amd64")
# aarch64: NEON (every ARMv8-A), NEON + BF16 (ARMv8.6 BFCVTN), and fixed-length SVE per
# vector length, with and without BF16 (csrc/vec/sve.h says why fixed length).
# NOTE: the SVE builds use -march=armv8.2-a+sve (what the intrinsics need), not SVE2.
AARCH64_TARGETS = {"scalar": [], "neon": ["-march=armv8-a"], "neon_bf16": ["-march=armv8.2-a+bf16"]}
AARCH64_TARGET_IDS = {"scalar": 0, "neon": 4, "neon_bf16": 5}
for _bits in (128, 256, 512):
    AARCH64_TARGETS[f"sve{_bits}"] = ["-march=armv8.2-a+sve", f"-msve-vector-bits={_bits}"]
    AARCH64_TARGETS[f"sve{_bits}_bf16"] = ["-march=armv8.2-a+sve+bf16", f"-msve-vector-bits={_bits}"]
    AARCH64_TARGET_IDS.update({f"sve{_bits}": 6, f"sve{_bits}_bf16": 7})
IS_AARCH64 = platform.machine().lower() in ("aarch64", "arm64")


class BuildPerIsa(build_ext):
    """Compiles the kernel source once per ISA target, then links the module."""

    def build_extension(self, ext):
        if IS_X86:
            targets, ids = X86_TARGETS, TARGET_IDS
        elif IS_AARCH64:
            targets, ids = AARCH64_TARGETS, AARCH64_TARGET_IDS
        else:
            targets, ids = {"scalar": []}, TARGET_IDS
        objects = []
        for name, flags in targets.items():
            objects += self.compiler.compile(
                ["csrc/kernels/isa_target.cpp"],
                output_dir=os.path.join(self.build_temp, "isa_" + name),
                macros=[("CPU_OFFLOAD_TARGET", str(ids[name]))],
                extra_postargs=COMMON_FLAGS + flags,
            )
        ext.extra_objects = objects
        # NOTE: imported here, not at the top: making the sdist needs no pybind11.
        import pybind11

        ext.include_dirs.append(pybind11.get_include())
        super().build_extension(ext)


setup(
    ext_modules=[
        Extension(
            "cpu_offload._C",
            sources=["csrc/bindings.cpp", "csrc/dispatch.cpp", "csrc/pool.cpp", "csrc/batch.cpp", "csrc/ops.cpp",
                     "csrc/scalars.cpp", "csrc/validation_cache.cpp"],
            extra_compile_args=COMMON_FLAGS,
            extra_link_args=["-pthread"],
            language="c++",
        )
    ],
    cmdclass={"build_ext": BuildPerIsa},
)
