"""The package layout and the optional C extensions; the rest of the metadata is in pyproject.toml.

One import namespace, routewise_vllm, mapped from the folders the repository keeps at its top:
routewise_vllm.router is router/, and so on for simulator/, trainer/ and fleet/. Every file of those folders
that is not code (models, scenarios, profiles, traces, configs, their READMEs) ships as package data, declared
once here for the whole tree, so a new folder cannot be left out of the wheel.

Without a C compiler the build skips the extensions and the router runs their Python references:
- routewise_vllm.router.policy._fastnet: the routing network's forward pass for one decision and its cross-replica
  inputs (router/policy/fastnet.py), the views and feature rows (router/policy/tracking.py and feature_binding.py),
  the prompt's prefix-block hashes (router/policy/estimate.py); sources router/policy/fastnet_c/*.c (fastnet.h lists
  them); without it the learned policy is served by onnxruntime alone;
- routewise_vllm.router.http._fasthttp: the lean listener's request heads (router/http/server.py), the lean
  client's response heads and chunked bodies (router/http/client.py), each the common case beside the Python that defines every case;
  sources router/http/fasthttp_c/*.c (fasthttp.h lists them);
- routewise_vllm.router.scale._shared: the host-wide in-flight counters the router's workers share
  (router/scale/shared.py); sources router/scale/shared_c/*.c."""

from glob import glob

from setuptools import Extension, find_packages, setup

NAMESPACE = "routewise_vllm"
FOLDERS = ("router", "simulator", "trainer", "fleet")
FLAGS = ["-O3", "-std=gnu11", "-fno-math-errno", "-fno-trapping-math", "-Wno-psabi", "-fvisibility=hidden"]
NOT_DATA = ["*.py", "*.pyc", "*.c", "*.h", "*.so", "*.pyd"]  # code, bytecode and the extensions' sources and builds

setup(
    packages=[f"{NAMESPACE}.{p}" for p in find_packages(include=[f"{f}*" for f in FOLDERS])],
    package_dir={f"{NAMESPACE}.{f}": f for f in FOLDERS},
    package_data={f"{NAMESPACE}.{f}": ["**/*"] for f in FOLDERS},
    exclude_package_data={"": [f"**/{p}" for p in NOT_DATA] + NOT_DATA},  # "": every package, sub-packages too
    ext_modules=[
        Extension(
            f"{NAMESPACE}.router.policy._fastnet",
            sorted(glob("router/policy/fastnet_c/*.c")),  # paths relative to this folder, as setuptools wants them
            depends=["router/policy/fastnet_c/fastnet.h"],
            extra_compile_args=FLAGS,
            libraries=["m"],
            optional=True,
        ),
        Extension(f"{NAMESPACE}.router.http._fasthttp", sorted(glob("router/http/fasthttp_c/*.c")),
                  depends=["router/http/fasthttp_c/fasthttp.h"], extra_compile_args=FLAGS, optional=True),
        Extension(f"{NAMESPACE}.router.scale._shared", sorted(glob("router/scale/shared_c/*.c")), extra_compile_args=FLAGS,
                  optional=True),
    ],
)
