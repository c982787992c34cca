"""The house: the source tree is the import tree, the contract layer imports nothing above it, the library never
imports the harness, only the backend registry reaches the SM90 launcher, and the documented API is importable
from `fused_logp`. Static checks over the import statements of src/ (no module is executed)."""
import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path) -> set[str]:
    """Absolute names of every module imported by `path` (relative imports resolved; `from a import b` counts as
    both a and a.b, since b may be a module)."""
    mod = _module_name(path)
    package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module
            out.add(target)
            out.update(f"{target}.{a.name}" for a in node.names)
    return out


def _modules(package: str):
    folder = SRC.joinpath(*package.split("."))
    return sorted(folder.rglob("*.py"))


def test_no_package_dir_remapping():
    text = (ROOT / "pyproject.toml").read_text()
    remap = ("package" + "-dir", "package" + "_dir")          # spelled apart: `git grep` of the key finds nothing
    assert not any(k in text for k in remap)


@pytest.mark.parametrize("path", _modules("fused_logp.shared_contract"), ids=lambda p: p.name)
def test_contract_layer_imports_nothing_above_it(path):
    above = ("fused_logp.kernel", "fused_logp.vllm_plugin", "fused_logp.megatron_plugin", "fused_logp_jobs",
             "fused_logp.golden", "fused_logp.cli", "vllm", "megatron")
    bad = sorted(m for m in _imports(path) if m.startswith(above))
    assert not bad, f"{path.relative_to(ROOT)} imports {bad}"


@pytest.mark.parametrize("path", _modules("fused_logp"), ids=lambda p: str(p.relative_to(SRC)))
def test_library_never_imports_the_harness(path):
    if path.name == "cli.py" and path.parent.name == "fused_logp":
        return                       # the command dispatches to the harness's jobs when the checkout has them
    bad = sorted(m for m in _imports(path) if m.startswith("fused_logp_jobs"))
    assert not bad, f"{path.relative_to(ROOT)} imports the harness: {bad}"


@pytest.mark.parametrize("path", _modules("fused_logp"), ids=lambda p: str(p.relative_to(SRC)))
def test_only_the_registry_reaches_the_sm90_launcher(path):
    if path.name in ("backends.py", "sm90.py"):
        return
    if path.name == "cli.py" and path.parent.name == "fused_logp":     # `fused-logp build`: the build arguments
        return
    bad = sorted(m for m in _imports(path) if m == "fused_logp.kernel.sm90")
    assert not bad, f"{path.relative_to(ROOT)} imports the SM90 launcher directly; ask kernel.backends"


def test_documented_api_importable_from_the_package():
    import fused_logp
    for name in ("linear_logp", "linear_logp_program", "TransformProgram", "logp_from_logits", "weight_fingerprint",
                 "linear_logp_tp", "shard_tile_stats", "merge_shard_stats", "CONTRACT_VERSION"):
        assert hasattr(fused_logp, name), name
    assert set(fused_logp.__all__) <= set(dir(fused_logp))


def test_wheel_ships_the_library_only():
    text = (ROOT / "pyproject.toml").read_text()
    assert 'where = ["src"]' in text and 'include = ["fused_logp", "fused_logp.*"]' in text


# ---------------------------------------------------------------------------------------------------------
# the op's rooms: request (checks), invalid_rows, execute (backend calls), autograd, op (entries)
# ---------------------------------------------------------------------------------------------------------

KERNEL = SRC / "fused_logp" / "kernel"
# Each room imports only rooms below it (lower number), never one above or beside it.
OP_ROOMS = {"results": 0, "invalid_rows": 0, "backends": 0, "request": 1, "execute": 2, "autograd": 3, "op": 4}


def _tree(name: str) -> ast.Module:
    path = KERNEL / f"{name}.py"
    return ast.parse(path.read_text(), str(path))


@pytest.mark.parametrize("room", sorted(OP_ROOMS))
def test_op_rooms_import_only_rooms_below(room):
    mine = OP_ROOMS[room]
    bad = sorted(m for m in _imports(KERNEL / f"{room}.py")
                 if m.startswith("fused_logp.kernel.") and m.split(".")[2] in OP_ROOMS
                 and m.split(".")[2] != room and OP_ROOMS[m.split(".")[2]] >= mine)
    assert not bad, f"kernel/{room}.py imports {bad}: a room imports only the rooms below it {OP_ROOMS}"


