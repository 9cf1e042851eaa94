"""The one compiled part of the package: tcq's integer synthesis kernel
(cachegen/codec/tcq/synthesis.c and the loops it includes, loaded through ctypes by
cachegen.codec.tcq.int_synthesis). Optional: without a C compiler the package installs without it
and tcq decodes with the float32 product.
Everything else about the package is in pyproject.toml."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "cachegen.codec.tcq._synthesis",
            sources=["cachegen/codec/tcq/synthesis.c"],
            depends=["cachegen/codec/tcq/synthesis_loops.h"],
            # no contraction: the kernel fuses the multiply-adds it means to (the rotary turn)
            extra_compile_args=["-O3", "-ffp-contract=off"],
            optional=True,
        )
    ]
)
