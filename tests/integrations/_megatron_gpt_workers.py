"""Real megatron-core ``GPTModel`` (local spec, 2 MoE layers + MTP depth 1, 4 experts top-2, hidden 32,
sequence 32, float64) trained for two steps by Megatron's ``forward_backward_no_pipelining`` and
``finalize_model_grads`` on CPU gloo ranks (run by spawn; must be importable by the children).

CPU bridges (test-only; the library never patches Megatron), each standing in for a CUDA-only call:
``device="cuda"`` allocations → CPU, ``torch.cuda.current_device`` → ``"cpu"``, ``Tensor.cuda`` /
``pin_memory`` → identity, the tensor-parallel RNG tracker's ``fork``/``add`` and the CUDA RNG state
save/restore → no-ops (dropout is 0, so no random stream is used), ``moe_utils.te_general_gemm`` → None.
Megatron's ``DistributedDataParallel`` allocates CUDA buffers: :class:`CPUDDP` provides what
``finalize_model_grads`` calls on it, with its reduction: the gradients summed over DP×CP, then multiplied
by ``1/(dp·cp)`` when ``calculate_per_token_loss=False`` (Megatron's ``gradient_scaling_factor``).
The torch LayerNorm wrapper refuses sequence parallelism: the bridge builds the same ``torch.nn.LayerNorm``
and marks its weights ``sequence_parallel`` (what ``finalize_model_grads`` all-reduces over TP).
"""

from __future__ import annotations

import contextlib
from functools import partial

import torch
import torch.distributed as dist
from torch import nn

V, S, H, E, TOPK = 64, 32, 32, 4, 2
ALPHA, BETA, LAM = 0.01, 0.001, 0.3
# the pipeline model: 4 MoE layers (+ the MTP layer), tied embeddings (build_model(share=True)); gloo pairs
# messages per peer in posting order, so with batch_p2p_comm=True PP2×VPP2 (previous and next stage on the
# same rank) swaps same-shaped activations and gradients: the sends and receives go one by one
DEEP = dict(num_layers=4, batch_p2p_comm=False)


def install_cpu_bridges() -> None:
    """The CPU stand-ins of the module docstring (idempotent)."""
    import megatron.core.tensor_parallel.random as mrand
    from megatron.core.transformer import torch_norm
    from megatron.core.transformer.moe import moe_utils

    if getattr(torch, "_lp_bridged", False):
        return
    for name in ["zeros", "empty", "ones", "tensor", "arange", "full"]:
        real = getattr(torch, name)

        def wrap(*a, _f=real, **k):
            if "cuda" in str(k.get("device", "")):
                k["device"] = "cpu"
            k.pop("pin_memory", None)
            return _f(*a, **k)

        setattr(torch, name, wrap)
    torch.cuda.current_device = lambda: "cpu"
    torch.Tensor.cuda = lambda self, *a, **k: self
    torch.Tensor.pin_memory = lambda self, *a, **k: self
    mrand.CudaRNGStatesTracker.fork = lambda self, name="model-parallel-rng": contextlib.nullcontext()
    mrand.CudaRNGStatesTracker.add = lambda self, name, seed: None
    mrand._set_cuda_rng_state = lambda *a, **k: None
    mrand._get_cuda_rng_state = lambda *a, **k: torch.zeros(1)
    torch.cuda.get_rng_state = lambda *a, **k: torch.zeros(1)
    torch.cuda.set_rng_state = lambda *a, **k: None
    torch.cuda.synchronize = lambda *a, **k: None  # pipelined schedules only (p2p_communication)
    moe_utils.te_general_gemm = None
    torch_norm.WrappedTorchNorm.__new__ = staticmethod(_torch_norm_with_sp)
    torch._lp_bridged = True


def _torch_norm_with_sp(cls, config, hidden_size, eps=1e-5, **unused):
    """torch LayerNorm, its weights marked sequence-parallel (torch_norm refuses SP outright)."""
    norm = torch.nn.LayerNorm(hidden_size, eps=eps)
    for p in norm.parameters():
        p.sequence_parallel = config.sequence_parallel
    return norm


