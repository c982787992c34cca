"""vLLM plugin pieces that need no engine: registration, settings (kill switch, capture bound), the column
rescoring shared by both samplers, the bounded capture buffer and its JSON-safe rows, the Prometheus status, and
the Model Runner V2 wrappers (MRV2 needs Triton on a GPU, so only its wiring is checked here)."""
from __future__ import annotations

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402

from fused_logp import linear_logp  # noqa: E402


def test_register_is_idempotent_and_replaces_logits_processor():
    from vllm.model_executor.custom_op import op_registry_oot

    from fused_logp.vllm_plugin import register
    from fused_logp.vllm_plugin.head import FusedLogpLogitsProcessor

    register()
    register()
    assert op_registry_oot["LogitsProcessor"] is FusedLogpLogitsProcessor
    from vllm.v1.worker.worker_base import WorkerBase
    assert callable(WorkerBase.fused_logp_status)


class _Cfg:
    def __init__(self, extra):
        self.additional_config = extra


def test_settings_and_kill_switch(monkeypatch, tmp_path):
    from fused_logp.vllm_plugin.settings import settings_from_vllm_config

    monkeypatch.delenv("FUSED_LOGP_VLLM", raising=False)
    monkeypatch.delenv("FUSED_LOGP_STRICT", raising=False)
    assert settings_from_vllm_config(_Cfg({})) is None
    assert settings_from_vllm_config(_Cfg({"fused_logp": {"enabled": False}})) is None
    yaml = tmp_path / "strict.yaml"
    yaml.write_text("strict: true\nbackend: oracle\n")
    s = settings_from_vllm_config(_Cfg({"fused_logp": {"enabled": True, "config": str(yaml)}}))
    assert s.strict is True and s.backend == "oracle"
    s = settings_from_vllm_config(_Cfg({"fused_logp": {"enabled": True, "config": str(yaml), "strict": False}}))
    assert s.strict is False
    with pytest.raises(ValueError, match="unknown keys"):
        settings_from_vllm_config(_Cfg({"fused_logp": {"enable": True}}))
    with pytest.raises(ValueError, match="capture_limit"):
        settings_from_vllm_config(_Cfg({"fused_logp": {"capture_limit": 0}}))
    assert settings_from_vllm_config(_Cfg({"fused_logp": {"capture_limit": 5}})).capture_limit == 5
    monkeypatch.setenv("FUSED_LOGP_VLLM", "0")
    assert settings_from_vllm_config(_Cfg({"fused_logp": {"enabled": True, "strict": False}})) is None
    assert settings_from_vllm_config(_Cfg({})) is None
    monkeypatch.setenv("FUSED_LOGP_VLLM", "1")
    assert settings_from_vllm_config(_Cfg({})) is not None


def test_kill_switch_refuses_a_strict_configuration(monkeypatch, tmp_path):
    """FUSED_LOGP_VLLM=0 with an engine configured for strict mode: refused, not silently obeyed."""
    from fused_logp.vllm_plugin.settings import SettingsConflictError, check_kill_switch, settings_from_vllm_config

    monkeypatch.setenv("FUSED_LOGP_VLLM", "0")
    monkeypatch.delenv("FUSED_LOGP_STRICT", raising=False)
    with pytest.raises(SettingsConflictError, match="kill switch"):
        settings_from_vllm_config(_Cfg({"fused_logp": {"enabled": True, "strict": True}}))
    yaml = tmp_path / "strict.yaml"
    yaml.write_text("strict: true\n")
    with pytest.raises(SettingsConflictError):
        check_kill_switch(_Cfg({"fused_logp": {"config": str(yaml)}}))
    check_kill_switch(_Cfg({"fused_logp": {"enabled": False, "strict": True}}))     # disabled: nothing to refuse


def test_capture_buffer_bound_and_json_safe_rows():
    """The oldest rows are dropped first and counted; -inf and nan travel as strings float() reads back."""
    import json

    from fused_logp.vllm_plugin.scoring import json_float
    from fused_logp.vllm_plugin.state import CaptureBuffer

    b = CaptureBuffer(3)
    for i in range(5):
        b.append({"i": i})
    assert [r["i"] for r in b.peek()] == [2, 3, 4] and b.dropped == 2
    assert [r["i"] for r in b.take(2)] == [2, 3] and len(b) == 1
    vals = [json_float(v) for v in (-1.5, float("-inf"), float("inf"), float("nan"))]
    text = json.dumps(vals, allow_nan=False)
    back = [float(v) for v in json.loads(text)]
    assert back[0] == -1.5 and back[1] == float("-inf") and back[2] == float("inf") and back[3] != back[3]
    with pytest.raises(ValueError):
        CaptureBuffer(0)


