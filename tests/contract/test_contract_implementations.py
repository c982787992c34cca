"""CONTRACT.md's appendix (where each section is implemented): every section has a row naming at least one test,
and every `file::function` the table names exists: for a .py file a function or class defined in it (`Class.method`:
a method of that class), found by its syntax tree; for a .cpp/.cu/.cuh file the name followed by `(` (a definition or
a kernel), found by text; a bare path is a file that exists. Library paths are relative to src/fused_logp/, tests/
and tools/ paths to the repository root."""
import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CONTRACT = ROOT / "CONTRACT.md"
LIBRARY = ROOT / "src" / "fused_logp"
APPENDIX = "## Appendix: where each section is implemented"


def _rows() -> list[list[str]]:
    text = CONTRACT.read_text()
    assert APPENDIX in text, f"CONTRACT.md has no section {APPENDIX!r}"
    table = [line for line in text.split(APPENDIX, 1)[1].splitlines() if line.startswith("|")]
    header, rule, *rows = table
    assert [c.strip() for c in header.strip("|").split("|")] == [
        "section", "numpy and host Python", "C++ oracle", "SM90 CUDA", "torch (device program)", "tests"]
    assert set(rule.replace("|", "")) == {"-"}
    return [[c.strip() for c in row.strip().strip("|").split("|")] for row in rows]


def _names(cell: str) -> list[str]:
    return re.findall(r"`([^`]+)`", cell)


def _path(name: str) -> Path:
    rel = name.split("::", 1)[0]
    return ROOT / rel if rel.startswith(("tests/", "tools/")) else LIBRARY / rel


def _py_defines(path: Path, dotted: str) -> bool:
    scope = ast.parse(path.read_text(), str(path)).body
    for part in dotted.split("."):
        found = next((n for n in scope if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                      and n.name == part), None)
        if found is None:
            return False
        scope = found.body
    return True


def _defines(path: Path, name: str) -> bool:
    if path.suffix == ".py":
        return _py_defines(path, name)
    assert path.suffix in (".cpp", ".cu", ".cuh", ".h"), path
    return re.search(rf"\b{re.escape(name)}\s*\(", path.read_text()) is not None


def test_every_section_has_a_row_with_a_test():
    text = CONTRACT.read_text().split(APPENDIX, 1)[0]
    sections = re.findall(r"^## (\d+)\. ", text, flags=re.M) + re.findall(r"^### (\d+\.\d+) ", text, flags=re.M)
    rows = _rows()
    named = [row[0].split(" ", 1)[0].rstrip(".") for row in rows]
    assert set(sections) <= set(named), f"sections without a row: {sorted(set(sections) - set(named))}"
    for row in rows:
        assert len(row) == 6, row
        assert [n for n in _names(row[5]) if n.startswith("tests/")], f"row {row[0]!r} names no test"


def test_every_named_implementation_and_test_exists():
    missing = []
    for row in _rows():
        for cell in row[1:]:
            for name in _names(cell):
                path = _path(name)
                if not path.is_file():
                    missing.append(f"{row[0]}: {name} (no file {path.relative_to(ROOT)})")
                elif "::" in name and not _defines(path, name.split("::", 1)[1]):
                    missing.append(f"{row[0]}: {name} (not defined in {path.relative_to(ROOT)})")
    assert not missing, "CONTRACT.md's implementations table names what does not exist:\n" + "\n".join(missing)
