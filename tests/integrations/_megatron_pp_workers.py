"""MoETerms under megatron-core's pipelined schedules (run by spawn; must be importable by the children).

The model: ``GPTModel`` with 4 MoE layers + MTP depth 1 and tied embeddings (_megatron_gpt_workers.DEEP),
float64, built per model chunk the way Megatron-LM's ``model_provider`` does (``pre/post_process`` and
``vp_stage`` per chunk, the MTP block on the last chunk of the last stage), trained two steps by
``get_forward_backward_func()``: ``forward_backward_pipelining_without_interleaving`` for PP2,
``forward_backward_pipelining_with_interleaving`` for PP2×VPP2 (one data iterator per chunk), then
``finalize_model_grads`` (the tied embedding's gradient all-reduced between the first and the last stage).
CPU bridges: those of _megatron_gpt_workers, ``torch.cuda.synchronize`` in ``p2p_communication`` included.
``batch_p2p_comm=False`` (see DEEP): gloo pairs the batched sends and receives per peer in posting order.
"""

from __future__ import annotations

from functools import partial

from _megatron_gpt_workers import (
    DEEP,
    S,
    _forward_step,
    _full_state,
    build_model,
    full_grad,
    global_name,
    install_cpu_bridges,
    make_config,
    microbatches,
    naive_reference,
    params,
)

BIAS_CASE = ("per_token", "global_lagged", True, "bias")


def run_pipelines(rank, world, plan, n_rows=8, mbs=2, steps=2):
    """``plan``: entries ``(tp, cp, pp, vpp, cases)`` or with a dict of extras (``naive``: (mode, scope)
    pairs of the hand-written objective on rank 0; ``split_error``: the error for 4 layers over pp×3 virtual
    stages). Returns per entry ``{case: [(logs, {name: full grad}, {router key: expert bias}), ...per step]}``."""
    from megatron.core import parallel_state as ps

    install_cpu_bridges()
    full = _full_state(deep=True)
    out = []
    for tp, cp, pp, vpp, cases, *more in plan:
        extra = more[0] if more else {}
        ps.initialize_model_parallel(
            tensor_model_parallel_size=tp,
            context_parallel_size=cp,
            pipeline_model_parallel_size=pp,
            virtual_pipeline_model_parallel_size=vpp,
        )
        try:
            res = {case: _pp_case(case, tp, cp, pp, vpp, full, n_rows, mbs, steps) for case in cases}
            if extra.get("naive") and rank == 0:
                res["naive"] = {
                    pair: naive_reference((*pair, None, None), n_rows, mbs, steps, deep=True) for pair in extra["naive"]
                }
            if extra.get("split_error"):
                res["split_error"] = _split_error(tp, cp, pp)
        finally:
            ps.destroy_model_parallel()
        out.append(res)
    return out


def _config(tp, cp, pp, vpp, per_token, kind):
    over = dict(DEEP)
    if kind == "bias":  # aux-loss-free expert biases (sigmoid scores), updated by Megatron's finalize_model_grads
        over.update(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True)
    if pp > 1:
        over["pipeline_model_parallel_size"] = pp
    if vpp:
        over["virtual_pipeline_model_parallel_size"] = vpp
    return make_config(tp=tp, cp=cp, per_token=per_token, **over)


def _split_error(tp, cp, pp):
    """The error of check_pipeline_split for 4 layers over ``pp`` stages × 3 virtual stages (config only)."""
    from lossparity.integrations.megatron import check_pipeline_split

    try:
        check_pipeline_split(_config(tp, cp, pp, 3, True, None))
    except ValueError as exc:
        return f"ValueError: {exc}"
    return None


def _pp_case(case, tp, cp, pp, vpp, full, n_rows, mbs, steps):
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from lossparity.integrations.megatron import LossFunc, MoETerms, check_pipeline_split

    mode, scope, per_token, kind = case
    config = _config(tp, cp, pp, vpp, per_token, kind)
    check_pipeline_split(config)  # before any chunk is built
    chunks = [build_model(config, tp, full, vp_stage=v, share=True) for v in (range(vpp) if vpp else [None])]
    terms = MoETerms(chunks, config, aux_scope=scope)
    loss_fn = LossFunc(mode, config=config, terms=terms)
    tp_group = ps.get_tensor_model_parallel_group()
    out = []
    for step in range(steps):
        rows, (tokens, pos, labels, mask, seg), whole = microbatches(step, n_rows, mbs)
        data = [(tokens[r], pos[r], labels[r], mask[r], seg[r]) for r in rows]
        terms.begin_step([w for w, _ in whole], segment_ids=[sg for _, sg in whole])
        get_forward_backward_func()(
            forward_step_func=partial(_forward_step, loss_fn),
            # the interleaved schedule takes one iterator per chunk (each chunk reads every microbatch)
            data_iterator=[iter(data) for _ in chunks] if vpp else iter(data),
            model=chunks,
            num_microbatches=len(data),
            seq_length=S,
            micro_batch_size=mbs,
        )
        logs = terms.end_step()
        grads, biases = {}, {}
        for c in chunks:
            for n, p in params(c.module):
                grads[global_name(n, c.module)] = full_grad(p, tp_group)
            for n, m in c.module.named_modules():
                if getattr(m, "expert_bias", None) is not None:
                    biases[("mtp" in n.split("."), int(m.layer_number))] = m.expert_bias.clone()
        out.append((logs, grads, biases))
        for c in chunks:
            c.zero_grad_buffer()
    return out
