"""The reference docs name only what exists: README.md stays a short reference (under 160 lines) and every file,
`make` target and `fused-logp` command it mentions exists; the current pages' repository paths exist; no current
file cites the archive (docs/archive); bench/results/ holds exactly the files its index lists. Static checks over
the text (nothing is run)."""
import ast
import fnmatch
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ARCHIVE = "docs/" + "archive"          # spelled apart so that this file does not cite it
README_MAX_LINES = 160

# A path in a code span, a code block or a link target: it starts at a top-level folder or is a top-level file.
_TOP = r"(?:src|docs|tests|bench|examples|configs|tools|\.ci)"
_PATH = re.compile(r"(?<![\w./-])(" + _TOP + r"/[\w./*-]*(?:\{[\w.,-]+\}[\w./*-]*)*|CONTRACT\.md|README\.md|Makefile"
                   r"|pyproject\.toml)(?![\w/-])")
_LINK = re.compile(r"\]\(([^)\s]+)\)")
_MAKE = re.compile(r"\bmake[ \t]+((?:[A-Z_]+=\S+[ \t]+)*)([a-z][\w-]*)")
_CLI = re.compile(r"\bfused-logp[ \t]+((?:(?:--config[ \t]+\S+|--debug)[ \t]+)*)([a-z][\w-]*)")   # global options


def _current_pages():
    pages = [ROOT / "README.md", ROOT / "CONTRACT.md", ROOT / "bench" / "results" / "README.md"]
    pages += sorted((ROOT / "docs").glob("*.md")) + sorted((ROOT / "docs" / "design").glob("*.md"))
    return [p for p in pages if p.exists()]


def _code(text: str) -> list:
    """The text of every fenced code block and inline code span."""
    blocks = re.findall(r"```[^\n]*\n(.*?)```", text, flags=re.S)
    rest = re.sub(r"```[^\n]*\n.*?```", "", text, flags=re.S)
    return blocks + re.findall(r"`([^`\n]+)`", rest)


def _expand(path: str) -> list:
    """bench/x.{json,log} -> [bench/x.json, bench/x.log]; no braces: [path]."""
    m = re.search(r"\{([\w.,-]+)\}", path)
    if not m:
        return [path]
    return [q for alt in m.group(1).split(",") for q in _expand(path[:m.start()] + alt + path[m.end():])]


def _exists(path: str) -> bool:
    path = path.rstrip(".")
    if any(c in path for c in "*?["):
        return any(ROOT.glob(path))
    return (ROOT / path).exists()


def _paths(text: str) -> set:
    out = set()
    for chunk in _code(text):
        for m in _PATH.finditer(chunk):
            out.update(_expand(m.group(1).rstrip(".")))
    return out


def _links(page: Path) -> set:
    out = set()
    for target in _LINK.findall(page.read_text()):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        out.add(str((page.parent / target.split("#")[0]).resolve().relative_to(ROOT)))
    return out


def _make_targets() -> set:
    targets = set()
    for line in (ROOT / "Makefile").read_text().splitlines():
        m = re.match(r"^([A-Za-z0-9_.-]+(?:\s+[A-Za-z0-9_.-]+)*)\s*:(?!=)", line)
        if m and not line.startswith((".", "\t")):
            targets.update(m.group(1).split())
    return targets


def _cli_commands() -> set:
    """COMMANDS of src/fused_logp/cli.py, read from its source (the tuples it adds up)."""
    tree = ast.parse((ROOT / "src" / "fused_logp" / "cli.py").read_text())
    values = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            values[node.targets[0].id] = node.value

    def strings(node):
        if isinstance(node, ast.Tuple):
            return {e.value for e in node.elts if isinstance(e, ast.Constant)}
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
            return strings(node.left) | strings(node.right)
        if isinstance(node, ast.Name):
            return strings(values[node.id])
        raise AssertionError(f"cli.py: COMMANDS is not a sum of string tuples: {ast.dump(node)}")

    return strings(values["COMMANDS"])


def test_readme_is_a_short_reference():
    n = len((ROOT / "README.md").read_text().splitlines())
    assert n < README_MAX_LINES, f"README.md has {n} lines; keep it under {README_MAX_LINES} (details go to docs/)"


def test_readme_names_only_existing_paths():
    text = (ROOT / "README.md").read_text()
    missing = sorted(p for p in _paths(text) | _links(ROOT / "README.md") if not _exists(p))
    assert not missing, f"README.md names paths that do not exist: {missing}"


