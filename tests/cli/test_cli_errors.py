"""`fused-logp` on bad input: the documented exit code (docs/cli.md), one line on stderr naming the argument or file,
no traceback, nothing written. And the cases where the command used to be wrong: golden compares and refuses to
store a non-contract backend's digests, the capture carries vocab_size and the contract version, ladder runs the
compiled CPU oracle."""
from __future__ import annotations

import json
import os

import pytest
import torch

from fused_logp import CONTRACT_VERSION, linear_logp
from fused_logp.cli import main


def run(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    return code, out, err


def files(folder):
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


@pytest.fixture
def head(tmp_path):
    """A padded bf16 lm_head in a safetensors file and a capture of 5 rows over its real vocabulary."""
    from safetensors.torch import save_file
    g = torch.Generator().manual_seed(7)
    v, d = 100, 32
    w = (torch.randn(v + 28, d, generator=g) * 0.2).bfloat16()
    w[v:] = 0
    h = torch.randn(5, d, generator=g).bfloat16()
    t = torch.randint(0, v, (5,), generator=g)
    temp = torch.full((5,), 0.8)
    r = linear_logp(h, w, t, temperature=temp, vocab_size=v, backend="oracle")
    save_file({"lm_head.weight": w}, str(tmp_path / "w.safetensors"))
    return {"w": w, "h": h, "t": t, "temp": temp, "logp": r.logp, "lse": r.lse, "v": v,
            "weight": tmp_path / "w.safetensors"}


def _plugin_rows(head, unsigned=False, **extra):
    rows = []
    for i in range(head["h"].shape[0]):
        bits = head["h"][i].view(torch.int16).to(torch.int32)
        if unsigned:
            bits = bits & 0xFFFF
        rows.append({"kind": "sample", "hidden": bits.tolist(), "ids": [int(head["t"][i])],
                     "logprobs": [float(head["logp"][i])], "temperature": float(head["temp"][i]), "program": None,
                     **extra})
    return rows


def _jsonl(path, rows):
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


# --- audit --------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name,content", [
    ("cap.pt", b"PK\x03\x04 truncated"),
    ("cap.safetensors", b"\x08\x00\x00\x00\x00\x00\x00\x00{\"a\":1}"),
    ("cap.json", b"[{\"hidden\": [1, 2"),
    ("cap.jsonl", b"\xff\xfe not utf-8"),
])
def test_audit_unreadable_capture_is_exit_2_naming_the_file(tmp_path, capsys, head, name, content):
    (tmp_path / name).write_bytes(content)
    code, _, err = run(capsys, "audit", tmp_path / name, "--weight", head["weight"], "--no-progress")
    assert code == 2 and name in err and len(err.strip().splitlines()) == 1


def test_audit_truncated_tensor_capture(tmp_path, capsys, head):
    from fused_logp.audit import write_capture
    write_capture(tmp_path / "cap.pt", hidden=head["h"], targets=head["t"], logp=head["logp"])
    data = (tmp_path / "cap.pt").read_bytes()
    (tmp_path / "cap.pt").write_bytes(data[: len(data) // 2])
    code, _, err = run(capsys, "audit", tmp_path / "cap.pt", "--weight", head["weight"], "--no-progress")
    assert code == 2 and "cap.pt" in err


def test_audit_plugin_rows_without_ids(tmp_path, capsys, head):
    rows = _plugin_rows(head)
    del rows[2]["ids"]
    code, _, err = run(capsys, "audit", _jsonl(tmp_path / "cap.jsonl", rows), "--weight", head["weight"],
                       "--vocab-size", head["v"], "--no-progress")
    assert code == 2 and "'ids'" in err and "row 2" in err


def test_audit_reads_unsigned_bit_patterns(tmp_path, capsys, head):
    rows = _plugin_rows(head, unsigned=True)
    assert any(x > 32767 for r in rows for x in r["hidden"])
    code, out, _ = run(capsys, "audit", _jsonl(tmp_path / "cap.jsonl", rows), "--weight", head["weight"],
                       "--vocab-size", head["v"], "--no-progress", "--backend", "oracle")
    assert code == 0 and "every checked byte equal" in out


def test_audit_temperature_of_the_wrong_length(tmp_path, capsys, head):
    torch.save({"hidden": head["h"], "targets": head["t"], "logp": head["logp"], "temperature": torch.ones(3)},
               tmp_path / "cap.pt")
    code, _, err = run(capsys, "audit", tmp_path / "cap.pt", "--weight", head["weight"], "--no-progress")
    assert code == 2 and "'temperature'" in err and "[5]" in err


def test_audit_weight_on_the_meta_device(tmp_path, capsys, head):
    from fused_logp.audit import write_capture
    write_capture(tmp_path / "cap.pt", hidden=head["h"], targets=head["t"], logp=head["logp"], vocab_size=head["v"])
    torch.save({"lm_head.weight": torch.empty(128, 32, dtype=torch.bfloat16, device="meta")}, tmp_path / "w.pt")
    code, _, err = run(capsys, "audit", tmp_path / "cap.pt", "--weight", tmp_path / "w.pt", "--no-progress")
    assert code == 2 and "meta" in err


def test_audit_index_naming_a_missing_shard(tmp_path, capsys, head):
    from fused_logp.audit import write_capture
    write_capture(tmp_path / "cap.pt", hidden=head["h"], targets=head["t"], logp=head["logp"], vocab_size=head["v"])
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"lm_head.weight": "model-00002-of-00002.safetensors"}}))
    code, _, err = run(capsys, "audit", tmp_path / "cap.pt", "--weight", tmp_path / "ckpt", "--no-progress")
    assert code == 2 and "model-00002-of-00002.safetensors" in err


