"""Everything is in pyproject.toml except the optional C extension: router.policy._fastnet (the routing network's
forward pass for one decision, router/policy/fastnet.py). Without a C compiler the build skips it and the
router serves the learned policy with onnxruntime alone."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "router.policy._fastnet",
            ["router/policy/_fastnet.c"],
            extra_compile_args=["-O3", "-std=gnu11", "-fno-math-errno", "-fno-trapping-math", "-Wno-psabi"],
            libraries=["m"],
            optional=True,
        )
    ]
)