class CPUDDP(nn.Module):
    """What ``finalize_model_grads`` calls on Megatron's DDP wrapper (module docstring)."""

    def __init__(self, module, config):
        super().__init__()
        from megatron.core.distributed import DistributedDataParallelConfig

        self.module, self.config = module, config
        self.ddp_config = DistributedDataParallelConfig()

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def set_input_tensor(self, t):
        self.module.set_input_tensor(t)

    def finish_grad_sync(self, force_all_reduce=False):
        from megatron.core import parallel_state as ps

        group = ps.get_data_parallel_group(with_context_parallel=True)
        for p in self.module.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad, group=group)
                if not self.config.calculate_per_token_loss:
                    p.grad.mul_(1.0 / dist.get_world_size(group))

    def scale_gradients(self, scaling):
        for p in self.module.parameters():
            if p.grad is not None:
                p.grad.mul_(scaling)

    def zero_grad_buffer(self):
        for p in self.module.parameters():
            p.grad = None


class _GatherFromCP(torch.autograd.Function):
    """All-gather along the sequence dim over CP; backward sums the full gradient and keeps the own part."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=0)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad.chunk(dist.get_world_size(ctx.group), dim=0)[dist.get_rank(ctx.group)], None


def cp_positions(rank, cp, seq):
    """Global positions of CP rank ``rank``'s tokens: chunks ``rank`` and ``2cp-1-rank`` of ``2cp``."""
    c = seq // (2 * cp)
    return torch.cat(
        [torch.arange(rank * c, (rank + 1) * c), torch.arange((2 * cp - 1 - rank) * c, (2 * cp - rank) * c)]
    )


def cp_shard(x, rank, cp):
    """This CP rank's part of ``[b, S]`` rows (Megatron's get_batch_on_this_cp_rank layout)."""
    return x[:, cp_positions(rank, cp, x.shape[1])]


class CPGatherAttention(nn.Module):
    """Causal dot-product attention for context parallelism without Transformer Engine (test-only):
    keys and values are all-gathered over the CP group, the causal mask uses global positions."""

    def __init__(
        self,
        config,
        layer_number,
        attn_mask_type,
        attention_type,
        attention_dropout=None,
        softmax_scale=None,
        cp_comm_type=None,
        pg_collection=None,
    ):
        super().__init__()
        self.config = config
        self.scale = softmax_scale or (config.kv_channels**-0.5)

    def forward(
        self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None, packed_seq_params=None
    ):
        from megatron.core import parallel_state as ps

        group, cp = ps.get_context_parallel_group(), ps.get_context_parallel_world_size()
        seq = query.shape[0] * cp
        k, v = _GatherFromCP.apply(key, group), _GatherFromCP.apply(value, group)
        q_pos = cp_positions(ps.get_context_parallel_rank(), cp, seq)
        k_pos = torch.cat([cp_positions(r, cp, seq) for r in range(cp)])
        rep = query.shape[2] // k.shape[2]
        k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
        scores = torch.einsum("sbhd,tbhd->bhst", query, k) * self.scale
        scores = scores.masked_fill(k_pos[None, :] > q_pos[:, None], float("-inf"))
        ctx = torch.einsum("bhst,tbhd->sbhd", scores.softmax(-1), v)
        return ctx.reshape(ctx.shape[0], ctx.shape[1], -1)


def make_config(tp=1, cp=1, per_token=True, recompute=None, **over):
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.transformer.transformer_config import TransformerConfig

    kw = dict(
        num_layers=2,
        hidden_size=H,
        num_attention_heads=4,
        ffn_hidden_size=64,
        moe_ffn_hidden_size=16,
        num_moe_experts=E,
        moe_router_topk=TOPK,
        moe_aux_loss_coeff=ALPHA,
        moe_z_loss_coeff=BETA,
        moe_router_load_balancing_type="aux_loss",
        moe_token_dispatcher_type="allgather",
        mtp_num_layers=1,
        mtp_loss_scaling_factor=LAM,
        calculate_per_token_loss=per_token,
        params_dtype=torch.float64,
        pipeline_dtype=torch.float64,
        use_cpu_initialization=True,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=tp,
        context_parallel_size=cp,
        sequence_parallel=tp > 1,
        finalize_model_grads_func=finalize_model_grads,
    )
    if recompute == "full":
        kw.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    elif recompute == "selective":
        kw.update(recompute_granularity="selective", recompute_modules=["moe", "core_attn"])
    kw.update(over)
    return TransformerConfig(**kw)


