"""torchtitan's real DeepSeek-V3 MoE model and ``Trainer.train_step`` on CPU in float64 (see _titan_workers).

The model is torchtitan's own ``DeepSeekV3Model`` built from torchtitan's layer builders (MLA attention,
one dense layer, MoE layers with a shared expert, sigmoid routing with expert bias), tiny. Two calls are
bridged in the test, each by an instance method on the module (no torchtitan file edited):

- ``FlexAttention.forward``: FlexAttention has no backward on CPU ("FlexAttention does not support
  backward on CPU"); the bridge is the same block-causal attention evaluated densely from torchtitan's own
  ``BlockMask`` (its ``mask_mod``), in float64;
- ``GroupedExperts.forward``: torchtitan casts the experts' inputs and weights to bfloat16 for
  ``torch._grouped_mm``; the bridge is the same SwiGLU per expert in float64 (a 1e-10 comparison needs it).

torchtitan compiles ``create_block_mask`` with ``torch.compile`` (about 90 s on a 2-core CPU for a 10-token
row); the runs here disable dynamo (:data:`EAGER`), which builds the same ``BlockMask`` eagerly.

Everything else (router, expert bias, token dispatch, shared experts, MoE block, activation checkpointing
wrappers, ``train_step``, ``forward_backward_step``, ``post_dataloading_process`` with its attention
masks) is torchtitan's code.
"""

from __future__ import annotations

import contextlib
import types
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from _titan_workers import _Optim, global_batch

V, S = 11, 10  # global_batch's vocabulary and row length
DIM, E, K = 16, 4, 2
RATE = 1e-2  # torchtitan's load_balance_coeff: the expert-bias rate
LAMBDA = 0.3  # the MTP weight (torchtitan's MTPLoss.mtp_scale default)
EAGER = torch._dynamo.config.patch(disable=True)  # torchtitan's compiled create_block_mask, run eagerly


def _attention(self, q, k, v, *, attention_masks, scale=None, **kwargs):
    from torch.nn.attention.flex_attention import create_mask

    b, length, _, h = q.shape
    allowed = create_mask(attention_masks.mask_mod, b, 1, length, k.shape[1], device=q.device)
    s = torch.einsum("blnh,bmnh->bnlm", q, k) * (scale if scale is not None else h**-0.5)
    return torch.einsum("bnlm,bmnh->blnh", s.masked_fill(~allowed, float("-inf")).softmax(-1), v)


def _experts(self, x, counts):
    out, start = [], 0
    for e, n in enumerate(counts.tolist()):
        xe = x[start : start + n]
        start += n
        out.append((F.silu(xe @ self.w1_EFD[e].T) * (xe @ self.w3_EFD[e].T)) @ self.w2_EDF[e].T)
    return torch.cat(out)


def build_model(ac: str = "none", mtp: int = 0):
    """A tiny torchtitan DeepSeek-V3 (3 layers, 2 of them MoE with 4 experts, top-2 sigmoid routing with
    expert bias; ``mtp`` DeepSeek-V3 MTP layers, each with a MoE), float64, the same weights on every call;
    ``ac``: torchtitan's "full" or "selective" activation checkpointing, or "none"."""
    from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.common.attention import FlexAttention
    from torchtitan.models.common.moe import GroupedExperts, MoE
    from torchtitan.models.deepseek_v3 import (
        _EMBEDDING_INIT,
        _NORM_INIT,
        DeepSeekV3Model,
        _build_dsv3_layers,
        _build_mtp_layers,
        _output_linear_init,
    )

    layers = _build_dsv3_layers(
        n_layers=3,
        n_dense_layers=1,
        dim=DIM,
        n_heads=2,
        q_lora_rank=0,
        kv_lora_rank=8,
        qk_nope_head_dim=4,
        qk_rope_head_dim=4,
        v_head_dim=4,
        mscale=1.0,
        dense_hidden_dim=24,
        moe_hidden_dim=8,
        num_experts=E,
        num_shared_experts=1,
        router_top_k=K,
        router_score_func="sigmoid",
        attn_backend="flex",
        moe_comm_backend="standard",
        non_blocking_capacity_factor=None,
        rope=ComplexRoPE.Config(dim=4, max_seq_len=64, theta=10000.0),
    )
    for layer in layers:
        if layer.moe is not None:
            layer.moe.load_balance_coeff = RATE
    cfg = DeepSeekV3Model.Config(
        vocab_size=V,
        dim=DIM,
        tok_embeddings=Embedding.Config(num_embeddings=V, embedding_dim=DIM, param_init=_EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=DIM, param_init=_NORM_INIT),
        lm_head=Linear.Config(in_features=DIM, out_features=V, param_init=_output_linear_init(DIM)),
        layers=layers,
        mtp_layers=_build_mtp_layers(layers[-1], dim=DIM, num_mtp_layers=mtp),
    )
    torch.manual_seed(5)
    model = cfg.build()
    model.init_weights()
    g = torch.Generator().manual_seed(6)
    with torch.no_grad():
        for name, p in model.named_parameters():  # larger router weights: routing decisions that matter
            if "router.gate" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    model = model.double()
    for m in model.modules():
        if isinstance(m, GroupedExperts):
            m.forward = types.MethodType(_experts, m)
        if isinstance(m, FlexAttention):
            m.forward = types.MethodType(_attention, m)
        if isinstance(m, MoE):
            m.expert_bias_E.zero_()
    if ac == "full":
        FullAC(FullAC.Config()).apply(model)
    elif ac == "selective":
        SelectiveAC(SelectiveAC.Config()).apply(model)
    model.train()
    return model, cfg


