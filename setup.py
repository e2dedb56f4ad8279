"""Everything is in pyproject.toml except the optional C extensions. Without a C compiler the build skips them and
the router runs their Python references:
- router.policy._fastnet: the routing network's forward pass for one decision (router/policy/fastnet.py), the
  views and feature rows (router/policy/tracking.py and features.py), the prompt's prefix-block hashes
  (router/policy/estimate.py); sources router/policy/fastnet_c/*.c (fastnet.h lists them); without it the learned
  policy is served by onnxruntime alone;
- router._fasthttp: the lean listener's request heads (router/lean.py), the lean client's response heads and chunked
  bodies (router/h1client.py), each the common case beside the Python that defines every case; sources
  router/fasthttp_c/*.c (fasthttp.h lists them)."""

from glob import glob

from setuptools import Extension, setup

FLAGS = ["-O3", "-std=gnu11", "-fno-math-errno", "-fno-trapping-math", "-Wno-psabi", "-fvisibility=hidden"]

setup(
    ext_modules=[
        Extension(
            "router.policy._fastnet",
            sorted(glob("router/policy/fastnet_c/*.c")),  # paths relative to this folder, as setuptools wants them
            depends=["router/policy/fastnet_c/fastnet.h"],
            extra_compile_args=FLAGS,
            libraries=["m"],
            optional=True,
        ),
        Extension("router._fasthttp", sorted(glob("router/fasthttp_c/*.c")), depends=["router/fasthttp_c/fasthttp.h"],
                  extra_compile_args=FLAGS, optional=True),
    ]
)
