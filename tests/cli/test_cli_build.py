"""The extensions' shared build cache (kernel/extension_build.py, `fused-logp build`): one builder per key while the
other processes wait, a load that compiles nothing when the key is current, an interrupted build that blocks no one,
and one-line errors naming what to install. The compile step is a stand-in here (a Python module written into the
build folder); the cache, the key and the lock are the real ones."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from fused_logp.kernel import extension_build as eb

SRC = Path(__file__).resolve().parents[2] / "src"

SCRIPT = textwrap.dedent("""
    import json, logging, os, sys, time
    sys.path.insert(0, {src!r})
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    from pathlib import Path
    from fused_logp.kernel import extension_build as eb

    def fake(spec, folder):
        (folder / "started").write_text(str(os.getpid()))
        time.sleep(float(os.environ.get("FAKE_SLEEP", "0")))
        (folder / "fake_ext.py").write_text("BUILT_BY = %d\\n" % os.getpid())
        return None, "fake_ext.py"

    spec = eb.ExtensionSpec(name="fake_ext", sources=(sys.argv[1],), extra_cflags=("-O2",))
    module, info = eb.ensure_extension(spec, builder=fake)
    built_by = module.BUILT_BY if module is not None else os.getpid()
    print(json.dumps({{"action": info["action"], "pid": os.getpid(), "built_by": built_by}}))