class _OptimWithHooks(_Optim):
    """The stand-in optimizer with torchtitan's step pre-hooks (``register_moe_load_balancing_hook`` uses
    them): torchtitan's own expert-bias hook runs before each step, as in its ``OptimizersContainer``."""

    def __init__(self, model, group):
        super().__init__(model, group)
        self.pre_hooks = []

    def register_step_pre_hook(self, hook):
        self.pre_hooks.append(hook)

    def step(self):
        for hook in self.pre_hooks:
            hook(self, (), {})
        super().step()


def _trainer(parts, cfg, ga: int, pp_microbatches: int, dims: SimpleNamespace, group, scope: str, mtp: int, beta):
    """torchtitan's ``Trainer`` (with the mixin) around ``parts``, its collaborators stood in: the optimizer
    (all-reduce over ``group``, torchtitan's expert-bias pre-step hook registered), the metrics log (kept)."""
    from torchtitan.components.optimizer import register_moe_load_balancing_hook
    from torchtitan.trainer import Trainer

    from lossparity.integrations.titan_moe import TitanMoETerms
    from lossparity.integrations.torchtitan import LossParityLoss, LossParityTitanMixin

    class T(LossParityTitanMixin, Trainer):
        pass

    t = object.__new__(T)
    t.config = SimpleNamespace(
        training=SimpleNamespace(disable_cuda_graphs=False, max_norm=1e6),
        parallelism=SimpleNamespace(spmd_backend="none"),
    )
    t.parallel_dims = dims
    t.model_parts, t.model_config, t.device, t.step, t.ntokens_seen = parts, cfg, "cpu", 1, 0
    t.gradient_accumulation_steps, t.num_pipeline_parallel_microbatches = ga, pp_microbatches
    t.optimizers = _OptimWithHooks(parts[0] if len(parts) == 1 else _Parts(parts), group)
    mesh = dims.get_optional_mesh("loss")
    hook_dims = SimpleNamespace(ep_enabled=False, tp=1, get_optional_mesh=lambda name: mesh if name == "loss" else None)
    register_moe_load_balancing_hook(t.optimizers, parts, hook_dims)  # torchtitan's own: must add 0
    t.lr_schedulers = SimpleNamespace(get_metrics=lambda: {}, step=lambda: None)
    t.logged = []
    t.metrics_processor = SimpleNamespace(
        should_log=lambda step: True,
        log=lambda step, loss, max_loss, grad_norm, extra_metrics=None: t.logged.append(
            {"loss": loss, **(extra_metrics or {})}
        ),
    )
    t.checkpointer = SimpleNamespace(maybe_wait_for_staging=lambda: None)
    t.train_context = contextlib.nullcontext
    t.fwd_bwd_fn = t._forward_backward_body
    t.loss_fn = LossParityLoss("per_sample", mtp_depths=mtp, mtp_weight=LAMBDA)
    t.moe_terms = TitanMoETerms(parts, scope, aux_coeff=0.1, z_coeff=beta)
    return t