def test_audit_out_pointing_at_a_folder_is_refused_before_the_audit(tmp_path, capsys, head):
    from fused_logp.audit import write_capture
    write_capture(tmp_path / "cap.pt", hidden=head["h"], targets=head["t"], logp=head["logp"], vocab_size=head["v"])
    (tmp_path / "report").mkdir()
    before = files(tmp_path)
    code, out, err = run(capsys, "audit", tmp_path / "cap.pt", "--weight", head["weight"], "--out", tmp_path / "report",
                         "--no-progress")
    assert code == 2 and "--out" in err and "folder" in err and "audit:" not in out
    assert files(tmp_path) == before


@pytest.mark.parametrize("args,named", [(["--max-rows", "-5"], "--max-rows"), (["--max-rows", "0"], "--max-rows"),
                                        (["--vocab-size", "0"], "--vocab-size"), (["--vocab-size", "-3"], "--vocab-size"),
                                        (["--vocab-size", "129"], "--vocab-size"), (["--show", "-1"], "--show"),
                                        (["--rows-per-batch", "0"], "--rows-per-batch")])
def test_audit_out_of_range_numbers(tmp_path, capsys, head, args, named):
    from fused_logp.audit import write_capture
    write_capture(tmp_path / "cap.pt", hidden=head["h"], targets=head["t"], logp=head["logp"], vocab_size=head["v"])
    code, out, err = run(capsys, "audit", tmp_path / "cap.pt", "--weight", head["weight"], "--no-progress", *args)
    assert code == 2 and named in err and "every checked byte equal" not in out


def test_capture_carries_vocab_size_and_contract_version(tmp_path, capsys, head):
    """A padded checkpoint audits clean without --vocab-size: the capture says the real vocabulary."""
    from fused_logp.audit import load_capture, write_capture
    for name in ("cap.pt", "cap.safetensors"):
        write_capture(tmp_path / name, hidden=head["h"], targets=head["t"], logp=head["logp"], temperature=head["temp"],
                      vocab_size=head["v"])
        cap = load_capture(tmp_path / name)
        assert cap["contract_version"] == CONTRACT_VERSION and cap["vocab_size"] == head["v"]
        code, out, _ = run(capsys, "audit", tmp_path / name, "--weight", head["weight"], "--no-progress",
                           "--backend", "oracle")
        assert code == 0 and f"V={head['v']}" in out
    rows = _plugin_rows(head, vocab_size=head["v"], contract_version=CONTRACT_VERSION)
    code, out, _ = run(capsys, "audit", _jsonl(tmp_path / "cap.jsonl", rows), "--weight", head["weight"],
                       "--no-progress", "--backend", "oracle")
    assert code == 0 and f"V={head['v']}" in out