def test_prometheus_info_metric():
    from prometheus_client import REGISTRY

    from fused_logp.shared_contract.constants import CONTRACT_VERSION
    from fused_logp.vllm_plugin import metrics
    from fused_logp.vllm_plugin.settings import PluginSettings

    metrics.publish(PluginSettings(strict=True, backend="auto", capture=False, source="test"),
                    weight_version="fp-before")
    labels = {"contract_version": CONTRACT_VERSION, "strict": "true", "backend": "oracle",
              "weight_version": "fp-before"}
    # the backend label is the one that served (the op's provenance), "pending" before the first forward
    if metrics._served is None:
        assert REGISTRY.get_sample_value("fused_logp_info", dict(labels, backend="pending")) == 1.0
    metrics.served("oracle")
    assert REGISTRY.get_sample_value("fused_logp_info", labels) == 1.0
    metrics._labels_update("fp-test")
    assert REGISTRY.get_sample_value("fused_logp_info", labels) is None
    assert REGISTRY.get_sample_value("fused_logp_info", dict(labels, weight_version="fp-test")) == 1.0


def test_rescore_every_column_at_row_temperature():
    """Both samplers end in rescore(): a top-k column repeating the sampled id and a padding column (-inf)."""
    from vllm.v1.outputs import LogprobsTensors

    from fused_logp.vllm_plugin.scoring import effective_temperature, rescore
    from fused_logp.vllm_plugin.settings import PluginSettings
    from fused_logp.vllm_plugin.state import HeadState, Mark

    g = torch.Generator().manual_seed(0)
    n, d, v = 3, 64, 200
    h = torch.randn(n, d, generator=g).to(torch.bfloat16)
    w = torch.randn(v, d, generator=g).to(torch.bfloat16)
    z = linear_logp(h, w, torch.zeros(n, dtype=torch.int64), return_logits=True).logits
    ids = torch.tensor([[5, 5, 9], [7, 1, 7], [0, 199, 3]], dtype=torch.int32)
    old = torch.tensor([[-1.0, -2.0, -3.0], [-1.0, -2.0, -3.0], [-1.0, -2.0, float("-inf")]])
    lt = LogprobsTensors(ids, old, torch.zeros(n, dtype=torch.int64))
    temps = effective_temperature(torch.tensor([0.7, 0.0, 1.3]), n, z.device)     # greedy row scored at T=1
    assert temps.tolist() == [pytest.approx(0.7), 1.0, pytest.approx(1.3)]
    st = HeadState(PluginSettings(strict=True, backend="auto", capture=True, source="test"))
    out = rescore(lt, z, temps, Mark(st, h))
    want = linear_logp(h.repeat_interleave(3, 0), w, ids.flatten().long(),
                       temperature=temps.repeat_interleave(3)).logp.view(n, 3)
    assert torch.equal(out.logprobs[:, :2], want[:, :2]) and torch.equal(out.logprobs[:2, 2], want[:2, 2])
    assert out.logprobs[0, 0] == out.logprobs[0, 1] and out.logprobs[1, 0] == out.logprobs[1, 2]
    assert out.logprobs[2, 2] == float("-inf")
    rows = st.captured.peek()
    assert len(rows) == n and rows[0]["ids"] == [5, 5, 9] and rows[2]["logprobs"][2] == "-inf"


