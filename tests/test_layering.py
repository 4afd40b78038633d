"""The package's layering (docs/architecture.md): no import circle, a torch-free options module on the ground
floor, no module over 400 lines. Read from the source with ``ast``; nothing is imported."""

from __future__ import annotations

import ast
from pathlib import Path

import hybridserve

PACKAGE = Path(hybridserve.__file__).parent
MAX_LINES = 400

#: circles and long modules of the parts of issue 34 done in other branches (the engine split, the family
#: records): remove an entry once its part is merged
CIRCLES_IN_FLIGHT: set[str] = set()
LONG_IN_FLIGHT: set[str] = set()

#: the floors of docs/architecture.md, lowest first: a module may import its own floor and those below; the
#: longest prefix (a module path under ``hybridserve.``) decides a module's floor
FLOORS = [
    ["hybridserve", "options", "sampling_params", "outputs", "default_model", "structured_output.params",
     "spec_decode.config", "cache.dtypes", "cache.salt", "tool_parsers", "reasoning"],
    ["kernels", "ops", "forward_batch", "cache.spec", "cache.capacity", "cache.layout",
     "cache.id_set", "cache.handle_map", "cache.pool", "cache.slots", "cache.state_codec", "structured_output.limits"],
    ["config", "generation_config", "cache"],
    ["layers", "distributed", "distributed.group", "distributed.layers"],
    ["models", "distributed.sharding", "distributed.sharder", "distributed.shard_attention",
     "distributed.shard_dense", "distributed.shard_recurrent"],
    ["planning", "structured_output"],
    ["engine", "spec_decode", "distributed.driver", "distributed.launch", "distributed.worker"],
    ["entrypoints", "distributed.preload", "evaluation"],
]
MAX_UPWARD_IMPORTS = 6


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def top_level_imports(tree: ast.Module, name: str, is_package: bool, modules: set[str]) -> set[str]:
    """The hybridserve modules a module imports outside functions (``if TYPE_CHECKING:`` blocks included)."""
    found: set[str] = set()
    pending: list[ast.stmt] = list(tree.body)
    while pending:
        node = pending.pop()
        if isinstance(node, (ast.If, ast.Try)):
            pending += node.body + node.orelse + getattr(node, "finalbody", []) + [
                stmt for handler in getattr(node, "handlers", []) for stmt in handler.body]
        elif isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".") if is_package else name.split(".")[:-1]
                anchor = anchor[:len(anchor) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            found.add(base)
            found |= {f"{base}.{alias.name}" for alias in node.names}
    return {m for m in found if m in modules and m != name}


def import_graph() -> dict[str, set[str]]:
    paths = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    modules = set(paths)
    return {name: top_level_imports(ast.parse(path.read_text()), name, path.name == "__init__.py", modules)
            for name, path in paths.items()}


def circles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[set[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            child = next(edges, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = set()
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.add(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(component)
            elif child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(graph[child]))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return found


def test_the_circle_finder_finds_a_circle():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [{"a", "b", "c"}]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_no_import_circle_outside_the_parts_in_flight():
    graph = import_graph()
    assert "hybridserve.cache.manager" in graph["hybridserve.engine.scheduler"]  # the graph is read at all
    bad = [sorted(c) for c in circles(graph) if not c <= CIRCLES_IN_FLIGHT]
    assert bad == []


def floor_of(module: str) -> int:
    """The floor of a module (its longest matching prefix in FLOORS); ValueError if none matches."""
    name = module.removeprefix("hybridserve.") if module != "hybridserve" else module
    matches = [(len(prefix), floor) for floor, prefixes in enumerate(FLOORS) for prefix in prefixes
               if name == prefix or name.startswith(prefix + ".")]
    if not matches:
        raise ValueError(f"{module} is on no floor: add it to FLOORS (and docs/architecture.md)")
    return max(matches)[1]


def test_at_most_six_imports_run_up_the_floors():
    graph = import_graph()
    upward = sorted(f"{a} -> {b}" for a, imported in graph.items() for b in imported if floor_of(b) > floor_of(a))
    assert len(upward) <= MAX_UPWARD_IMPORTS, upward
    assert floor_of("hybridserve.engine.scheduler") > floor_of("hybridserve.cache.manager") > floor_of(
        "hybridserve.options")


def test_the_options_module_is_on_the_ground_floor():
    tree = ast.parse((PACKAGE / "options.py").read_text())
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    imported |= {node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert not {m for m in imported if m.split(".")[0] in ("hybridserve", "torch", "numpy")}, imported


def test_cache_and_limits_take_their_options_from_below_the_config():
    graph = import_graph()
    for name in ("hybridserve.cache.spec", "hybridserve.planning.plan_config", "hybridserve.cache.prefix_cache",
                 "hybridserve.structured_output.limits"):
        assert "hybridserve.config" not in graph[name], name
    assert "hybridserve.cache.manager" not in graph["hybridserve.cache.prefix_cache"]


def test_no_module_over_400_lines():
    long = {str(p.relative_to(PACKAGE)): n for p in PACKAGE.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert set(long) <= LONG_IN_FLIGHT, long


#: the fast/plain choice lives in ``ops/dispatch.py``: a layer calls an op entry and never reads a flag
KERNEL_FLAG = "use_cpu_kernels"
MAX_KERNEL_FLAG_MENTIONS = 0  # issue 34 allows 10; none are left
KERNEL_FLAG_HOMES = ("ops", "kernels", "config.py")


def test_the_kernel_choice_is_not_restated_in_the_layers():
    mentions = {str(path.relative_to(PACKAGE)): n for path in PACKAGE.rglob("*.py")
                if path.relative_to(PACKAGE).parts[0] not in KERNEL_FLAG_HOMES
                and (n := path.read_text().count(KERNEL_FLAG))}
    assert sum(mentions.values()) <= MAX_KERNEL_FLAG_MENTIONS, (
        f"{KERNEL_FLAG} mentioned outside ops/, kernels/ and the config: {mentions}; call an op entry "
        "(hybridserve/ops, chosen in ops/dispatch.py) instead")


def registered_architectures() -> list[str]:
    """The architecture names of ``models/registry.py``'s records (the first argument of ``ModelFamily(...)``)."""
    tree = ast.parse((PACKAGE / "models" / "registry.py").read_text())
    return [node.args[0].value for node in ast.walk(tree)
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "ModelFamily"
            and node.args and isinstance(node.args[0], ast.Constant)]


def test_each_architecture_is_named_in_its_model_file_and_the_registry_only():
    names = registered_architectures()
    assert "MambaForCausalLM" in names and len(names) >= 20  # the registry is read at all
    texts = {str(path.relative_to(PACKAGE)): path.read_text() for path in PACKAGE.rglob("*.py")}
    spread = {name: files for name in names if len(files := sorted(p for p, t in texts.items() if name in t)) > 2}
    assert spread == {}, ("an architecture class is named outside its model file and models/registry.py (import "
                          f"a base class under a family name instead): {spread}")


#: layers/ and models/ call op entries (hybridserve/ops) and never import kernels/ themselves; the modules that
#: still do, each with its reason (remove an entry once its module no longer imports kernels/)
KERNEL_IMPORTERS_ALLOWED = {
    "layers.moe": "its kernel is being changed in another branch; its op entry comes after",
    "layers.packed_linear": "it packs weights into the kernels' own formats (a layer that owns a kernel layout)",
    "layers.linear_w8": "the int8 linear's weight format is the kernel's (packed with layers.packed_linear)",
    "layers.linear_w4": "the 4-bit linear's weight format is the kernel's (packed by its constructors)",
    "layers.linear_w6k": "the Q6_K linear's weight format is the kernel's (packed by its constructor)",
    "layers.mlp": "not yet moved to an op entry (issue 34 part 4)",
    "layers.norms": "not yet moved to an op entry (issue 34 part 4)",
    "layers.rotary": "not yet moved to an op entry (issue 34 part 4)",
    "layers.embedding": "not yet moved to an op entry (issue 34 part 4)",
    "models.minimax": "its router's two bodies are not yet an op entry (issue 34 part 4)",
    "models.nemotron_h": "its router's two bodies are not yet an op entry (issue 34 part 4)",
    "models.jamba": "its router's two bodies are not yet an op entry (issue 34 part 4)",
    "models.qwen3_next": "its MoE block's two bodies are not yet an op entry (issue 34 part 4)",
    "models.granitemoehybrid": "its router's two bodies are not yet an op entry (issue 34 part 4)",
    "models.lfm2_moe": "its router's two bodies are not yet an op entry (issue 34 part 4)",
}


def kernel_importers(packages: tuple[str, ...] = ("layers", "models")) -> set[str]:
    """The modules of ``packages`` that import ``hybridserve.kernels`` anywhere (in functions too)."""
    found = set()
    for package in packages:
        for path in (PACKAGE / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                names = ([alias.name for alias in node.names] if isinstance(node, ast.Import)
                         else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
                if any(n == "hybridserve.kernels" or n.startswith("hybridserve.kernels.") for n in names) or (
                        isinstance(node, ast.ImportFrom) and node.level and (node.module or "").startswith("kernels")):
                    found.add(module_name(path).removeprefix("hybridserve."))
    return found


def test_layers_and_models_reach_the_kernels_through_op_entries_only():
    importers = kernel_importers()
    assert "layers.moe" in importers  # the imports are read at all
    assert importers <= set(KERNEL_IMPORTERS_ALLOWED), (
        f"{sorted(importers - set(KERNEL_IMPORTERS_ALLOWED))} import hybridserve.kernels: call an op entry "
        "(hybridserve/ops, its kernel body chosen in ops/dispatch.py) instead")
    stale = set(KERNEL_IMPORTERS_ALLOWED) - importers
    assert not stale, f"{sorted(stale)} no longer import hybridserve.kernels: remove them from the list"
