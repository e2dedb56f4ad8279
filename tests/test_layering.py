"""The arrows, for every package, with no exemptions:

    trainer ──► simulator ──► router.policy ◄── router (the service)
                  ▲               ▲
    fleet ────────┴───────────────┘

router.policy is pure (no aiohttp, prometheus_client, torch, asyncio); simulator is a library without the
service dependencies; fleet (live tools) may use aiohttp and prometheus but never torch; router never imports
torch, simulator, trainer or fleet; only trainer imports torch, and ray only lazily (`--ray`). And no module imports itself through others.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("router", "simulator", "fleet", "trainer")
NAMESPACE = "routewise_vllm"  # the import name of each folder: routewise_vllm.router is router/

BLOCKER = """
import sys
class _Block:
    def find_spec(self, name, path=None, target=None):
        if name.removeprefix('routewise_vllm.').split('.')[0] in {blocked!r}:
            raise ImportError(f'{{name}} is blocked by the layering test')
        return None
sys.meta_path.insert(0, _Block())
import importlib
for mod in {modules!r}:
    importlib.import_module(mod)
print('ok')
"""


def _import_with_blocked(modules: list[str], blocked: set[str]) -> subprocess.CompletedProcess:
    code = BLOCKER.format(blocked=blocked, modules=modules)
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)


def _package_modules(package: str) -> list[str]:
    return sorted(
        NAMESPACE + "." + ".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        for p in (ROOT / package).rglob("*.py")
        if p.name != "__main__.py"  # running it is the command itself
    )


def _module_name(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING"
    )


def _imports(path: Path) -> set[str]:
    """Every module `path` imports at run time (function-level imports too; TYPE_CHECKING blocks excluded)."""
    package = _module_name(path) if path.name == "__init__.py" else _module_name(path).rpartition(".")[0]
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{a.name}" for a in node.names)  # `from pkg import module`
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text(), filename=str(path)))
    return {m.removeprefix(NAMESPACE + ".") for m in found}  # named as the folders are


def _project_files() -> dict[str, Path]:
    return {_module_name(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}


def _roots(path: Path) -> set[str]:
    return {m.split(".")[0] for m in _imports(path)}


# ---------------------------------------------------------------- what each package may import at run time


@pytest.mark.parametrize(
    ("package", "blocked"),
    [
        ("router/policy", {"aiohttp", "prometheus_client", "torch", "asyncio", "simulator", "trainer", "fleet", "ray"}),
        ("router", {"torch", "simulator", "trainer", "fleet", "ray"}),
        ("simulator", {"aiohttp", "prometheus_client", "torch", "trainer", "fleet", "ray"}),
        ("fleet", {"torch", "trainer", "ray"}),
        ("trainer", {"aiohttp", "prometheus_client", "fleet", "ray"}),  # ray only inside functions, when --ray asks
    ],
)
def test_every_module_of_a_package_imports_without_what_it_must_not_use(package: str, blocked: set[str]):
    res = _import_with_blocked(_package_modules(package), blocked)
    assert res.returncode == 0, res.stderr


# ---------------------------------------------------------------- the same arrows, read from the source


ALLOWED_ROUTER_PARTS = {
    # package: which parts of router it may import (None: any)
    "router": None,
    "simulator": ("router.policy",),
    "fleet": ("router.policy",),
    "trainer": ("router.policy",),
}
FORBIDDEN_ROOTS = {
    "router": {"torch", "simulator", "trainer", "fleet", "ray"},
    "simulator": {"torch", "trainer", "fleet", "aiohttp", "prometheus_client", "ray"},
    "fleet": {"torch", "trainer", "ray"},
    "trainer": {"fleet", "aiohttp", "prometheus_client"},
}


def test_source_imports_follow_the_arrows():
    bad = {}
    for name, path in _project_files().items():
        package = name.split(".")[0]
        for mod in _imports(path):
            root = mod.split(".")[0]
            allowed = ALLOWED_ROUTER_PARTS[package]
            if root in FORBIDDEN_ROOTS[package]:
                bad.setdefault(name, []).append(mod)
            elif root == "router" and allowed and mod != "router" and not mod.startswith(allowed):
                bad.setdefault(name, []).append(mod)
            if name.startswith("router.policy") and root in {"aiohttp", "prometheus_client", "torch", "asyncio"}:
                bad.setdefault(name, []).append(mod)
            if name.startswith("router.policy") and mod.startswith("router.") and not mod.startswith("router.policy"):
                bad.setdefault(name, []).append(mod)
    assert bad == {}


def test_no_import_cycle():
    files = _project_files()
    graph = {name: sorted(m for m in _imports(path) if m in files and m != name) for name, path in files.items()}
    # A submodule's own package __init__ runs first but is not an arrow of the submodule's design.
    graph = {n: [m for m in deps if not n.startswith(m + ".")] for n, deps in graph.items()}
    state: dict[str, int] = {}  # 1 = on the stack, 2 = done
    stack: list[str] = []
    cycles: list[list[str]] = []

    def dfs(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for dep in graph[node]:
            if state.get(dep) == 1:
                cycles.append(stack[stack.index(dep) :] + [dep])
            elif dep not in state:
                dfs(dep)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            dfs(node)
    assert cycles == []


def test_the_cycle_check_sees_a_cycle(tmp_path, monkeypatch):
    """The detector itself: two modules importing each other inside functions are a cycle."""
    pkg = tmp_path / "simulator"
    pkg.mkdir()
    (pkg / "a.py").write_text("def f():\n    from routewise_vllm.simulator.b import g\n")
    (pkg / "b.py").write_text("from routewise_vllm.simulator import a\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    monkeypatch.setattr(sys.modules[__name__], "PACKAGES", ("simulator",))
    with pytest.raises(AssertionError):
        test_no_import_cycle()