def test_model_runner_v2_wrappers_installed():
    from vllm.v1.sample.sampler import Sampler as V1Sampler
    from vllm.v1.worker.gpu.sample import prompt_logprob as pl
    from vllm.v1.worker.gpu.sample.sampler import Sampler as V2Sampler
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from fused_logp.vllm_plugin import capability, install, mrv2_sampler, prompt_logprobs, v1_sampler

    install.install(capability.detect())
    install.install(capability.detect())
    for fn, mod in ((V2Sampler.__call__, mrv2_sampler), (V2Sampler.add_request, mrv2_sampler),
                    (pl.PromptLogprobsWorker.compute_prompt_logprobs, prompt_logprobs),
                    (pl.PromptLogprobsWorker.add_request, prompt_logprobs), (pl.compute_topk_scores, prompt_logprobs),
                    (V1Sampler.forward, v1_sampler), (V1Sampler.sample, v1_sampler),
                    (V1Sampler.gather_logprobs, prompt_logprobs), (GPUModelRunner._sample, v1_sampler),
                    (GPUModelRunner._get_prompt_logprobs_dict, prompt_logprobs)):
        assert fn.__code__.co_filename == mod.__file__, fn
        assert not hasattr(fn.__wrapped__, "__wrapped__"), "wrapped twice"



def test_vllm_warmup_requests_are_recognised():
    """vLLM's start-up warm-up requests (which exercise penalties, biases, bad words) leave no non-contract notes."""
    from fused_logp.vllm_plugin.state import is_vllm_warmup

    assert is_vllm_warmup("_warmup_3_") and is_vllm_warmup("_v2_mixed_warmup_decode_")
    assert not is_vllm_warmup("0-1a2b3c4d") and not is_vllm_warmup("cmpl-abc-0-1a2b3c4d") and not is_vllm_warmup(None)


def _head_call(h, w, **kw):
    from fused_logp import shard_tile_stats

    return shard_tile_stats(h, w, torch.zeros(h.shape[0], dtype=torch.int64), vocab_start=0, vocab_size=w.shape[0],
                            return_logits=True, **kw)


@pytest.mark.parametrize("backend", ["auto", "oracle"])
def test_logits_and_stats_is_the_t1_shard_call(backend):
    """The serving head entry (no targets) gives the bytes of shard_tile_stats at T = 1 with targets 0 and the
    logits of linear_logp(return_logits=True), with and without bias and for weights with padding rows."""
    from fused_logp.kernel.op import logits_and_stats

    g = torch.Generator().manual_seed(5)
    n, d, v = 6, 48, 261
    h = torch.randn(n, d, generator=g).to(torch.bfloat16)
    w = (torch.randn(v + 11, d, generator=g) * 0.3).to(torch.bfloat16)        # 11 padding rows
    bias = torch.randn(v + 11, generator=g).to(torch.bfloat16)
    for kw in ({}, {"bias": bias}):
        got = logits_and_stats(h, w, vocab_size=v, backend=backend, **kw)
        ref = _head_call(h, w[:v], backend=backend, **({"bias": bias[:v]} if kw else {}))
        assert got.unit_temperature and got.tile_offset == 0
        for a, b in ((got.tile_max, ref.tile_max), (got.tile_sum, ref.tile_sum), (got.logits, ref.logits)):
            assert torch.equal(a.view(torch.int32), b.view(torch.int32))
        lin = linear_logp(h, w, torch.zeros(n, dtype=torch.int64), vocab_size=v, return_logits=True,
                          backend=backend, **kw)
        assert torch.equal(got.logits.view(torch.int32), lin.logits.view(torch.int32))
    big = logits_and_stats(torch.cat([h] * 50), w, vocab_size=v, backend=backend)   # the row buffers grow
    small = logits_and_stats(h, w, vocab_size=v, backend=backend)
    assert torch.equal(big.logits[:n].view(torch.int32), small.logits.view(torch.int32))


