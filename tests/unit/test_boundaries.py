"""docs/design.md's boundaries, checked: the foundation (`jaxstream/`) imports no service and no service
imports another, so each can be replaced or run alone; the contract (every file of
`jaxstream/protocol/`) imports only msgspec, the standard library and itself; only the transport's
client imports redis; only the worker's collective receiver imports torch (an optional extra); the
scheduler, detokenizer, tokenizer and gateway never import jax; the pure cores, and the trainer's
client (`jaxstream.rl`), load without either.

Imports are read from the source (`ast`), at any depth: an import inside a function counts too."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SERVICES = ("gateway", "tokenizer_svc", "scheduler_svc", "worker_svc", "detokenizer_svc")
PACKAGES = (*SERVICES, "jaxstream", "stack")


def import_statements(path: Path) -> list[tuple[int, str, str]]:
    """(line, module, the statement) per module imported; a relative import's module is ""."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            modules = [node.module if node.level == 0 else ""]
        else:
            continue
        found += [(node.lineno, module, ast.unparse(node)) for module in modules]
    return found


def package(module: str) -> str:
    return module.split(".")[0]


def imports(path: Path) -> set[str]:
    return {package(module) for _, module, _ in import_statements(path) if module}


def offending(paths, allowed) -> str:
    """Each import of a module `allowed` refuses, as `file:line: statement`, one per line."""
    return "\n".join(f"{path.relative_to(ROOT)}:{line}: {statement}" for path in paths
                     for line, module, statement in import_statements(path) if not allowed(module))


def sources():
    for package in PACKAGES:
        yield from (ROOT / package).rglob("*.py")


def test_the_foundation_imports_no_service():
    refused = {*SERVICES, "stack"}
    found = offending((ROOT / "jaxstream").rglob("*.py"), lambda module: package(module) not in refused)
    assert not found, f"jaxstream/ is imported by every service and must import none of them:\n{found}"


def test_no_service_imports_another():
    for service in SERVICES:
        refused = {*SERVICES, "stack"} - {service}
        found = offending((ROOT / service).rglob("*.py"), lambda module: package(module) not in refused)
        assert not found, f"{service} imports another service (only jaxstream/ is shared):\n{found}"


def test_the_contract_imports_only_msgspec_and_the_standard_library():
    allowed = sys.stdlib_module_names | {"__future__", "msgspec"}
    files = sorted((ROOT / "jaxstream" / "protocol").rglob("*.py"))
    assert len(files) > 1
    found = offending(files, lambda module: package(module) in allowed or module.startswith("jaxstream.protocol."))
    assert not found, f"the contract imports more than msgspec, the standard library and itself:\n{found}"


def test_only_the_transport_imports_redis():
    importers = {str(p.relative_to(ROOT)) for p in sources() if "redis" in imports(p)}
    assert importers == {"jaxstream/transport/client.py"}


def test_only_the_collective_receiver_imports_torch():
    """torch is `jaxstream[rl]`, for collective weight sync alone: worker_svc/control.py imports the
    receiver inside a function, when a group is first joined, never as the module loads."""
    importers = {str(p.relative_to(ROOT)) for p in sources() if "torch" in imports(p)}
    assert importers == {"worker_svc/collective.py"}
    control = ast.parse((ROOT / "worker_svc" / "control.py").read_text())
    at_load = {node.module for node in control.body if isinstance(node, ast.ImportFrom)}
    anywhere = {module for _, module, _ in import_statements(ROOT / "worker_svc" / "control.py")}
    assert "worker_svc.collective" in anywhere - at_load


def test_nothing_pickles():
    assert not [str(p.relative_to(ROOT)) for p in sources() if imports(p) & {"pickle", "cloudpickle", "dill"}]


def test_no_jax_outside_the_worker():
    for path in sources():
        if path.parts[len(ROOT.parts)] != "worker_svc":
            assert not imports(path) & {"jax", "flax"}, path


def test_pure_cores_load_without_jax_or_redis():
    code = ("import sys, scheduler_svc.core, scheduler_svc.pages, scheduler_svc.radix, detokenizer_svc.request, "
            "tokenizer_svc.preprocess, jaxstream.protocol, jaxstream.stopping, jaxstream.safetensors, jaxstream.rl; "
            "loaded = {m.split('.')[0] for m in sys.modules}; "
            "assert not loaded & {'jax', 'redis', 'asyncio'}, loaded & {'jax', 'redis', 'asyncio'}")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)


@pytest.mark.parametrize("package", ["cpu_kernels", "pallas_kernels"])
def test_the_kernels_are_reached_only_through_their_seam(package):
    """worker_svc/cpu_kernels/ and pallas_kernels/ are built and injected at start-up
    (worker_svc/start.py) as one `Kernels` value in Numerics: no layer, model or engine module
    imports a kernel module."""
    kernels = ROOT / "worker_svc" / package
    importers = {str(p.relative_to(ROOT)) for p in (ROOT / "worker_svc").rglob("*.py")
                 if kernels not in p.parents
                 and any(package in statement for _, _, statement in import_statements(p))}
    assert importers == {"worker_svc/start.py"}