def test_audit_refuses_a_capture_of_another_contract_version(tmp_path, capsys, head):
    rows = [{"kind": "header", "contract_version": "some-other-contract-v0", "vocab_size": head["v"]}]
    code, _, err = run(capsys, "audit", _jsonl(tmp_path / "cap.jsonl", rows + _plugin_rows(head)),
                       "--weight", head["weight"], "--no-progress")
    assert code == 2 and "some-other-contract-v0" in err and CONTRACT_VERSION in err
    torch.save({"hidden": head["h"], "targets": head["t"], "logp": head["logp"], "contract_version": "x-v9"},
               tmp_path / "cap.pt")
    code, _, err = run(capsys, "audit", tmp_path / "cap.pt", "--weight", head["weight"], "--no-progress")
    assert code == 2 and "x-v9" in err and CONTRACT_VERSION in err


def test_audit_report_is_written_whole(tmp_path, capsys, head):
    from fused_logp.audit import write_capture
    write_capture(tmp_path / "cap.pt", hidden=head["h"], targets=head["t"], logp=head["logp"], temperature=head["temp"],
                  vocab_size=head["v"])
    code, _, _ = run(capsys, "audit", tmp_path / "cap.pt", "--weight", head["weight"], "--no-progress", "--backend",
                     "oracle", "--out", tmp_path / "new" / "rep.json")
    assert code == 0 and json.loads((tmp_path / "new" / "rep.json").read_text())["ok"]
    assert [p.name for p in (tmp_path / "new").iterdir()] == ["rep.json"]


# --- golden -------------------------------------------------------------------------------------------------------

@pytest.fixture
def golden_file(tmp_path):
    from fused_logp.golden import GOLDEN
    p = tmp_path / "golden.json"
    p.write_bytes(GOLDEN.read_bytes())
    return p


def test_golden_write_refuses_a_non_contract_backend(capsys, golden_file):
    from fused_logp.golden import GOLDEN
    before, package = golden_file.read_bytes(), GOLDEN.read_bytes()
    code, _, err = run(capsys, "golden", "--write", "--backend", "torch", "--golden-file", golden_file)
    assert code == 2 and "torch" in err and "contract-bearing" in err
    assert golden_file.read_bytes() == before and GOLDEN.read_bytes() == package
    code, _, err = run(capsys, "golden", "--write", "--backend", "torch")
    assert code == 2 and GOLDEN.read_bytes() == package


@pytest.mark.parametrize("backend,want", [("nope", 2), ("sm90", None), ("auto", None)])
def test_golden_backends_without_traceback(capsys, backend, want):
    code, _, err = run(capsys, "golden", "--backend", backend)
    if backend == "nope":
        assert code == 2 and "--backend" in err and "oracle" in err
    elif backend == "sm90" and not torch.cuda.is_available():
        assert code == 2 and "sm90" in err and "CUDA" in err
    else:
        assert code in (0, 2)


def test_golden_compares_with_the_stored_digests(tmp_path, capsys, golden_file):
    if CONTRACT_VERSION not in json.loads(golden_file.read_text()):
        pytest.skip("golden.json stores no digests for this contract version yet")
    code, out, _ = run(capsys, "golden", "--golden-file", golden_file, "--backend", "oracle-fast")
    assert code == 0 and "every digest equal" in out
    data = json.loads(golden_file.read_text())
    for entry in data[CONTRACT_VERSION].values():
        entry["small-T1"] = "0" * 64
    golden_file.write_text(json.dumps(data))
    code, out, _ = run(capsys, "golden", "--golden-file", golden_file, "--backend", "oracle-fast")
    assert code == 1 and "DIFFERS" in out
    code, _, err = run(capsys, "golden", "--write", "--golden-file", golden_file, "--backend", "oracle-fast")
    assert code == 1 and "not written" in err


def test_golden_without_digests_for_this_contract(tmp_path, capsys):
    (tmp_path / "g.json").write_text(json.dumps({"another-contract-v0": {"oracle/cpu/none": {}}}))
    code, _, err = run(capsys, "golden", "--golden-file", tmp_path / "g.json")
    assert code == 2 and CONTRACT_VERSION in err and "another-contract-v0" in err
    (tmp_path / "bad.json").write_text("{not json")
    code, _, err = run(capsys, "golden", "--golden-file", tmp_path / "bad.json")
    assert code == 2 and "bad.json" in err


