"""Megatron plugin at world size 2 (spawned processes, gloo): TP=2 bytes equal the TP=1 op, gradients with the
hidden-state gradient reduced exactly once (TP and sequence parallel), shard-invariant fingerprint, and
context parallelism as row ownership."""
from __future__ import annotations

import copy
import os
import sys
import tempfile
import warnings

import pytest
import torch

pytest.importorskip("megatron.core")

import megatron_shims as ms  # noqa: E402

PADDED, REAL, B, S, D, T = 512, 500, 2, 8, 64, 0.7


def _reference(h2, w_full, targets, mask_rows, c_lse):
    """float64 gradients of -(sum logp) + c_lse * sum(lse) over masked-in rows."""
    h64 = h2.detach().double().requires_grad_()
    w64 = w_full.detach().double().requires_grad_()
    z = (h64 @ w64[:REAL].t()) / T
    lse = torch.logsumexp(z, 1)
    logp = z.gather(1, targets.clamp(0, REAL - 1)[:, None]).squeeze(1) - lse
    m = mask_rows.double()
    (-(logp * m).sum() + c_lse * (lse * m).sum()).backward()
    return h64.grad, w64.grad


def _close(got, ref):
    got, ref = got.double(), ref.double()
    tol = ref.abs() * 2 ** -7 + ref.abs().max() * 2 ** -7
    return bool(((got - ref).abs() <= tol).all())