@pytest.mark.parametrize("backend", ["auto", "oracle"])
def test_logp_of_ids_equals_logp_from_logits_at_unit_temperature(backend):
    """The head call's own statistics give the same bytes as a second pass over its logits (logp_from_logits at
    T = 1) and as the trainer's linear_logp, for one id or several per row; an id outside the vocabulary makes its
    row invalid; statistics at another temperature are refused."""
    from fused_logp import logp_from_logits
    from fused_logp.kernel.op import logp_of_ids
    from fused_logp.shared_contract.errors import ContractInputError

    g = torch.Generator().manual_seed(3)
    n, d, v = 5, 64, 333                                    # 6 tiles, the last one partial
    h = torch.randn(n, d, generator=g).to(torch.bfloat16)
    w = (torch.randn(v, d, generator=g) * 0.3).to(torch.bfloat16)
    bias = torch.randn(v, generator=g).to(torch.bfloat16)
    for kw in ({}, {"bias": bias}):
        stats = _head_call(h, w, backend=backend, **kw)
        assert stats.unit_temperature
        ids = torch.randint(0, v, (n, 4), generator=g)
        ids[0, 1] = ids[0, 0]
        ids[2, 3] = v - 1
        got = logp_of_ids(stats, ids, vocab_size=v, backend=backend)
        ref = logp_from_logits(stats.logits, ids, temperature=1.0, backend=backend)
        assert torch.equal(got.logp.view(torch.int32), ref.logp.view(torch.int32))
        assert torch.equal(got.lse.view(torch.int32), ref.lse.view(torch.int32))
        one = logp_of_ids(stats, ids[:, 2], vocab_size=v, backend=backend)
        tr = linear_logp(h, w, ids[:, 2], backend=backend, **kw)
        assert torch.equal(one.logp.view(torch.int32), tr.logp.view(torch.int32))
        assert torch.equal(one.lse.view(torch.int32), tr.lse.view(torch.int32))
    with pytest.raises(ContractInputError, match="targets|ids must lie"):
        logp_of_ids(stats, torch.full((n,), v), vocab_size=v, backend=backend)
    warm = _head_call(h, w, backend=backend, temperature=0.7)
    assert not warm.unit_temperature and _head_call(h, w, backend=backend, temperature=1).unit_temperature
    with pytest.raises(ContractInputError, match="temperature 1"):
        logp_of_ids(warm, ids, vocab_size=v, backend=backend)


def test_rescore_from_head_statistics_equals_second_pass():
    """rescore() with every row at T = 1 (greedy rows included) reads the columns from the head call's statistics:
    the same bytes as the second pass it replaces; padding columns stay -inf; the capture records T = 1."""
    from vllm.v1.outputs import LogprobsTensors

    from fused_logp.vllm_plugin.scoring import all_unit_temperature, effective_temperature, rescore
    from fused_logp.vllm_plugin.settings import PluginSettings
    from fused_logp.vllm_plugin.state import HeadState, Mark

    import numpy as np

    g = torch.Generator().manual_seed(1)
    n, d, v = 4, 64, 200
    h = torch.randn(n, d, generator=g).to(torch.bfloat16)
    w = torch.randn(v, d, generator=g).to(torch.bfloat16)
    stats = _head_call(h, w)
    ids = torch.tensor([[5, 5, 9], [7, 1, 7], [0, 199, 3], [42, 43, 44]], dtype=torch.int32)
    old = torch.full((n, 3), -1.0)
    old[2, 2] = float("-inf")
    host_t = np.array([1.0, 0.0, 1.0, 1e-6], dtype=np.float32)        # greedy rows are scored at T = 1
    assert all_unit_temperature(host_t) and not all_unit_temperature(np.array([1.0, 0.7], dtype=np.float32))
    assert not all_unit_temperature(None)
    temps = effective_temperature(torch.from_numpy(host_t), n, "cpu")
    outs = []
    for unit in (False, True):
        st = HeadState(PluginSettings(strict=True, backend="auto", capture=True, source="test"))
        lt = LogprobsTensors(ids, old.clone(), torch.zeros(n, dtype=torch.int64))
        outs.append(rescore(lt, stats.logits.clone(), lambda: temps, Mark(st, h, stats), unit_temperature=unit))
        assert st.rows_head_stats == (n if unit else 0) and st.rows_rescored == n
        assert [r["temperature"] for r in st.captured.peek()] == [1.0] * n
    assert torch.equal(outs[0].logprobs.view(torch.int32), outs[1].logprobs.view(torch.int32))
    assert outs[1].logprobs[2, 2] == float("-inf")


def test_mrv2_request_flags():
    """The MRV2 wrapper's per-slot flags: set once per request, grown on demand, a reused slot overwritten."""
    import numpy as np

    from fused_logp.kernel.transforms import TransformProgram
    from fused_logp.vllm_plugin.mrv2_sampler import _Flags

    f = _Flags(2)
    f = f.grown(5)
    f.set(5, TransformProgram(temperature=1.0), [])
    f.set(1, TransformProgram(temperature=0.7, top_k=5), [])
    f.set(0, None, ["presence_penalty=0.5"])
    assert f.size >= 6 and f.covers(np.array([0, 5])) and not f.covers(np.array([f.size]))
    assert f.program.tolist()[:6] == [False, True, False, False, False, True]
    assert f.nonneutral.tolist()[:6] == [False, True, False, False, False, False]
    assert f.flagged.tolist()[:6] == [True, False, False, False, False, False]
    f.epoch[5] = 3
    f.set(5, None, [])
    assert not f.program[5] and f.epoch[5] == -1