@pytest.mark.parametrize("path", _modules("fused_logp"), ids=lambda p: str(p.relative_to(SRC)))
def test_no_private_name_of_the_kernel_is_imported(path):
    """A kernel module is reached through its public names only (autograd reads backends.device_status, not a
    private status function; the adapters call exported names)."""
    mod = _module_name(path)
    bad = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not isinstance(node, ast.ImportFrom) or node.module == "__future__":
            continue
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        base = package.split(".")[:len(package.split(".")) - (node.level - 1)] if node.level else []
        target = ".".join(base + ([node.module] if node.module else [])) if node.level else node.module
        if target.startswith("fused_logp.kernel") and target != mod:
            bad += [f"{target}.{a.name}" for a in node.names if a.name.startswith("_")]
    assert not bad, f"{path.relative_to(ROOT)} imports private kernel names {bad}"


def test_public_entries_are_short_and_pass_a_request():
    """Each public entry of kernel/op.py prepares one Request and runs it: about a dozen lines, no nested function
    (no closure travels into the autograd function), no probe of the backend."""
    tree = _tree("op")
    entries = [f for f in tree.body if isinstance(f, ast.FunctionDef) and not f.name.startswith("_")]
    assert {f.name for f in entries} >= {"linear_logp", "shard_tile_stats", "merge_shard_stats", "linear_logp_tp",
                                         "logp_from_logits", "logits_and_stats", "logp_of_ids",
                                         "linear_logp_program"}
    for f in entries:
        body = f.body[1:] if isinstance(f.body[0], ast.Expr) and isinstance(f.body[0].value, ast.Constant) else f.body
        lines = body[-1].end_lineno - body[0].lineno + 1
        assert lines <= 14, f"op.{f.name}: {lines} lines after its docstring"
        assert not [n for n in ast.walk(f) if isinstance(n, (ast.FunctionDef, ast.Lambda)) and n is not f], f.name
        calls = {n.func.id for n in ast.walk(f) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
        assert "prepare" in calls, f"op.{f.name} does not prepare a request"


@pytest.mark.parametrize("room", ["op", "request", "execute", "autograd"])
def test_backends_are_read_by_declaration_not_probed(room):
    calls = sorted(n.func.id for n in ast.walk(_tree(room)) if isinstance(n, ast.Call)
                   and isinstance(n.func, ast.Name) and n.func.id in ("hasattr", "getattr"))
    assert not calls, f"kernel/{room}.py probes with {calls}; read backend.entries (backends.serves/require)"


def test_autograd_function_receives_the_request():
    tree = _tree("autograd")
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "LinearLogpFunction")
    fwd = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "forward")
    assert [a.arg for a in fwd.args.args] == ["ctx", "hidden", "weight", "bias", "request"]


def test_the_invalid_row_subsystem_lives_in_its_room():
    """The pinned mirror, the events and the per-device records: kernel/invalid_rows.py only."""
    for path in sorted(KERNEL.glob("*.py")):
        if path.name == "invalid_rows.py":
            continue
        text = path.read_text()
        assert "pin_memory" not in text and "cuda.Event" not in text, path.name


BACKEND_FILES = {"oracle.py": "OracleBackend", "oracle_fast.py": "OracleFastBackend", "sm90.py": "SM90Backend",
                 "torch_backend.py": "TorchBackend"}
INTERFACE = ("linear_logp", "stats_from_logits", "shard_stats", "merge_stats", "logits_and_stats", "merge_ids")


@pytest.mark.parametrize("file", sorted(BACKEND_FILES))
def test_backend_entries_return_no_dicts(file):
    tree = ast.parse((KERNEL / file).read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == BACKEND_FILES[file])
    for fn in cls.body:
        if isinstance(fn, ast.FunctionDef) and fn.name in INTERFACE:
            for ret in (n for n in ast.walk(fn) if isinstance(n, ast.Return) and n.value is not None):
                assert not isinstance(ret.value, (ast.Dict, ast.Tuple)), \
                    f"{file} {fn.name} returns a {type(ret.value).__name__}: return a backends result type"


def test_sm90_backend_class_holds_no_auxiliary_kernel_or_test_hook():
    """The auxiliary kernels and the test hooks are defined in kernel/sm90_aux.py (the class keeps only their
    names, as properties); kernel/sm90_aux.py reaches the extension through the backend it is given."""
    tree = ast.parse((KERNEL / "sm90.py").read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "SM90Backend")
    methods = {n.name for n in cls.body if isinstance(n, ast.FunctionDef)}
    aux = ast.parse((KERNEL / "sm90_aux.py").read_text())
    moved = {f.name for c in aux.body if isinstance(c, ast.ClassDef) for f in c.body
             if isinstance(f, ast.FunctionDef) and not f.name.startswith("_")}
    assert {"tile_stats_from_logits", "topp_crossing", "backward_dz", "fingerprint_rows"} <= moved
    assert not methods & moved, methods & moved
    assert "fused_logp.kernel.sm90" not in _imports(KERNEL / "sm90_aux.py")