def _tp_checks(rank, res):
    import fused_logp
    from fused_logp import megatron_plugin as mp
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear

    tp_group = parallel_state.get_tensor_model_parallel_group()
    mp.configure("contract", temperature=T, vocab_size=REAL)
    mp.install()

    # whole model, tied embeddings: bytes of the TP=2 plugin == the TP=1 op on the same hidden states and weight
    wrapped, gpt = ms.build_tiny_gpt(vocab_size=PADDED, tied=True, tp=2)
    ids, pos, mask, labels = ms.batch(B, S, REAL, seed=3)
    loss_mask = torch.ones(B, S)
    loss_mask[1, :2] = 0
    cap = ms.CaptureFinalHidden(gpt, retain_grad=True)
    out = wrapped(ids, pos, mask, labels=labels, loss_mask=loss_mask)
    cap.remove()
    keep = loss_mask.t().reshape(-1) != 0
    h2 = cap.value.detach().reshape(-1, D)
    targets = labels.t().reshape(-1)
    w_full = ms.gather_rows(gpt.shared_embedding_or_output_weight().detach(), tp_group)
    ref = fused_logp.linear_logp(h2[keep], w_full, targets[keep], temperature=T, vocab_size=REAL)
    res["tp2_logp_equal"] = torch.equal(out.logp.t().reshape(-1)[keep], ref.logp)
    res["tp2_lse_equal"] = torch.equal(out.lse.t().reshape(-1)[keep], ref.lse)
    res["tp2_logp"] = out.logp.detach().clone()
    res["fingerprint_tp2"] = mp.track_lm_head(wrapped).fingerprint
    res["fingerprint_tp1"] = fused_logp.weight_fingerprint(w_full, vocab_size=REAL)
    _scoring_checks(wrapped, gpt, w_full, res)

    # whole model, untied: final hidden-state gradient (reduced exactly once) and the lm_head shard's gradient
    wrapped, gpt = ms.build_tiny_gpt(vocab_size=PADDED, tied=False, tp=2, seed=8)
    cap = ms.CaptureFinalHidden(gpt, retain_grad=True)
    out = wrapped(ids, pos, mask, labels=labels, loss_mask=loss_mask)
    cap.remove()
    (-(out.logp * loss_mask).sum() + 0.3 * (out.lse * loss_mask).sum()).backward()
    w_shard = gpt.output_layer.weight
    w_full = ms.gather_rows(w_shard.detach(), tp_group)
    gh, gw = _reference(cap.value.detach().reshape(-1, D), w_full, targets, keep, 0.3)
    v0 = rank * w_shard.shape[0]
    res["tp2_hidden_grad_close"] = _close(cap.value.grad.reshape(-1, D), gh)
    res["tp2_weight_grad_close"] = _close(w_shard.grad.float()[: max(0, REAL - v0)],
                                          gw[v0:min(REAL, v0 + w_shard.shape[0])])
    res["tp2_padding_grad_zero"] = bool((w_shard.grad[max(0, REAL - v0):] == 0).all())
    ln = gpt.decoder.final_layernorm.weight.grad
    res["tp2_final_norm_grad"] = ln.detach().clone()

    # sequence parallelism at the output-processor level: [s/TP, b, h] in, gather, reduce-scatter of dh
    cfg = copy.copy(gpt.config)
    cfg.sequence_parallel = True
    head = ColumnParallelLinear(D, PADDED, config=cfg, init_method=cfg.init_method, bias=False,
                                gather_output=False, tp_group=tp_group)
    g = torch.Generator().manual_seed(17)
    h_full = (torch.randn(S, B, D, generator=g) * 0.5).bfloat16()
    lab = torch.randint(0, REAL, (B, S), generator=g)
    h_local = h_full[rank * S // 2:(rank + 1) * S // 2].clone().requires_grad_()
    out = mp.logp_output_processor(hidden_states=h_local, output_layer=head, labels=lab, config=cfg)
    (-(out.logp).sum() + 0.3 * out.lse.sum()).backward()
    w_full = ms.gather_rows(head.weight.detach(), tp_group)
    ref = fused_logp.linear_logp(h_full.reshape(-1, D), w_full, lab.t().reshape(-1), temperature=T, vocab_size=REAL)
    res["sp_logp_equal"] = torch.equal(out.logp.t().reshape(-1), ref.logp)
    res["sp_lse_equal"] = torch.equal(out.lse.t().reshape(-1), ref.lse)
    gh, _ = _reference(h_full.reshape(-1, D), w_full, lab.t().reshape(-1), torch.ones(S * B, dtype=torch.bool), 0.3)
    gh = gh.reshape(S, B, D)[rank * S // 2:(rank + 1) * S // 2]
    res["sp_hidden_grad_close"] = _close(h_local.grad, gh)
    mp.uninstall()


def _scoring_checks(wrapped, gpt, w_full, res):
    """The public scoring API at TP=2 (plugin off process-wide): the TP=1 op's bytes on the same hidden states,
    for a temperature and for a truncating program; the fingerprint of the unsharded head attached."""
    import fused_logp
    from fused_logp import megatron_plugin as mp
    from fused_logp.kernel.op import linear_logp_program
    from fused_logp.kernel.transforms import TransformProgram

    mp.configure(None)
    tokens = ms.token_batch(B, S, REAL, seed=12)[0]
    cap = ms.CaptureFinalHidden(gpt)
    sc = mp.score(wrapped, tokens, temperature=T, vocab_size=REAL)
    h = cap.value.detach()
    prog = TransformProgram(temperature=T, top_k=300)
    with torch.no_grad():
        logits = gpt(tokens, torch.arange(S).expand(B, S), ms.causal_mask(B, S))       # [b, s, V/TP] shard
    cap.remove()
    full_logits = ms.gather_rows(logits.transpose(0, 2).contiguous(), parallel_state_tp()).transpose(0, 2)
    targets = full_logits[..., :REAL].argmax(-1)
    sp = mp.score(wrapped, tokens, targets, program=prog, vocab_size=REAL)
    keep = sc.loss_mask.t().reshape(-1) != 0
    ref = fused_logp.linear_logp(h.reshape(-1, D)[keep], w_full, sc.targets.t().reshape(-1)[keep], temperature=T,
                                 vocab_size=REAL)
    res["score_tp2_equal_tp1"] = (torch.equal(sc.logp.t().reshape(-1)[keep], ref.logp)
                                  and torch.equal(sc.lse.t().reshape(-1)[keep], ref.lse))
    refp = linear_logp_program(h.reshape(-1, D), w_full, targets.t().reshape(-1), prog, vocab_size=REAL)
    res["score_program_tp2_equal_tp1"] = (torch.equal(sp.logp.t().reshape(-1), refp.logp)
                                          and torch.equal(sp.lse.t().reshape(-1), refp.lse))
    rows = h.reshape(-1, D)[keep]
    sh = mp.score_hidden_states(wrapped, rows, sc.targets.t().reshape(-1)[keep], temperature=T, vocab_size=REAL)
    res["score_hidden_tp2_equal_tp1"] = torch.equal(sh.logp, ref.logp) and torch.equal(sh.lse, ref.lse)
    res["score_fingerprint_tp1"] = sc.fingerprint == fused_logp.weight_fingerprint(w_full, vocab_size=REAL)
    res["score_logp"] = sc.logp.clone()
    mp.configure("contract", temperature=T, vocab_size=REAL)


def parallel_state_tp():
    from megatron.core import parallel_state
    return parallel_state.get_tensor_model_parallel_group()


def _cp_split(batch, cp_group):
    """Megatron's own CP split of a [b, s, ...] batch (no packed sequences)."""
    import inspect

    from megatron.core.utils import get_batch_on_this_cp_rank

    if "is_hybrid_cp" in inspect.signature(get_batch_on_this_cp_rank).parameters:     # a required argument in 0.19
        return get_batch_on_this_cp_rank(batch, is_hybrid_cp=False, cp_group=cp_group)
    return get_batch_on_this_cp_rank(batch, cp_group=cp_group)


def _cp_checks(rank, res):
    import fused_logp
    from fused_logp import megatron_plugin as mp
    from megatron.core import parallel_state

    cp_group = parallel_state.get_context_parallel_group()
    mp.configure("contract", temperature=T, vocab_size=REAL)
    _, gpt = ms.build_tiny_gpt(vocab_size=PADDED, tied=False, seed=5)
    g = torch.Generator().manual_seed(23)
    h_full = (torch.randn(S, B, D, generator=g) * 0.5).bfloat16()
    labels = torch.randint(0, REAL, (B, S), generator=g)
    loss_mask = torch.ones(B, S)
    loss_mask[0, 5] = 0
    local = _cp_split({"hidden": h_full.transpose(0, 1).contiguous(), "labels": labels, "loss_mask": loss_mask},
                      cp_group)
    out = mp.logp_output_processor(hidden_states=local["hidden"].transpose(0, 1).contiguous(),
                                   output_layer=gpt.output_layer, labels=local["labels"],
                                   loss_mask=local["loss_mask"], config=gpt.config)
    ref = fused_logp.linear_logp(h_full.reshape(-1, D), gpt.output_layer.weight.detach(), labels.t().reshape(-1),
                                 temperature=T, vocab_size=REAL)
    full_logp = ref.logp.view(S, B).t() * loss_mask
    full_lse = ref.lse.view(S, B).t() * loss_mask
    mine = _cp_split({"logp": full_logp, "lse": full_lse}, cp_group)
    res["cp_rows_equal"] = torch.equal(out.logp, mine["logp"]) and torch.equal(out.lse, mine["lse"])
    res["cp_gather_equal"] = torch.equal(mp.parallel.gather_context_parallel(out.logp, cp_group), full_logp)

    # the scoring API under CP=2: full sequences in, Megatron's load-balanced split, results back in sequence order.
    # (The local layer spec has no context-parallel attention, so each rank's attention sees its own chunks only:
    # this checks the API's row bookkeeping around the op, not attention.)
    mp.configure(None)
    wrapped, gpt = ms.build_tiny_gpt(vocab_size=PADDED, tied=True, seed=6)
    tokens = ms.token_batch(B, S, REAL, seed=31)[0]
    cap = ms.CaptureFinalHidden(gpt)
    sc = mp.score(wrapped, tokens, temperature=T, vocab_size=REAL)
    cap.remove()
    h_full = mp.parallel.gather_context_parallel(cap.value.detach().transpose(0, 1).contiguous(), cp_group)   # [b, s, d]
    keep = sc.loss_mask != 0
    ref = fused_logp.linear_logp(h_full[keep], ms.lm_head_weight(gpt).detach(), sc.targets[keep], temperature=T,
                                 vocab_size=REAL)
    res["cp_score_shape"] = tuple(sc.logp.shape) == (B, S) and torch.equal(sc.targets[:, :-1], tokens[:, 1:])
    res["cp_score_equal_op"] = torch.equal(sc.logp[keep], ref.logp) and torch.equal(sc.lse[keep], ref.lse)


def worker(rank, port, outdir):
    warnings.filterwarnings("ignore")
    res = {}
    try:
        ms.start_model_parallel(rank, 2, tp=2, device="cpu", port=port)
        _tp_checks(rank, res)
        ms.start_model_parallel(rank, 2, tp=1, cp=2, device="cpu", port=port)
        _cp_checks(rank, res)
    except BaseException as exc:                       # reported by the parent
        import traceback
        res["error"] = "".join(traceback.format_exception(exc))
    finally:
        torch.save(res, os.path.join(outdir, f"rank{rank}.pt"))
        ms.stop_model_parallel()


@pytest.fixture(scope="module")
def results():
    import torch.multiprocessing as tmp

    here = os.path.dirname(os.path.abspath(__file__))
    if here not in sys.path:
        sys.path.insert(0, here)
    with tempfile.TemporaryDirectory() as outdir:
        tmp.spawn(worker, args=(ms.free_port(), outdir), nprocs=2, join=True)
        res = [torch.load(os.path.join(outdir, f"rank{r}.pt"), weights_only=False) for r in range(2)]
    for r in res:
        assert "error" not in r, r["error"]
    return res


@pytest.mark.parametrize("key", ["tp2_logp_equal", "tp2_lse_equal", "sp_logp_equal", "sp_lse_equal"])
def test_tp2_bytes_equal_tp1_op(results, key):
    assert all(r[key] for r in results)


def test_tp2_ranks_agree(results):
    assert torch.equal(results[0]["tp2_logp"], results[1]["tp2_logp"])
    assert torch.equal(results[0]["score_logp"], results[1]["score_logp"])


@pytest.mark.parametrize("key", ["score_tp2_equal_tp1", "score_program_tp2_equal_tp1", "score_hidden_tp2_equal_tp1",
                                 "score_fingerprint_tp1"])
def test_scoring_api_tp2_equals_tp1_bytes(results, key):
    assert all(r[key] for r in results)


@pytest.mark.parametrize("key", ["tp2_hidden_grad_close", "tp2_weight_grad_close", "tp2_padding_grad_zero",
                                 "sp_hidden_grad_close"])
def test_tp2_gradients(results, key):
    assert all(r[key] for r in results)


def test_tp2_replicated_grads_agree(results):
    assert torch.equal(results[0]["tp2_final_norm_grad"], results[1]["tp2_final_norm_grad"])


def test_fingerprint_shard_invariant(results):
    assert results[0]["fingerprint_tp2"] == results[1]["fingerprint_tp2"] == results[0]["fingerprint_tp1"]


@pytest.mark.parametrize("key", ["cp_rows_equal", "cp_gather_equal", "cp_score_shape", "cp_score_equal_op"])
def test_context_parallel_row_ownership(results, key):
    assert all(r[key] for r in results)
