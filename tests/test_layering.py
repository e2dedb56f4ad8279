"""The arrows: router.policy and simulator import with aiohttp, prometheus_client and torch
made unimportable; router (the service) never imports torch, simulator or trainer."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

BLOCKER = """
import sys
class _Block:
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in {blocked!r}:
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
        ".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        for p in (ROOT / package).rglob("*.py")
    )


def test_policy_core_is_pure():
    modules = [m for m in _package_modules("router/policy")]
    res = _import_with_blocked(modules, {"aiohttp", "prometheus_client", "torch", "asyncio", "simulator", "trainer"})
    assert res.returncode == 0, res.stderr


def test_simulator_core_imports_without_service_deps():
    modules = [m for m in _package_modules("simulator") if m != "simulator.__main__"]
    res = _import_with_blocked(modules, {"aiohttp", "prometheus_client", "torch", "trainer"})
    assert res.returncode == 0, res.stderr


def _imported_roots(path: Path) -> set[str]:
    roots: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            roots.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            roots.add(node.module.split(".")[0])
    return roots


def test_router_never_imports_torch_simulator_or_trainer():
    offenders = {
        str(p.relative_to(ROOT)): sorted(_imported_roots(p) & {"torch", "simulator", "trainer"})
        for p in (ROOT / "router").rglob("*.py")
    }
    assert {k: v for k, v in offenders.items() if v} == {}


def test_simulator_imports_only_the_policy_core_of_router():
    bad = {}
    for p in (ROOT / "simulator").rglob("*.py"):
        tree = ast.parse(p.read_text())
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            for n in names:
                if n == "trainer" or n.startswith("trainer.") or n.split(".")[0] == "torch":
                    bad[str(p)] = n
                if n.startswith("router") and not n.startswith("router.policy"):
                    bad[str(p)] = n
    assert bad == {}