def _named(page: Path, pattern) -> set:
    return {m.group(2) for chunk in _code(page.read_text()) for m in pattern.finditer(chunk)}


def test_readme_names_the_two_setup_commands_and_the_cli():
    assert {"demo", "test"} <= _named(ROOT / "README.md", _MAKE)
    assert _named(ROOT / "README.md", _CLI), "README.md names no fused-logp command"


@pytest.mark.parametrize("page", _current_pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_current_pages_name_existing_make_targets_and_commands(page):
    """README.md and the other current pages: every `make X` is a Makefile target, every `fused-logp X` a command
    of src/fused_logp/cli.py."""
    bad_make = sorted(_named(page, _MAKE) - _make_targets())
    assert not bad_make, f"{page.relative_to(ROOT)} names make targets the Makefile lacks: {bad_make}"
    bad_cli = sorted(_named(page, _CLI) - _cli_commands())
    assert not bad_cli, f"{page.relative_to(ROOT)} names fused-logp commands cli.py lacks: {bad_cli}"


@pytest.mark.parametrize("page", _current_pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_current_pages_name_existing_paths(page):
    """Paths relative to the repository root (in code spans and code blocks) and link targets (relative to the
    page) exist; a glob matches at least one file."""
    missing = sorted(p for p in _paths(page.read_text()) | _links(page) if not _exists(p))
    assert not missing, f"{page.relative_to(ROOT)} names paths that do not exist: {missing}"


def _current_files():
    """Everything that documents or runs the project today: all of it but the archive and the results' data."""
    try:                                   # the checkout's files (tracked, or new and not ignored), not build output
        names = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                               capture_output=True, text=True, check=True).stdout.split("\n")
        paths = [ROOT / n for n in names if n]
    except (OSError, subprocess.CalledProcessError):
        paths = [p for p in ROOT.rglob("*") if ".egg-info" not in p.as_posix()]
    for p in sorted(paths):
        rel = p.relative_to(ROOT).as_posix()
        if not p.is_file() or rel.startswith((".git/", ARCHIVE + "/", "build/", "out/", ".venv/")) \
                or "__pycache__" in rel or p.suffix in (".npz", ".xz", ".png", ".pyc"):
            continue
        if rel.startswith("bench/results/") and rel != "bench/results/README.md":
            continue
        if p == Path(__file__).resolve():
            continue
        yield p, rel


def test_no_current_file_cites_the_archive():
    bad = []
    for p, rel in _current_files():
        try:
            text = p.read_text()
        except UnicodeDecodeError:
            continue
        if ARCHIVE in text or "NOTES-" + "sm90" in text:
            bad.append(rel)
    assert not bad, f"these files cite the archive ({ARCHIVE} is history, current pages cite docs/design/): {bad}"


def _indexed_results() -> set:
    """The files bench/results/README.md lists: `name.ext`, then `.ext2` for the same name with another ending;
    {a,b} alternatives expanded."""
    out, last = set(), None
    for span in re.findall(r"`([^`\n]+)`", (ROOT / "bench" / "results" / "README.md").read_text()):
        for name in _expand(span):
            if re.fullmatch(r"[\w.-]+-(?:h200|h100|cpu|h200x2)[\w.-]*\.\w+|ex2-table-\w+\.json", name):
                out.add(name)
                last = name
            elif re.fullmatch(r"\.\w+", name) and last is not None:
                out.add(last.rsplit(".", 1)[0] + name)
    return out


def test_results_folder_holds_exactly_its_index():
    folder = {p.name for p in (ROOT / "bench" / "results").iterdir() if p.name != "README.md"}
    indexed = _indexed_results()
    assert not indexed - folder, f"bench/results/README.md lists files that are not there: {sorted(indexed - folder)}"
    assert not folder - indexed, f"files in bench/results/ that its README.md does not list: {sorted(folder - indexed)}"


def test_results_named_by_current_files_are_kept():
    """A results file named by a current page, a test, the library, the Makefile or a bench script exists."""
    folder = [p.name for p in (ROOT / "bench" / "results").iterdir()]
    missing = set()
    for p, rel in _current_files():
        if rel == "bench/results/README.md":
            continue
        try:
            text = p.read_text()
        except UnicodeDecodeError:
            continue
        for m in re.finditer(r"bench/results/([\w.*{},-]+[\w*}])", text):
            for name in _expand(m.group(1)):
                if not any(fnmatch.fnmatch(f, name) for f in folder):
                    missing.add(f"{rel}: {name}")
    assert not missing, f"results files named but absent: {sorted(missing)}"