""")


@pytest.fixture
def fake(tmp_path, monkeypatch):
    monkeypatch.setenv("FUSED_LOGP_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("FUSED_LOGP_NO_BUILD", raising=False)
    script = tmp_path / "build.py"
    script.write_text(SCRIPT.format(src=str(SRC)))
    source = tmp_path / "ext.cpp"
    source.write_text("// the extension\n")

    def start(sleep=0.0):
        env = dict(os.environ, FAKE_SLEEP=str(sleep))
        return subprocess.Popen([sys.executable, str(script), str(source)], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, env=env)

    def result(proc, timeout=120):
        out, err = proc.communicate(timeout=timeout)
        assert proc.returncode == 0, err
        return json.loads(out.strip().splitlines()[-1]), err

    return {"start": start, "result": result, "cache": tmp_path / "cache", "source": source}


def test_a_current_key_is_loaded_and_nothing_is_compiled(fake):
    first, err1 = fake["result"](fake["start"]())
    second, err2 = fake["result"](fake["start"]())
    assert first["action"] == "built" and "built into the cache" in err1
    assert second["action"] == "loaded" and second["built_by"] == first["pid"]
    assert "loaded from the cache" in err2 and "nothing compiled" in err2
    entry = next((fake["cache"] / "fake_ext").iterdir(), None)
    assert sorted(p.name for p in (fake["cache"] / "fake_ext").iterdir() if p.is_dir()) == [entry.name.split(".")[0]]


def test_processes_started_together_have_one_builder(fake):
    procs = [fake["start"](sleep=2.0) for _ in range(3)]
    results = [fake["result"](p)[0] for p in procs]
    built = [r for r in results if r["action"] == "built"]
    assert len(built) == 1
    assert all(r["built_by"] == built[0]["pid"] for r in results)
    assert {r["action"] for r in results} <= {"built", "built-by-another", "loaded"}


def test_an_interrupted_build_blocks_no_one(fake):
    victim = fake["start"](sleep=120.0)
    folder = fake["cache"] / "fake_ext"
    deadline = time.time() + 60
    while not list(folder.glob("*.tmp-*/started")) and time.time() < deadline:
        time.sleep(0.1)
    assert list(folder.glob("*.tmp-*/started")), "the first build did not start"
    os.kill(victim.pid, signal.SIGKILL)
    victim.communicate()
    t0 = time.time()
    after, _ = fake["result"](fake["start"](), timeout=60)
    assert after["action"] == "built" and time.time() - t0 < 60
    assert not list(folder.glob("*.tmp-*"))                  # the interrupted build's folder is gone


def test_the_key_follows_sources_headers_and_flags(tmp_path):
    (tmp_path / "a.cpp").write_text("int a;\n")
    (tmp_path / "a.h").write_text("// h\n")
    spec = eb.ExtensionSpec(name="x", sources=(str(tmp_path / "a.cpp"),))
    k = eb.build_key(spec, "tool 1")
    assert eb.build_key(spec, "tool 1") == k
    assert eb.build_key(spec, "tool 2") != k
    assert eb.build_key(eb.ExtensionSpec(name="x", sources=spec.sources, extra_cflags=("-O2",)), "tool 1") != k
    (tmp_path / "a.h").write_text("// h changed\n")
    assert eb.build_key(spec, "tool 1") != k
    (tmp_path / "a.h").write_text("// h\n")
    (tmp_path / "a.cpp").write_text("int b;\n")
    assert eb.build_key(spec, "tool 1") != k


def test_no_build_mode_names_the_build_command(tmp_path, monkeypatch):
    monkeypatch.setenv("FUSED_LOGP_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("FUSED_LOGP_NO_BUILD", "1")
    (tmp_path / "a.cpp").write_text("int a;\n")
    spec = eb.ExtensionSpec(name="x", sources=(str(tmp_path / "a.cpp"),))
    with pytest.raises(eb.BuildError, match="fused-logp build"):
        eb.ensure_extension(spec, builder=lambda s, f: pytest.fail("compiled"))


def test_a_failed_build_is_one_line_with_its_log(tmp_path, monkeypatch):
    monkeypatch.setenv("FUSED_LOGP_CACHE", str(tmp_path / "cache"))
    (tmp_path / "a.cpp").write_text("int a;\n")
    spec = eb.ExtensionSpec(name="x", sources=(str(tmp_path / "a.cpp"),))

    def broken(s, f):
        raise RuntimeError("Error building extension 'x'\nfirst compiler line\nsecond")

    with pytest.raises(eb.BuildError) as exc:
        eb.ensure_extension(spec, builder=broken)
    msg = str(exc.value)
    assert "\n" not in msg and "failed.log" in msg
    log = next((tmp_path / "cache" / "x").glob("*.failed.log"))
    assert "second" in log.read_text()
    assert not [p for p in (tmp_path / "cache" / "x").iterdir() if p.is_dir()]
    built = eb.ensure_extension(spec, builder=lambda s, f: ((f / "x_mod.py").write_text("A = 1\n"), (None, "x_mod.py"))[1])
    assert built[1]["action"] == "built" and not list((tmp_path / "cache" / "x").glob("*.failed.log"))


def _fake_nvcc(folder: Path, release: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    nvcc = folder / "nvcc"
    nvcc.write_text(f"#!/bin/sh\necho 'nvcc: NVIDIA (R) Cuda compiler driver'\n"
                    f"echo 'Cuda compilation tools, release {release}, V{release}.1'\n")
    nvcc.chmod(0o755)
    return nvcc


def test_toolkit_errors_name_what_to_install(tmp_path, monkeypatch):
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.delenv("CUDA_PATH", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.setattr(eb, "find_nvcc", lambda: None)
    with pytest.raises(eb.BuildError, match=r"nvcc not found.*install the CUDA toolkit 13\.x"):
        eb.cuda_toolkit(torch_cuda="13.0")
    monkeypatch.undo()
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "old"))
    _fake_nvcc(tmp_path / "old" / "bin", "11.8")
    with pytest.raises(eb.BuildError, match=r"CUDA 11\.8; sm_90a needs CUDA 12\.0 or newer"):
        eb.cuda_toolkit(torch_cuda="11.8")
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "twelve"))
    _fake_nvcc(tmp_path / "twelve" / "bin", "12.4")
    with pytest.raises(eb.BuildError, match=r"CUDA 12\.4 but torch .* CUDA 13\.0: install the CUDA toolkit 13\.x"):
        eb.cuda_toolkit(torch_cuda="13.0")
    assert eb.cuda_toolkit(torch_cuda="12.8")[0] == str(tmp_path / "twelve" / "bin" / "nvcc")
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "missing"))
    with pytest.raises(eb.BuildError, match=r"nvcc not found \(CUDA_HOME="):
        eb.cuda_toolkit(torch_cuda="13.0")


def test_build_command_exit_codes(tmp_path, monkeypatch, capsys):
    import torch

    from fused_logp.cli import main
    monkeypatch.setenv("FUSED_LOGP_CACHE", str(tmp_path / "cache"))
    if torch.version.cuda is None:
        for argv in (["build"], ["build", "sm90", "--check"]):
            assert main(argv) == 2
            err = capsys.readouterr().err
            assert "CUDA build of torch" in err and "Traceback" not in err
    assert main(["build", "nope"]) == 2
    assert "invalid choice" in capsys.readouterr().err