def test_mrv2_step_summary_once_per_rows_and_version():
    """A step's summary of its rows' flags is reused while the rows and the flags stay the same, found again when
    either changes (a new request in a slot), and absent for rows with a slot never added (vLLM's dummy runs)."""
    import numpy as np

    from fused_logp.kernel.transforms import TransformProgram
    from fused_logp.vllm_plugin.mrv2_sampler import _Flags

    f = _Flags(8)
    f.set(0, TransformProgram(temperature=1.0), [])
    f.set(1, None, [])
    rows = np.array([0, 1], dtype=np.int32)
    a = f.summary(rows)
    assert (a.program, a.nonneutral, a.flagged) == (True, False, False)
    a.recorded = ("state", 0)
    assert f.summary(np.array([0, 1], dtype=np.int32)) is a            # same rows, same flags: the same summary
    b = f.summary(np.array([1], dtype=np.int32))
    assert b is not a and (b.program, b.nonneutral, b.flagged) == (False, False, False)
    f.set(1, TransformProgram(temperature=0.7, top_k=5), ["presence_penalty=0.5"])
    c = f.summary(rows)
    assert c is not a and c.recorded is None and (c.program, c.nonneutral, c.flagged) == (True, True, True)
    assert f.summary(np.array([0, 8], dtype=np.int32)) is None


def test_mrv2_programs_recorded_once_per_epoch():
    """The rows' programs go to the programs RPC once per (head, epoch): the first step records the rows with a
    program, later steps nothing, and after the RPC drains them (epoch bump) they are recorded again."""
    import numpy as np

    from fused_logp.kernel.transforms import TransformProgram
    from fused_logp.vllm_plugin.mrv2_sampler import _Flags
    from fused_logp.vllm_plugin.settings import PluginSettings
    from fused_logp.vllm_plugin.state import HeadState

    st = HeadState(PluginSettings(strict=True, backend="oracle", capture=False, source="test"))
    f = _Flags(8)
    p0 = TransformProgram(temperature=0.7)
    f.set(0, p0, [])
    f.set(3, None, [])
    rows = np.array([3, 0], dtype=np.int32)
    progs, req_ids = {0: p0, 3: None}, ["r3", "r0"]
    assert f.to_record(f.summary(rows), rows, req_ids, progs, st) == (["r0"], [p0])
    assert f.to_record(f.summary(rows), rows, req_ids, progs, st) == ((), ())
    st.programs_epoch += 1
    assert f.to_record(f.summary(rows), rows, req_ids, progs, st) == (["r0"], [p0])
    only_plain = np.array([3], dtype=np.int32)
    assert f.to_record(f.summary(only_plain), only_plain, ["r3"], progs, st) == ((), ())


def test_v1_row_batch_once_per_composition_and_epoch():
    """The V1 runner's RowBatch: the same rows (request ids in row order, with or without programs) reuse it; the
    program groups are computed once per vocabulary size; the rows' programs are recorded for the programs RPC
    once per (head, epoch) and again after the RPC drains them (epoch bump)."""
    from fused_logp.kernel.transforms import TransformProgram
    from fused_logp.vllm_plugin.scoring import program_groups
    from fused_logp.vllm_plugin.settings import PluginSettings
    from fused_logp.vllm_plugin.state import HeadState, RowBatch

    k5, plain = TransformProgram(temperature=0.7, top_k=5), TransformProgram(temperature=0.7)
    rb = RowBatch(["a", "b", "c"], [k5, plain, None])
    assert rb.same_rows(["a", "b", "c"], True) and not rb.same_rows(["a", "c", "b"], True)
    assert not rb.same_rows(["a", "b", "c"], False) and not rb.all_programs
    assert RowBatch(["a"], [plain]).all_programs and not RowBatch(["a"], None).all_programs
    g = rb.groups(100, program_groups)
    assert g == program_groups(rb.programs, 100) == {k5: [0]} and rb.groups(100, program_groups) is g
    assert rb.groups(3, program_groups) == {} and RowBatch(["a"], None).to_record(None) is None
    st = HeadState(PluginSettings(strict=True, backend="auto", capture=False, source="test"))
    rec = rb.to_record(st)
    assert rec == (["a", "b", "c"], [k5, plain, None])
    st.record_programs(*rec)
    rb.mark_recorded(st)
    assert rb.to_record(st) == ([], []) and set(st.programs) == {"a", "b"}
    st.programs.clear()
    st.programs_epoch += 1                                      # what the programs RPC does when it drains
    assert rb.to_record(st) == (["a", "b", "c"], [k5, plain, None])
    other = HeadState(PluginSettings(strict=True, backend="auto", capture=False, source="test"))
    assert rb.to_record(other)[0] == ["a", "b", "c"]