def test_golden_write_stores_into_a_new_file(tmp_path, capsys):
    code, _, _ = run(capsys, "golden", "--write", "--golden-file", tmp_path / "g.json", "--backend", "oracle-fast")
    assert code == 0
    data = json.loads((tmp_path / "g.json").read_text())
    assert list(data) == [CONTRACT_VERSION] and list(data[CONTRACT_VERSION]) == ["oracle-fast/cpu/none"]
    assert files(tmp_path) == ["g.json"]
    code, out, _ = run(capsys, "golden", "--golden-file", tmp_path / "g.json", "--backend", "oracle-fast")
    assert code == 0


# --- configuration and the jobs -----------------------------------------------------------------------------------

@pytest.mark.parametrize("text,named", [(None, "does not exist"), ("strict: [", "not valid YAML"),
                                        ("- a\n- b\n", "list"), ("colour: blue\n", "unknown keys"),
                                        ("strict: 'false'\n", "strict"), ("backend: nope\n", "backend"),
                                        ("vocab_tile: 128\n", "VOCAB_TILE")])
def test_config_errors_are_one_line(tmp_path, capsys, text, named):
    cfg = tmp_path / "c.yaml"
    if text is not None:
        cfg.write_text(text)
    code, _, err = run(capsys, "--config", cfg, "ladder", "--out", tmp_path / "lad")
    assert code == 2 and named in err and "c.yaml" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "lad").exists()


def test_ladder_out_pointing_at_a_file(tmp_path, capsys):
    (tmp_path / "f").write_text("keep")
    code, _, err = run(capsys, "ladder", "--out", tmp_path / "f")
    assert code == 2 and "--out" in err and (tmp_path / "f").read_text() == "keep"


@pytest.mark.parametrize("args,named", [(["--steps", "-1"], "--steps"), (["--steps", "0"], "--steps"),
                                        (["--steps", "x"], "--steps"),
                                        (["--steps", "3", "--stale-at", "3"], "--stale-at"),
                                        (["--stale-at", "0"], "--stale-at")])
def test_rl_refuses_out_of_range_steps(tmp_path, capsys, args, named):
    code, _, err = run(capsys, "rl", "--out", tmp_path / "rl", *args)
    assert code == 2 and named in err and not (tmp_path / "rl").exists()


def test_unknown_command_and_help(capsys):
    code, _, err = run(capsys, "frobnicate")
    assert code == 2 and "frobnicate" in err and "audit" in err
    code, out, _ = run(capsys, "--help")
    assert code == 0 and "exit" in out
    code, out, _ = run(capsys, "audit", "--help")
    assert code == 0 and "CAPTURE" in out


def test_debug_shows_the_traceback(tmp_path):
    with pytest.raises(Exception):
        main(["--debug", "audit", str(tmp_path / "none.pt"), "--weight", str(tmp_path / "w")])


def test_ladder_includes_the_compiled_cpu_oracle():
    from fused_logp.kernel.backends import get_backend
    from fused_logp_jobs.ladder import available_backends
    if not get_backend("oracle-fast").available()[0]:
        pytest.skip("the compiled CPU oracle does not build here")
    assert available_backends()[:2] == ["oracle", "oracle-fast"]


@pytest.mark.slow
def test_ladder_compares_the_compiled_cpu_oracle_with_the_numpy_one(tmp_path):
    from fused_logp.kernel.backends import get_backend
    from fused_logp_jobs.ladder import run_ladder
    if not get_backend("oracle-fast").available()[0]:
        pytest.skip("the compiled CPU oracle does not build here")
    rep = run_ladder(tmp_path / "lad", backends=["oracle", "oracle-fast"], quiet=True)
    cross = [c for c in rep["checks"] if c["backend"] == "cross"]
    assert len(cross) == 1 and cross[0]["passed"] and "oracle-fast" in cross[0]["check"]
    assert sorted(os.listdir(tmp_path / "lad")) == ["ladder.json", "ladder.md"]


# --- build --------------------------------------------------------------------------------------------------------

def test_build_names_what_to_install(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("FUSED_LOGP_CACHE", str(tmp_path / "cache"))
    code, _, err = run(capsys, "build")
    if torch.version.cuda is None:
        assert code == 2 and "CUDA build of torch" in err and len(err.strip().splitlines()) == 1
    else:
        assert code in (0, 2)