def build_model(config, tp, full_state=None, vp_stage=None, share=False):
    """GPTModel, float64, the same weights for every layout (same seed, CPU master init then split).
    Pipeline stages: this stage's part (model chunk ``vp_stage`` under virtual stages, built like
    Megatron-LM's model_provider: pre/post_process of the chunk, the MTP block on the last chunk of the last
    stage), its weights copied from ``full_state`` (the one-stage model's). ``share``: tied embeddings."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec, get_gpt_mtp_block_spec
    from megatron.core.models.gpt.gpt_model import GPTModel

    torch.manual_seed(1234)
    spec = get_gpt_layer_local_spec(num_experts=E, moe_grouped_gemm=False)
    if config.context_parallel_size > 1:  # Megatron's own CP attention needs Transformer Engine
        spec.submodules.self_attention.submodules.core_attention = CPGatherAttention
    from megatron.core import parallel_state as ps

    pre = ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage)
    post = ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)
    mtp = get_gpt_mtp_block_spec(config, spec, use_transformer_engine=False, vp_stage=vp_stage) if post else None
    extra = {"vp_stage": vp_stage} if vp_stage is not None else {}
    gpt = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=V,
        max_sequence_length=S,
        mtp_block_spec=mtp,
        position_embedding_type="rope",
        pre_process=pre,
        post_process=post,
        share_embeddings_and_output_weights=share,
        **extra,
    )
    gpt.double()
    if full_state is not None:
        with torch.no_grad():
            tp_rank = ps.get_tensor_model_parallel_rank()
            for name, p in params(gpt):
                w = full_state[global_name(name, gpt)]
                if getattr(p, "tensor_model_parallel", False) and tp > 1:  # this TP rank's part
                    w = w.chunk(tp, dim=p.partition_dim)[tp_rank]
                p.copy_(w)
    return CPUDDP(gpt, config)


def params(gpt):
    """``gpt.named_parameters()`` less the output layer's own weight on a last stage that shares the embedding
    and holds the MTP block: Megatron allocates it there but uses the embedding's weight (its gradient stays
    None)."""
    dead = gpt.share_embeddings_and_output_weights and getattr(gpt, "mtp_process", False) and not gpt.pre_process
    for name, p in gpt.named_parameters():
        if dead and name == "output_layer.weight":
            assert p.grad is None, "the unused output_layer.weight got a gradient"
            continue
        yield name, p


def global_name(name, gpt):
    """The one-stage model's name of a parameter of the stage or chunk ``gpt`` (decoder layers are numbered
    per chunk; each layer's ``layer_number`` is the global one, from 1)."""
    import re

    def renumber(m):
        return f"decoder.layers.{gpt.decoder.layers[int(m[1])].layer_number - 1}."

    return re.sub(r"^decoder\.layers\.(\d+)\.", renumber, name)