def _run_steps(t, rows: slice, microbatches: int, steps: int) -> dict:
    """``steps`` ``train_step`` calls on ``rows`` of the global batch (the same rows each step) cut into
    ``microbatches`` dataloader batches; the last step's gradients, the biases after it, its logs."""
    tokens, labels, positions = global_batch(16)
    tokens, labels, positions = tokens[rows], labels[rows], positions[rows]
    b = tokens.shape[0] // microbatches
    batch = [
        (
            {"input": tokens[k * b : (k + 1) * b], "positions": positions[k * b : (k + 1) * b]},
            labels[k * b : (k + 1) * b],
        )
        for k in range(microbatches)
    ]
    data = iter([(dict(d), lab) for _ in range(steps) for d, lab in batch])
    for _ in range(steps):
        with EAGER:
            t.train_step(data)
        t.step += 1
    biases = {n: b.clone() for p in t.model_parts for n, b in p.named_buffers() if n.endswith("expert_bias_E")}
    return {"grads": t.optimizers.grads, "biases": biases, "logs": t.logged[-1]}


def _parallel_dims(get_mesh, dp: bool, pp: int = 1) -> SimpleNamespace:
    """The attributes of torchtitan's ``ParallelDims`` that ``train_step`` and the mixin read: data and
    pipeline parallelism only, ``get_mesh(name)`` giving each mesh."""
    more = {"pp": pp} if pp > 1 else {}
    return SimpleNamespace(
        dp_enabled=dp,
        pp_enabled=pp > 1,
        cp_enabled=False,
        ep_enabled=False,
        tp_enabled=False,
        dp_cp_enabled=dp,
        get_mesh=get_mesh,
        get_optional_mesh=get_mesh,
        **more,
    )


def titan_moe_steps(
    scope: str, rows: slice, ga: int, *, ac: str = "none", mtp: int = 0, mesh=None, steps: int = 2, beta=1e-2
):
    """``steps`` torchtitan ``train_step`` calls on ``rows`` of the global batch (the same rows each step) cut
    into ``ga`` microbatches, with ``TitanMoETerms(scope, α=0.1, β)`` and ``LossParityLoss("per_sample",
    mtp_depths=mtp, mtp_weight=0.3)``. Returns the last step's gradients, the
    expert biases after it, and the logs torchtitan's metrics processor received."""
    model, cfg = build_model(ac, mtp)
    dims = _parallel_dims(lambda name: mesh, dp=mesh is not None)
    group = mesh.get_group() if mesh is not None else None
    t = _trainer([model], cfg, ga, 1, dims, group, scope, mtp, beta)
    return _run_steps(t, rows, ga, steps)


def run_titan_moe(rank: int, world: int, cases: list[tuple[str, str, int]]):
    """Each ``(scope, ac, mtp)`` on 2 ranks × GA 2 × b 4 (rank r holds rows [8r, 8r+8)) over a 1-D ``batch`` mesh."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("batch",))
    per = 16 // world
    return {
        c: titan_moe_steps(c[0], slice(rank * per, (rank + 1) * per), 2, ac=c[1], mtp=c[2], mesh=mesh) for c in cases
    }


def _bridge_step(self, *, arg_mbs=None, kwarg_mbs=None, target_mbs=None, losses=None, return_outputs=True, **kw):
    """torchtitan 0.3.0's call ``pp_schedule.step(arg_mbs=, kwarg_mbs=, target_mbs=, ...)`` on torch 2.13's
    schedules, whose ``step(*args, target=, **kwargs)`` would pass those names to the model: what ``step``
    does before its ``_step_microbatches`` (stage flags, runtime state), then that on the given microbatches."""
    for stage in getattr(self, "_stages", None) or [self._stage]:
        stage.has_backward = self._has_backward
        stage.clear_runtime_states()
    self._step_microbatches(arg_mbs, kwarg_mbs, target_mbs, losses, return_outputs, **kw)


class _Parts:
    """A rank's model parts (several stages under a looped schedule) as one model for the optimizer stand-in."""

    def __init__(self, parts):
        self.parts = parts

    def zero_grad(self, set_to_none=True):
        for p in self.parts:
            p.zero_grad(set_to_none=set_to_none)

    def parameters(self):
        return [q for p in self.parts for q in p.parameters()]

    def named_parameters(self):
        return [(n, q) for p in self.parts for n, q in p.named_parameters()]