# ---------------------------------------------------------------------------------------------------------
# the contract's arithmetic: shared_contract/numpy_contract.py (numpy binary32, sections 3-6 and 13) and
# shared_contract/gemm_rule.py (section 2); the backends and the program call it, none defines it again
# ---------------------------------------------------------------------------------------------------------

SHARED = SRC / "fused_logp" / "shared_contract"
# Each arithmetic room and what it may import: the contract's constants and exp2 table, numpy or torch, nothing else.
ARITHMETIC_ROOMS = {"numpy_contract": {"numpy", "fused_logp.shared_contract.constants",
                                       "fused_logp.shared_contract.ex2_table"},
                    "gemm_rule": {"torch", "fused_logp.shared_contract.constants"}}


def _defined_functions(path: Path) -> set[str]:
    return {n.name for n in ast.parse(path.read_text(), str(path)).body if isinstance(n, ast.FunctionDef)}


def _statement_modules(path: Path) -> set[str]:
    """The modules `path`'s import statements load: `import a.b` and `from a.b import c` give a.b; a relative
    `from . import c` gives the package's c."""
    package = _module_name(path).rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if not node.level:
                out.add(node.module)
                continue
            base = ".".join(package.split(".")[:len(package.split(".")) - (node.level - 1)])
            out.update([f"{base}.{node.module}"] if node.module else [f"{base}.{a.name}" for a in node.names])
    return out


@pytest.mark.parametrize("room", sorted(ARITHMETIC_ROOMS))
def test_contract_arithmetic_imports_only_constants_and_the_table(room):
    bad = sorted(_statement_modules(SHARED / f"{room}.py") - ARITHMETIC_ROOMS[room] - {"__future__"})
    assert not bad, f"shared_contract/{room}.py imports {bad}; its room takes only {sorted(ARITHMETIC_ROOMS[room])}"


def test_contract_layer_below_the_arithmetic_does_not_import_it():
    """constants, errors, config, provenance, the table, sampling and the fingerprint definition stand below the
    arithmetic rooms: none of them imports one."""
    rooms = {f"fused_logp.shared_contract.{r}" for r in ARITHMETIC_ROOMS}
    for path in _modules("fused_logp.shared_contract"):
        if path.stem in ARITHMETIC_ROOMS:
            continue
        bad = sorted(_imports(path) & rooms)
        assert not bad, f"shared_contract/{path.name} imports {bad}"


def test_contract_arithmetic_is_defined_once():
    """The arithmetic's functions are defined in its two rooms only: kernel/oracle.py is the backend around them,
    kernel/transforms.py's numpy path calls them, kernel/transcendentals.py holds the torch versions (*_torch).
    The compiled oracle's module wraps its extension's exp2 and log under the same names (they call C++); `merge`
    and `scaled` are also ordinary words (kernel/execute.py's merge runs a backend's merge entry)."""
    names = set().union(*(_defined_functions(SHARED / f"{r}.py") for r in ARITHMETIC_ROOMS))
    assert {"contract_ex2", "contract_log", "row_scale", "tile_stats", "row_lse", "selected_logp", "merge",
            "kept_set", "program_logp", "hopper_logits"} <= names
    names -= {"merge", "scaled"}
    wrappers = {"oracle_fast.py": {"contract_ex2", "contract_log"}}
    for path in _modules("fused_logp"):
        if path.parent == SHARED and path.stem in ARITHMETIC_ROOMS:
            continue
        again = (_defined_functions(path) & names) - wrappers.get(path.name, set())
        assert not again, f"{path.relative_to(SRC)} defines {sorted(again)} again: call shared_contract's"


def test_numpy_oracle_is_a_backend_only():
    tree = ast.parse((KERNEL / "oracle.py").read_text())
    classes = [n.name for n in tree.body if isinstance(n, ast.ClassDef)]
    public = sorted(n.name for n in tree.body if isinstance(n, ast.FunctionDef) and not n.name.startswith("_"))
    assert classes == ["OracleBackend"] and not public, (classes, public)
