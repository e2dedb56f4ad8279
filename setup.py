"""Everything is in pyproject.toml except the optional C extension: router.policy._fastnet (the routing network's
forward pass for one decision, router/policy/fastnet.py; the views and feature rows, router/policy/tracking.py and
features.py). Its sources are router/policy/fastnet_c/*.c (fastnet.h lists them). Without a C compiler the build
skips it and the router serves the learned policy with onnxruntime alone."""

from glob import glob

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "router.policy._fastnet",
            sorted(glob("router/policy/fastnet_c/*.c")),  # paths relative to this folder, as setuptools wants them
            depends=["router/policy/fastnet_c/fastnet.h"],
            extra_compile_args=["-O3", "-std=gnu11", "-fno-math-errno", "-fno-trapping-math", "-Wno-psabi",
                                "-fvisibility=hidden"],
            libraries=["m"],
            optional=True,
        )
    ]
)
