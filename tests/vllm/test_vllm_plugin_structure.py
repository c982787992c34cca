"""The vLLM plugin's modules import each other without a cycle (every import statement, also those inside
functions), and the byte-deciding sampling rules come from the contract layer, not the adapter."""
from __future__ import annotations

import ast
from pathlib import Path

import fused_logp

PKG = Path(fused_logp.__file__).resolve().parent / "vllm_plugin"
PREFIX = "fused_logp.vllm_plugin"


def _graph() -> dict[str, set[str]]:
    mods = {p.stem for p in PKG.glob("*.py")}
    graph = {}
    for m in mods:
        tree = ast.parse((PKG / f"{m}.py").read_text())
        deps = set()
        for n in ast.walk(tree):
            if isinstance(n, ast.ImportFrom):
                if n.level == 1:
                    if n.module:
                        deps.add(n.module.split(".")[0])
                    else:
                        deps.update(a.name for a in n.names)
                elif n.level == 0 and (n.module or "").startswith(PREFIX + "."):
                    deps.add(n.module[len(PREFIX) + 1:].split(".")[0])
            elif isinstance(n, ast.Import):
                deps.update(a.name[len(PREFIX) + 1:].split(".")[0] for a in n.names
                            if a.name.startswith(PREFIX + "."))
        graph[m] = (deps & mods) - {m}
    return graph


def _cycle(graph):
    state: dict = {}

    def visit(m, path):
        state[m] = 1
        for d in sorted(graph[m]):
            if state.get(d) == 1:
                return path + [m, d]
            if d not in state:
                c = visit(d, path + [m])
                if c:
                    return c
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state:
            c = visit(m, [])
            if c:
                return c
    return None


def test_plugin_import_graph_is_acyclic():
    graph = _graph()
    assert {"head", "v1_sampler", "mrv2_sampler", "prompt_logprobs", "weight_sync", "status_rpc", "state"} <= set(graph)
    assert _cycle(graph) is None, f"import cycle: {' -> '.join(_cycle(graph))}"
    assert graph["state"] <= {"settings", "policy"}, graph["state"]       # shared state imports no surface


def test_cycle_finder_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) is not None
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_adapter_holds_no_sampling_epsilon():
    """The greedy threshold and the greedy scoring temperature come from shared_contract.sampling."""
    for p in PKG.glob("*.py"):
        text = p.read_text()
        assert "1e-5" not in text and "_SAMPLING_EPS" not in text, p.name