def test_all_unit_temperature_decided_once_per_temperature_bytes():
    """all_unit_temperature is a function of the host temperatures' binary32 bytes (memoised): the same answers
    as shared_contract.sampling.scoring_temperatures, first call and repeated, views included."""
    import numpy as np

    from fused_logp.shared_contract.sampling import scoring_temperatures
    from fused_logp.vllm_plugin.scoring import all_unit_temperature

    cases = [[1.0, 0.0, 1.0, 1e-6], [1.0, 0.7], [1.0, 1e-5], [1.0, 9.9e-6], [1.0000001, 1.0], [1.0], [0.0] * 5]
    for vals in cases:
        a = np.array(vals, dtype=np.float32)
        want = bool(scoring_temperatures(torch.from_numpy(a), len(vals)).eq(1.0).all())
        assert all_unit_temperature(a) is want and all_unit_temperature(a.copy()) is want
        assert all_unit_temperature(np.array(vals, dtype=np.float64)) is want     # read as binary32
    big = np.array([0.7, 1.0, 1.0, 0.0], dtype=np.float32)
    assert all_unit_temperature(big[1:]) and not all_unit_temperature(big[:2])


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_cpu_argument_checks_refuse_as_before(dtype):
    """The CPU checks of targets and temperature (one reduction each) refuse exactly what they refused, naming the
    first bad value; valid int32 targets still reach the backend as int64 with the same bytes."""
    from fused_logp import logp_from_logits
    from fused_logp.shared_contract.errors import ContractInputError

    g = torch.Generator().manual_seed(5)
    z = torch.randn(3, 70, generator=g)
    for bad, shown in (([1, -2, 3], "-2"), ([1, 70, 3], "70"), ([[0, 1], [2, 70], [69, 0]], "70")):
        with pytest.raises(ContractInputError, match=rf"targets must lie in the real vocabulary \[0, 70\); got {shown}"):
            logp_from_logits(z, torch.tensor(bad, dtype=dtype), backend="oracle-fast")
    ok = torch.tensor([0, 69, 5], dtype=dtype)
    for t in ([0.7, float("nan"), 1.0], [0.7, 1.0, float("inf")], [0.0, 1.0, 1.0], [1.0, -0.5, 1.0],
              [float("-inf"), 1.0, 1.0]):
        with pytest.raises(ContractInputError, match="temperature must be finite and > 0"):
            logp_from_logits(z, ok, temperature=torch.tensor(t), backend="oracle-fast")
    t = torch.tensor([0.7, 1.3, 1.0])
    a = logp_from_logits(z, ok, temperature=t, backend="oracle-fast")
    b = logp_from_logits(z, ok.to(torch.int64), temperature=t.to(torch.float64), backend="oracle")
    assert torch.equal(a.logp.view(torch.int32), b.logp.view(torch.int32))
    assert a.provenance.backend == "oracle-fast" and b.provenance.backend == "oracle"


