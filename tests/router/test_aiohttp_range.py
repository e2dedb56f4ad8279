"""The aiohttp the router runs on: the installed version within pyproject's declared range, and aiohttp used
through its public interface only (router/http: no private module, no private member read or overridden), so a
version inside the range cannot change what the listener relies on without a public change.

The range's lowest version is checked by running the listener's tests under it, beside this checkout's venv:
    python -m venv /tmp/aio-min && /tmp/aio-min/bin/pip install aiohttp==3.13.4
    echo "import site; site.addsitedir('$PWD/.venv/lib/python3.11/site-packages')" \
        > /tmp/aio-min/lib/python3.11/site-packages/zz_checkout.pth
    /tmp/aio-min/bin/python -m pytest tests/router/test_lean.py tests/router/test_connection_limits.py \
        tests/router/test_aiohttp_range.py tests/router/test_fuzz.py
(3.13.3 and older let a pipelined head through with any number of header lines: no 431 for it.)"""

from __future__ import annotations

import ast
import importlib
import tomllib
from importlib.metadata import version
from pathlib import Path

from aiohttp import web
from packaging.requirements import Requirement
from packaging.version import Version

from routewise_vllm.router.http.guarded import GuardedHandler
from routewise_vllm.router.http.listener import RouterRunner

ROOT = Path(__file__).resolve().parents[2]
HTTP = ROOT / "router" / "http"
AIOHTTP_SERVER_SIDE = ("listener.py", "guarded.py", "server.py", "transport.py", "framing.py", "connections.py")
PUBLIC_MODULES = {"aiohttp", "aiohttp.web", "aiohttp.http"}  # names from them: only what their __all__ exports


def declared_range():
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    found = [r for r in map(Requirement, deps) if r.name == "aiohttp"]
    assert len(found) == 1, f"pyproject.toml declares aiohttp {len(found)} times"
    return found[0].specifier


def test_the_installed_aiohttp_is_within_the_declared_range():
    spec = declared_range()
    assert any(s.operator in (">=", "~=") for s in spec), f"aiohttp{spec}: no lowest version"
    assert Version("4.0") not in spec, f"aiohttp{spec}: a major version the router was never run on is allowed"
    installed = version("aiohttp")
    assert Version(installed) in spec, f"aiohttp {installed} is installed, outside the declared aiohttp{spec}"


def _private_members(cls: type) -> set[str]:
    return {n for klass in cls.__mro__ for n in vars(klass)
            if n.startswith("_") and not n.startswith("__") and n != "_abc_impl"}  # _abc_impl: every ABC's own


def test_the_listener_overrides_no_private_aiohttp_member():
    for ours, theirs in ((GuardedHandler, web.RequestHandler), (RouterRunner, web.AppRunner)):
        clash = _private_members(theirs) & set(vars(ours))
        assert not clash, f"{ours.__name__} overrides or shadows aiohttp's private {sorted(clash)}"


def test_the_server_side_reads_no_private_aiohttp_name():
    """No aiohttp module whose name is private by aiohttp's docs (web_protocol, web_runner, ...); in a class built on
    one of aiohttp's, no `self._x` the class does not define itself; anywhere, no `obj._x` that no class of the
    module defines (the router's own objects only)."""
    for name in AIOHTTP_SERVER_SIDE:
        tree = ast.parse((HTTP / name).read_text())
        module_own = set().union(*(_defined_here(c) for c in ast.walk(tree) if isinstance(c, ast.ClassDef)))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    assert alias.name.split(".")[0] != "aiohttp" or alias.name in PUBLIC_MODULES, (name, alias.name)
            elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "aiohttp":
                assert node.module in PUBLIC_MODULES, f"{name} imports from {node.module}"
                exported = importlib.import_module(node.module).__all__
                for alias in node.names:
                    assert f"{node.module}.{alias.name}" in PUBLIC_MODULES or alias.name in exported, \
                        f"{name} imports {alias.name} from {node.module}, which does not export it"
            elif isinstance(node, ast.ClassDef) and any("web." in ast.unparse(b) for b in node.bases):
                own = _defined_here(node)
                for attr in _private_reads(node):
                    assert _on_self(attr) and attr.attr in own, \
                        f"{name}: {node.name} reads {ast.unparse(attr)}, not a member of its own"
        for attr in _private_reads(tree):
            assert _on_self(attr) or attr.attr in module_own, f"{name}: reads {ast.unparse(attr)}"


def _private_reads(tree: ast.AST) -> list[ast.Attribute]:
    return [a for a in ast.walk(tree) if isinstance(a, ast.Attribute) and a.attr.startswith("_")
            and not a.attr.startswith("__")]


def _on_self(attr: ast.Attribute) -> bool:
    return isinstance(attr.value, ast.Name) and attr.value.id == "self"


def _defined_here(cls: ast.ClassDef) -> set[str]:
    own: set[str] = set()
    for node in ast.walk(cls):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            own.add(node.name)
        elif isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__slots__" for t in node.targets):
            own.update(ast.literal_eval(node.value))
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for t in node.targets if isinstance(node, ast.Assign) else [node.target]:
                for el in ast.walk(t):
                    if isinstance(el, ast.Attribute) and isinstance(el.value, ast.Name) and el.value.id == "self":
                        own.add(el.attr)
    return own
