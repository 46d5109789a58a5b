"""DESIGN.md's boundaries, checked: only the transport imports redis; the scheduler, detokenizer,
tokenizer and gateway never import jax; the pure cores load without either."""

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("gateway", "tokenizer_svc", "scheduler_svc", "worker_svc", "detokenizer_svc", "jaxstream")


def imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    names |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module and node.level == 0}
    return {name.split(".")[0] for name in names}


def sources():
    for package in PACKAGES:
        yield from (ROOT / package).rglob("*.py")


def test_only_the_transport_imports_redis():
    importers = {str(p.relative_to(ROOT)) for p in sources() if "redis" in imports(p)}
    assert importers == {"jaxstream/transport.py"}


def test_nothing_pickles():
    assert not [str(p.relative_to(ROOT)) for p in sources() if imports(p) & {"pickle", "cloudpickle", "dill"}]


def test_no_jax_outside_the_worker():
    for path in sources():
        if path.parts[len(ROOT.parts)] != "worker_svc":
            assert not imports(path) & {"jax", "flax"}, path


def test_pure_cores_load_without_jax_or_redis():
    code = ("import sys, scheduler_svc.core, scheduler_svc.pages, scheduler_svc.radix, detokenizer_svc.request, "
            "tokenizer_svc.preprocess, jaxstream.protocol, jaxstream.stopping; "
            "loaded = {m.split('.')[0] for m in sys.modules}; "
            "assert not loaded & {'jax', 'redis', 'asyncio'}, loaded & {'jax', 'redis', 'asyncio'}")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)