def test_host_scoring_temperature_equals_effective_temperature():
    """The V1 wrapper's per-row scoring temperature from vLLM's host copy: the bytes of effective_temperature on
    the same values (greedy rows at 1, the SAMPLING_EPS boundary in binary32), made once per batch and reused."""
    import numpy as np

    from fused_logp.vllm_plugin.scoring import effective_temperature, host_scoring_temperature

    for vals in ([0.7, 0.0, 1.3, 1e-6], [1.0, 1e-5, 9.9e-6, 2.5], [0.7]):
        a = np.array(vals, dtype=np.float32)
        want = effective_temperature(torch.from_numpy(a.copy()), len(vals), "cpu")
        got = host_scoring_temperature(a, torch.device("cpu"))
        assert got.dtype == torch.float32 and torch.equal(got.view(torch.int32), want.view(torch.int32))
        assert host_scoring_temperature(a.copy(), torch.device("cpu")) is got
        a[0] = 0.5                                              # other values: another tensor, not a stale one
        assert host_scoring_temperature(a, torch.device("cpu"))[0] == 0.5 and got[0] == want[0]


def test_mrv2_token_logprobs_are_the_contract_columns():
    """Inside a sampler step that set a job, vLLM's compute_token_logprobs (the kernel its compute_topk_scores calls
    by name) returns the contract columns of the step's raw logits: the bytes rescore() gives, at T = 1 from the
    head statistics and at the rows' temperatures from a second pass. The wrapper is installed on the module
    attribute that compute_topk_scores looks up. (vLLM's own kernel is Triton and does not run on the CPU.)"""
    from vllm.v1.outputs import LogprobsTensors
    from vllm.v1.worker.gpu.sample import logprob

    from fused_logp.vllm_plugin import capability
    from fused_logp.vllm_plugin.mrv2_sampler import _Job, _job, install_token_logprobs
    from fused_logp.vllm_plugin.scoring import rescore
    from fused_logp.vllm_plugin.settings import PluginSettings
    from fused_logp.vllm_plugin.state import HeadState, Mark

    assert capability.mrv2_token_logprobs_shape(logprob)
    if not hasattr(logprob.compute_token_logprobs, "__wrapped__"):
        install_token_logprobs()
    assert "compute_token_logprobs" in logprob.compute_topk_scores.__code__.co_names
    g = torch.Generator().manual_seed(11)
    n, d, v = 5, 64, 333
    h = torch.randn(n, d, generator=g).to(torch.bfloat16)
    w = torch.randn(v, d, generator=g).to(torch.bfloat16)
    stats = _head_call(h, w)
    z = stats.logits
    ids = torch.randint(0, v, (n, 3), generator=g)
    temps = torch.tensor([1.0, 0.7, 1.0, 1.3, 0.5])
    for unit, temp in ((True, torch.ones(n)), (False, temps)):
        st = HeadState(PluginSettings(strict=True, backend="auto", capture=False, source="test"))
        _job.job = job = _Job(z, Mark(st, None, stats), unit, lambda: temp)
        try:
            got = logprob.compute_token_logprobs(z, ids)
        finally:
            _job.job = None
        assert job.scored and st.rows_rescored == n and st.rows_head_stats == (n if unit else 0)
        lt = LogprobsTensors(ids, torch.full((n, 3), -1.0), torch.zeros(n, dtype=torch.int64))
        ref = rescore(lt, z, lambda: temp, Mark(HeadState(st.settings), None, stats), unit_temperature=unit)
        assert torch.equal(got.view(torch.int32), ref.logprobs.view(torch.int32))
        if not unit:
            assert not torch.equal(got[1], rescore(lt, z, lambda: torch.ones(n), Mark(HeadState(st.settings), None,
                                                                                     stats)).logprobs[1])


def test_capture_ack_never_drops_unread_rows():
    """fused_logp_captured_ack(n) drops at most the rows a clear=False read returned, whatever n is, also when
    rows arrived after the read or the bound dropped some of them."""
    from fused_logp.vllm_plugin.state import CaptureBuffer

    b = CaptureBuffer(limit=5)
    for i in range(3):
        b.append({"i": i})
    assert [r["i"] for r in b.peek()] == [0, 1, 2]
    b.append({"i": 3})                                   # after the read: unread
    assert b.ack(100) == 3 and [r["i"] for r in b.rows] == [3]
    assert b.ack(100) == 0 and len(b) == 1               # nothing sent and unacknowledged
    for i in range(4, 9):
        b.append({"i": i})                               # the bound drops the oldest
    assert [r["i"] for r in b.peek(2)] == [4, 5]
    b.append({"i": 9})                                   # drops 4, which was sent
    assert b.sent_unacked() == 1 and b.ack(5) == 1 and [r["i"] for r in b.rows] == [6, 7, 8, 9]