def titan_moe_pp_steps(
    scope: str, ac: str, pp_mesh, *, schedule: str = "1F1B", dp_mesh=None, steps: int = 2, beta=1e-2
) -> dict:
    """PP 2 (torchtitan's ``pipeline_llm``; 1F1B: stage 0 = embeddings + layers 0-1, stage 1 = layer 2 + norm +
    head, one MoE layer each; Interleaved1F1B: 4 stages, rank 0 holds embeddings + layer 0 and layer 2, rank 1
    layer 1 and norm + head), GA 2 × 2 pipeline microbatches: ``steps`` ``train_step`` calls on the global
    batch of 16 rows (microbatches of 4 rows; with a ``dp_mesh`` of ``D`` ranks, this data-parallel rank's
    ``16/D`` rows in microbatches of ``4/D``). ``ac`` is applied per stage by the ``parallelize_fn``
    (torchtitan's AC classes). Returns this rank's gradients, biases and logs (as :func:`titan_moe_steps`)."""
    from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC
    from torchtitan.distributed.pipeline_parallel import pipeline_llm

    model, cfg = build_model("none", 0)

    def parallelize(m, **kwargs):
        if ac == "full":
            FullAC(FullAC.Config()).apply(m)
        elif ac == "selective":
            SelectiveAC(SelectiveAC.Config()).apply(m)
        return m

    dp, d = (dp_mesh.size(), dp_mesh.get_local_rank()) if dp_mesh is not None else (1, 0)
    meshes = {"pp": pp_mesh, "batch": dp_mesh, "loss": dp_mesh}
    dims = _parallel_dims(meshes.get, dp=dp_mesh is not None, pp=2)
    parallelism = SimpleNamespace(
        pipeline_parallel_schedule=schedule,
        pipeline_parallel_schedule_csv=None,
        pipeline_parallel_layers_per_stage=None,
        pipeline_parallel_first_stage_less_layers=1,
        pipeline_parallel_last_stage_less_layers=1,
        module_fqns_per_model_part=None,
        pipeline_parallel_microbatch_size=4 // dp,
        pipeline_parallel_degree=2,
    )
    trainer: list = []  # the loss is the trainer's, built below: torchtitan's wrapper calls it through this
    pp_schedule, parts, first, last = pipeline_llm(
        model,
        parallel_dims=dims,
        training=SimpleNamespace(local_batch_size=8 // dp),
        parallelism=parallelism,
        compile_config=None,
        ac_config=None,
        dump_folder="",
        device=torch.device("cpu"),
        model_config=cfg,
        parallelize_fn=parallelize,
        loss_fn=lambda *args, **kwargs: trainer[0].loss_fn(*args, **kwargs),
    )
    t = _trainer(parts, cfg, 2, 2, dims, dp_mesh.get_group() if dp_mesh is not None else None, scope, 0, beta)
    trainer.append(t)
    pp_schedule.step = types.MethodType(_bridge_step, pp_schedule)
    t.pp_schedule, t.pp_has_first_stage, t.pp_has_last_stage = pp_schedule, first, last
    return _run_steps(t, slice(d * 16 // dp, (d + 1) * 16 // dp), 4, steps)


def run_titan_moe_pp(rank: int, world: int, cases: list[tuple[str, str]], schedule: str = "1F1B"):
    """Each ``(scope, ac)`` with PP 2 over a 1-D ``pp`` mesh of the 2 ranks (:func:`titan_moe_pp_steps`)."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("pp",))
    return {c: titan_moe_pp_steps(c[0], c[1], mesh, schedule=schedule) for c in cases}


def run_titan_moe_dp_pp(rank: int, world: int, cases: list[tuple[str, str]]):
    """Each ``(scope, ac)`` on 4 ranks: PP 2 (1F1B) × 2 data-parallel ranks (torchtitan's mesh order, ``pp``
    outer, ``batch`` inner): GA 2 × 2 pipeline microbatches of 2 rows per rank (:func:`titan_moe_pp_steps`)."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("pp", "batch"))
    return {c: titan_moe_pp_steps(c[0], c[1], mesh["pp"], dp_mesh=mesh["batch"]) for c in cases}