def global_batch(step, n_rows=8):
    g = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, V, (n_rows, S), generator=g)
    labels = torch.randint(0, V, (n_rows, S), generator=g)
    lengths = torch.randint(S // 4, S + 1, (n_rows,), generator=g)
    pos = torch.arange(S)[None, :]
    mask = (pos < lengths[:, None]).double()
    cut = torch.randint(2, S - 2, (n_rows, 1), generator=g)
    seg = torch.where(pos < cut, 1, 2)
    return tokens, labels, mask, seg


def ragged_batch(step, n_rows=8):
    """:func:`global_batch` with hostile rows for context parallelism (CP2: the row cut into 4 chunks of
    ``S/4``, CP rank 0 holding chunks 0 and 3): microbatch 0 (rows 0, 1) has every LM and MTP loss token in
    chunk 0, so CP rank 1 holds none of them; row 1 is packed with a third document without any loss token;
    row 2's loss tokens all sit in chunk 1 (CP rank 1's)."""
    tokens, labels, mask, seg = global_batch(step, n_rows)
    c = S // 4
    mask[0:3] = 0.0
    mask[0, 1 : c - 1] = 1.0
    mask[1, 0 : c - 1] = 1.0
    seg[1] = torch.cat([torch.full((c // 2,), 1), torch.full((c - c // 2,), 2), torch.full((S - c,), 3)])
    mask[2, c + 1 : 2 * c - 1] = 1.0
    return tokens, labels, mask, seg


BATCHES = {"random": global_batch, "ragged": ragged_batch}


def _forward_step(loss_fn, data_iterator, model):
    tokens, pos, labels, mask, seg = next(data_iterator)
    out = model(tokens, pos, None, labels=labels, loss_mask=mask)
    return out, partial(loss_fn, mask, segment_ids=seg)


def full_grad(p, tp_group):
    """The parameter's gradient of the whole (un-split) weight: TP shards gathered along partition_dim."""
    g = p.grad if p.grad is not None else torch.zeros_like(p)
    if getattr(p, "tensor_model_parallel", False) and dist.get_world_size(tp_group) > 1:
        parts = [torch.empty_like(g) for _ in range(dist.get_world_size(tp_group))]
        dist.all_gather(parts, g.contiguous(), group=tp_group)
        return torch.cat(parts, dim=p.partition_dim)
    return g.clone()


def run_layout(
    rank, world, tp, cases, n_rows=8, mbs=2, steps=2, naive=(), bad=False, cp=1, pp=1, batch="random", depth=1
):
    """For each case ``(mode, scope, per_token, recompute)``: two steps of Megatron's schedule with
    MoETerms; returns ``{case: [(logs, {name: full grad}), ...per step]}`` of this rank, and with
    ``naive`` (``(mode, scope)`` pairs) the hand-written objective of each pair under ``"naive"`` (rank 0)."""
    install_cpu_bridges()
    from megatron.core import parallel_state as ps

    full = _full_state() if pp > 1 else None
    ps.initialize_model_parallel(
        tensor_model_parallel_size=tp, context_parallel_size=cp, pipeline_model_parallel_size=pp
    )
    try:
        kw = dict(n_rows=n_rows, mbs=mbs, steps=steps, cp=cp, pp=pp, full=full, batch=batch, depth=depth)
        res = {case: _run_case(rank, world, tp, *case, **kw) for case in cases}
        if naive and rank == 0:
            res["naive"] = {
                pair: naive_reference((*pair, None, None), n_rows, mbs, steps, batch, depth=depth) for pair in naive
            }
        if bad:
            res["bad"] = bad_inputs() if cp == 1 else bad_cp_inputs(cp)
        return res
    finally:
        ps.destroy_model_parallel()


def _full_state(deep=False):
    """The one-stage model's weights, which every pipeline stage copies its part of."""
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel()
    config = make_config(**DEEP) if deep else make_config()
    full = {n: p.detach().clone() for n, p in build_model(config, 1, share=deep).module.named_parameters()}
    ps.destroy_model_parallel()
    return full


def run_layouts(rank, world, plan):
    """Several layouts in the same processes (one start-up): ``plan`` is a list of ``(tp, cp, pp, cases)``
    or ``(tp, cp, pp, cases, extra)`` with ``extra`` more keyword arguments of :func:`run_layout`;
    returns one :func:`run_layout` result per entry."""
    return [run_layout(rank, world, e[0], e[3], cp=e[1], pp=e[2], **(e[4] if len(e) > 4 else {})) for e in plan]


def _doc_namespace():
    """The python block of docs/megatron.md, executed (what a pretrain_gpt.py-style script would hold)."""
    import pathlib
    import re

    text = (pathlib.Path(__file__).resolve().parents[2] / "docs" / "megatron.md").read_text()
    ns: dict = {}
    exec(compile(re.search(r"```python\n(.*?)```", text, re.S).group(1), "docs/megatron.md", "exec"), ns)
    return ns


def _run_case(
    rank,
    world,
    tp,
    mode,
    scope,
    per_token,
    recompute,
    *,
    n_rows,
    mbs,
    steps,
    cp=1,
    pp=1,
    full=None,
    batch="random",
    depth=1,
):
    """``recompute="doc"``: no recompute, the step driven by the functions of docs/megatron.md;
    ``"bias"``: sigmoid router with aux-loss-free expert biases."""
    from megatron.core import parallel_state as ps

    from lossparity.integrations.megatron import LossFunc, MoETerms

    doc = _doc_namespace() if recompute == "doc" else None
    # "bias": aux-loss-free expert biases (sigmoid scores), updated by Megatron's finalize_model_grads
    over = dict(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True) if recompute == "bias" else {}
    if pp > 1:
        over["pipeline_model_parallel_size"] = pp
    if depth != 1:
        over["mtp_num_layers"] = depth
    config = make_config(
        tp=tp, cp=cp, per_token=per_token, recompute=recompute if recompute in ("full", "selective") else None, **over
    )
    model = build_model(config, tp, full)
    if doc:
        terms, loss_fn = doc["build_loss"]([model], config, mode, scope)
    else:
        terms = MoETerms([model], config, aux_scope=scope)
        loss_fn = LossFunc(mode, config=config, terms=terms)
    out = []
    for step in range(steps):
        rows, (tokens, pos, labels, mask, seg), whole = microbatches(step, n_rows, mbs, batch)
        if doc:
            batches = [
                {
                    "tokens": tokens[r],
                    "position_ids": pos[r],
                    "labels": labels[r],
                    "loss_mask": mask[r],
                    "segment_ids": seg[r],
                    "row_loss_mask": w,
                    "row_segment_ids": sg,
                }
                for r, (w, sg) in zip(rows, whole)
            ]
            logs = doc["train_step"]([model], terms, loss_fn, batches, S, mbs)
        else:
            data = [(tokens[r], pos[r], labels[r], mask[r], seg[r]) for r in rows]
            logs = _step(terms, loss_fn, model, data, whole, mbs)
        tp_group = ps.get_tensor_model_parallel_group()
        grads = {global_name(n, model.module): full_grad(p, tp_group) for n, p in model.module.named_parameters()}
        biases = [m.expert_bias.clone() for m in model.modules() if getattr(m, "expert_bias", None) is not None]
        out.append((logs, grads, biases))
        model.zero_grad_buffer()
    return out


def microbatches(step, n_rows, mbs, batch="random"):
    """This rank's microbatch row slices, the batch's ``(tokens, pos, labels, mask, seg)`` (this CP rank's
    shard, cut by Megatron's own ``get_batch_on_this_cp_rank``) and the whole rows ``(mask, seg)`` of each
    microbatch (what ``terms.begin_step`` takes)."""
    from megatron.core import parallel_state as ps

    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    per_rank = n_rows // dp
    tokens, labels, mask, seg = BATCHES[batch](step, n_rows)
    rows = [slice(dp_rank * per_rank + k * mbs, dp_rank * per_rank + (k + 1) * mbs) for k in range(per_rank // mbs)]
    pos = torch.arange(S)[None, :].expand(n_rows, -1)
    whole = [(mask[r], seg[r]) for r in rows]  # begin_step takes the whole rows (context parallelism)
    if ps.get_context_parallel_world_size() > 1:
        batch_ = megatron_cp_batch(
            {"tokens": tokens, "position_ids": pos, "labels": labels, "loss_mask": mask, "segment_ids": seg}
        )
        tokens, pos, labels, mask, seg = (
            batch_[k] for k in ("tokens", "position_ids", "labels", "loss_mask", "segment_ids")
        )
    return rows, (tokens, pos, labels, mask, seg), whole


def megatron_cp_batch(batch):
    """This CP rank's shard of ``batch`` (``[b, S]`` tensors) by Megatron's ``get_batch_on_this_cp_rank``.
    Its signature is detected, not its version: 0.19 added ``is_hybrid_cp`` (dispatching on ``cu_seqlens``)
    and, given ``cp_group=None``, shards over the WORLD size (wrong under TP×CP), so the CP group is passed."""
    import inspect

    from megatron.core import parallel_state as ps
    from megatron.core.utils import get_batch_on_this_cp_rank

    group = ps.get_context_parallel_group()
    if "is_hybrid_cp" in inspect.signature(get_batch_on_this_cp_rank).parameters:
        return get_batch_on_this_cp_rank(dict(batch), is_hybrid_cp=False, cp_group=group)
    return get_batch_on_this_cp_rank(dict(batch), cp_group=group)


def _step(terms, loss_fn, model, data, whole, mbs):
    from megatron.core.pipeline_parallel import get_forward_backward_func

    terms.begin_step([w for w, _ in whole], segment_ids=[sg for _, sg in whole])
    get_forward_backward_func()(
        forward_step_func=partial(_forward_step, loss_fn),
        data_iterator=iter(data),
        model=[model],
        num_microbatches=len(data),
        seq_length=S,
        micro_batch_size=mbs,
    )  # (the schedule itself calls config.finalize_model_grads_func with the summed counts)
    return terms.end_step()


def naive_reference(case, n_rows=8, mbs=2, steps=2, batch="random", deep=False, depth=1):
    """The objective J of docs/semantics.md §4-§5 written out by hand on the whole global batch in one
    forward (Megatron's per-token cross-entropy for the main loss; MTP cross-entropy, router softmax,
    top-k counts, Switch and z terms in float64 loops here), back-propagated once. Megatron's own terms
    are switched off on the config. Returns ``[(J, logs, {name: grad})]`` per step."""
    import torch.nn.functional as F

    mode, scope, _, _ = case
    config = make_config(**DEEP) if deep else make_config(mtp_num_layers=depth)
    model = build_model(config, 1, share=deep).module
    config.moe_aux_loss_coeff, config.moe_z_loss_coeff, config.mtp_loss_scaling_factor = 0.0, None, 0.0
    routers = [m for m in model.modules() if type(m).__name__ == "TopKRouter"]
    seen, mtp_logits = {}, []

    def keep_input(mod, args, output):
        seen[id(mod)] = args[0]

    def keep_logits(mod, args, output):
        mtp_logits.append(output[0])

    hooks = [r.register_forward_hook(keep_input) for r in routers]
    hooks.append(model.output_layer.register_forward_hook(keep_logits))
    frac_prev = [torch.full((E,), TOPK / E, dtype=torch.float64) for _ in routers]
    out = []
    for step in range(steps):
        seen.clear()
        mtp_logits.clear()
        tokens, labels, mask, seg = BATCHES[batch](step, n_rows)
        pos = torch.arange(S)[None, :].expand(n_rows, -1)
        loss = model(tokens, pos, None, labels=labels, loss_mask=mask).double()
        # MTP depth k: labels and mask rolled left by k inside the row (and document for per_document)
        J = _naive_mode(mode, loss, mask, seg)
        mtp_logs = {}
        for k in range(1, depth + 1):
            lab = torch.cat([labels[:, k:], torch.zeros_like(labels[:, :k])], dim=1)
            w = torch.cat([mask[:, k:], torch.zeros_like(mask[:, :k])], dim=1)
            if mode == "per_document":
                w = w * (torch.cat([seg[:, k:], torch.zeros_like(seg[:, :k])], dim=1) == seg)
            lg = mtp_logits[k - 1].transpose(0, 1).double()
            loss_k = F.cross_entropy(lg.reshape(-1, V), lab.reshape(-1), reduction="none").view(n_rows, S)
            J = J + LAM / depth * _naive_mode(mode, loss_k, w, seg)
            mtp_logs[f"mtp_{k}_loss"] = float((loss_k * w).sum() / w.sum())
        aux_logs, z_logs, fracs = [], [], []
        for li, r in enumerate(routers):
            h = seen[id(r)]  # [S, n_rows, H]
            logits = (h @ r.weight.T).double()  # [S, n_rows, E]
            p = logits.softmax(-1)
            top = torch.zeros_like(p).scatter(-1, p.topk(TOPK, dim=-1).indices, 1.0)
            fracs.append(top.sum((0, 1)) / (S * n_rows))
            if scope == "microbatch":
                terms = []
                for r0 in range(0, n_rows, mbs):
                    c, pp, t = top[:, r0 : r0 + mbs].sum((0, 1)), p[:, r0 : r0 + mbs].sum((0, 1)), S * mbs
                    terms.append(ALPHA * E / (TOPK * t * t) * (c * pp).sum())
                a = torch.stack(terms).mean()
            elif scope == "sequence":  # each row's own Switch term, averaged over the rows
                terms = []
                for r0 in range(n_rows):
                    c, pp = top[:, r0].sum(0), p[:, r0].sum(0)
                    terms.append(ALPHA * E / (TOPK * S * S) * (c * pp).sum())
                a = torch.stack(terms).mean()
            else:
                a = ALPHA * E / TOPK * (frac_prev[li] * p.sum((0, 1))).sum() / (S * n_rows)
            z = torch.logsumexp(logits, -1).square().sum() / (S * n_rows)
            J = J + a + BETA * z
            aux_logs.append(float(a.detach()) / ALPHA)
            z_logs.append(float(z))
        frac_prev = fracs
        model.zero_grad()
        J.backward()
        logs = {
            "lm_loss": float((loss * mask).sum() / mask.sum()),
            **mtp_logs,
            "objective": float(J),
            "z_loss": sum(z_logs) / len(z_logs),
            {"microbatch": "load_balancing_loss", "sequence": "seq_load_balancing_loss"}.get(
                scope, "global_load_balancing_loss"
            ): sum(aux_logs) / len(aux_logs),
        }
        out.append((logs, {n: p.grad.clone() for n, p in model.named_parameters()}))
    for h in hooks:
        h.remove()
    return out


def _naive_mode(mode, loss, mask, seg):
    if mode == "per_token":
        return (loss * mask).sum() / mask.sum()
    terms = []
    for i in range(loss.shape[0]):
        ids = seg[i].unique().tolist() if mode == "per_document" else [None]
        for d in ids:
            w = mask[i] if d is None else mask[i] * (seg[i] == d)
            terms.append((loss[i] * w).sum() / max(float(w.sum()), 1.0))
    return torch.stack(terms).mean()


def bad_inputs():
    """The errors MoETerms raises on this rank for bad input (each before any collective)."""
    from megatron.core.pipeline_parallel import schedules

    from lossparity.integrations.megatron import LossFunc, MoETerms

    config = make_config()
    model = build_model(config, 1)
    errors, kept = [], {}
    for call in [
        lambda: MoETerms([torch.nn.Linear(2, 2)], make_config()),
        lambda: MoETerms([model], make_config(), aux_scope="global_running"),
        lambda: MoETerms([model], config, aux_scope="microbatch"),
        lambda: kept["terms"].end_step(),
        lambda: MoETerms([model], config),
    ]:
        try:
            made = call()
            if isinstance(made, MoETerms):
                kept["terms"] = made
            errors.append(None)
        except (ValueError, RuntimeError) as exc:
            errors.append(f"{type(exc).__name__}: {exc}")
    loss_fn = LossFunc("per_token", config=config, terms=kept["terms"])
    tokens, labels, mask, seg = global_batch(0, 2)
    pos = torch.arange(S)[None, :].expand(2, -1)
    try:  # Megatron's schedule without terms.begin_step: the first router forward refuses
        schedules.forward_backward_no_pipelining(
            forward_step_func=partial(_forward_step, loss_fn),
            data_iterator=iter([(tokens, pos, labels, mask, seg)]),
            model=[model],
            num_microbatches=1,
            seq_length=S,
            micro_batch_size=2,
        )
        errors.append(None)
    except RuntimeError as exc:
        errors.append(f"{type(exc).__name__}: {exc}")
    return errors


def bad_cp_inputs(cp):
    """Under context parallelism: the errors for rows whose length is not a multiple of 2·cp (begin_step,
    before its collective) and for shards given to begin_step instead of the whole rows (LossFunc, on
    every CP rank at the same microbatch)."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import schedules

    from lossparity.integrations.megatron import LossFunc, MoETerms

    config = make_config(cp=cp)
    model = build_model(config, 1)
    terms = MoETerms([model], config, aux_scope="microbatch")
    loss_fn = LossFunc("per_sample", config=config, terms=terms)
    tokens, labels, mask, seg = global_batch(0, 2)
    pos = torch.arange(S)[None, :].expand(2, -1)
    errors = []
    for masks in ([mask[:, :-2]], [cp_shard(mask, ps.get_context_parallel_rank(), cp)]):
        try:
            terms.begin_step(masks)
            shards = (cp_shard(x, ps.get_context_parallel_rank(), cp) for x in (tokens, pos, labels, mask, seg))
            schedules.forward_backward_no_pipelining(
                forward_step_func=partial(_forward_step, loss_fn),
                data_iterator=iter([tuple(shards)]),
                model=[model],
                num_microbatches=1,
                seq_length=S,
                micro_batch_size=2,
            )
            errors.append(None)
        except ValueError as exc:
            errors.append(f"{type(exc).__name__}: {exc}")
    return errors


def _megatron_loss(loss_mask, output_tensor):
    """pretrain_gpt.py's loss_func: (Σ masked loss, token count, report)."""
    loss = output_tensor.view(-1).double()
    mask = loss_mask.view(-1).double()
    s, n = (loss * mask).sum(), mask.sum()
    return s, n.to(torch.int), {"lm loss": torch.stack([s.detach(), n])}


def run_megatron_own(rank, world, tp, cases, n_rows=8, steps=2, cp=1, pp=1):
    """Megatron's own MoE/MTP terms (no MoETerms) next to MoETerms on the same layout. ``cases`` are
    ``(system, scope, per_token, mbs)`` with system "megatron" or "lossparity" (mode per_token); returns
    per case the last step's ``(logs, {name: full grad})`` of this rank (Megatron's logs as its
    training loop prints them: ``track_moe_metrics`` / ``track_mtp_metrics`` with loss scale 1/M)."""
    install_cpu_bridges()
    from megatron.core import parallel_state as ps

    full = _full_state() if pp > 1 else None
    ps.initialize_model_parallel(
        tensor_model_parallel_size=tp, context_parallel_size=cp, pipeline_model_parallel_size=pp
    )
    try:
        out = {}
        for system, scope, per_token, mbs in cases:
            if system == "lossparity":
                res = _run_case(
                    rank,
                    world,
                    tp,
                    "per_token",
                    scope,
                    per_token,
                    None,
                    n_rows=n_rows,
                    mbs=mbs,
                    steps=steps,
                    cp=cp,
                    pp=pp,
                    full=full,
                )
                out[(system, scope, per_token, mbs)] = res[-1][:2]
            else:
                out[(system, scope, per_token, mbs)] = _own_case(tp, scope, per_token, mbs, n_rows, steps, cp, pp, full)
        return out
    finally:
        ps.destroy_model_parallel()


def _own_case(tp, scope, per_token, mbs, n_rows, steps, cp=1, pp=1, full=None):
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker, track_moe_metrics
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    kind = {"microbatch": "aux_loss", "global": "global_aux_loss"}[scope]
    config = make_config(
        tp=tp, cp=cp, per_token=per_token, moe_router_load_balancing_type=kind, pipeline_model_parallel_size=pp
    )
    model = build_model(config, tp, full)
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    per_rank = n_rows // dp
    num_mbs = per_rank // mbs
    for step in range(steps):
        clear_aux_losses_tracker()
        tokens, labels, mask, seg = global_batch(step, n_rows)
        rows = [slice(dp_rank * per_rank + k * mbs, dp_rank * per_rank + (k + 1) * mbs) for k in range(num_mbs)]
        pos = torch.arange(S)[None, :].expand(mbs, -1)
        if cp > 1:
            cp_rank = ps.get_context_parallel_rank()
            tokens, labels, mask, seg, pos = (cp_shard(x, cp_rank, cp) for x in (tokens, labels, mask, seg, pos))
        data = [(tokens[r], pos, labels[r], mask[r], seg[r]) for r in rows]
        reports = get_forward_backward_func()(
            forward_step_func=_own_forward_step,
            data_iterator=iter(data),
            model=[model],
            num_microbatches=num_mbs,
            seq_length=S,
            micro_batch_size=mbs,
        )
        logs = {}
        track_moe_metrics(1.0 / num_mbs, step, total_loss_dict=logs, num_layers=2, mtp_num_layers=1)
        MTPLossLoggingHelper.track_mtp_metrics(1.0 / num_mbs, step, None, None, logs)
        logs = {k: float(v) for k, v in logs.items()}
        if reports:  # the last pipeline stage
            val = torch.stack([r["lm loss"] for r in reports]).sum(0)
            dist.all_reduce(val, group=ps.get_data_parallel_group(with_context_parallel=True))
            logs["lm loss"] = float(val[0] / val[1])
        tp_group = ps.get_tensor_model_parallel_group()
        grads = {global_name(n, model.module): full_grad(p, tp_group) for n, p in model.module.named_parameters()}
        if step < steps - 1:
            model.zero_grad_buffer()
    return logs, grads


def _own_forward_step(data_iterator, model):
    tokens, pos, labels, mask, seg = next(data_iterator)
    return model(tokens, pos, None, labels=labels, loss_mask=mask), partial(_megatron_loss, mask)
