"""The tiny DeepSeek-V3 MoE+MTP model of MindFormers 2.0.0, built from a ``DeepseekV3Config`` with random weights
(``PyNativeDeepseekV3ForCausalLM``: 2 decoder layers, the second an MoE layer with a shared expert and
``global_aux_loss``, 1 MTP depth whose layer is MoE too), run forward on CPU with ``lossparity.mindformers``
installed at GA 1, 2 and 4 through MindFormers' own ``Trainer._split_micro_batch`` / ``compute_loss``. The model's
own calls (GPTModel's loss, ``process_mtp_loss``, the routers' aux loss and tracker) go through the hook; the
logits, MTP logits and router probabilities they were given are recorded and fed to lossparity's torch reference
(float64, ``_torch_ref.py``): the LM objective, the MTP term, every router's ``A_m``, the tracker and MindFormers'
logged loss must agree to 1e-6 (float32). The ops without a CPU kernel run as test-only stand-ins
(``_cpu_ops.enable_model``). Forward only: parameter gradients through the stand-ins are not checked (issue 48)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import mindspore as ms
import numpy as np
import pytest
from _torch_ref import run
from mindspore import Parameter, Tensor, ops

import lossparity.mindformers as lpmf
import lossparity.mindspore as lpm

ms.set_context(mode=ms.PYNATIVE_MODE, device_target="CPU")

import _cpu_ops  # noqa: E402 (after the context is set)

_cpu_ops.enable_model()
from mindformers.models.deepseek3.configuration_deepseek_v3 import DeepseekV3Config  # noqa: E402
from mindformers.models.deepseek3.modeling_deepseek_v3_pynative import PyNativeDeepseekV3ForCausalLM  # noqa: E402
from mindformers.models.deepseek4.configuration_deepseek_v4 import DeepseekV4Config  # noqa: E402
from mindformers.models.deepseek4.modeling_deepseek_v4_pynative import PyNativeDeepseekV4ForCausalLM  # noqa: E402
from mindformers.pynative.trainer.trainer import Trainer  # noqa: E402
from mindformers.pynative.transformers.experimental_attention_variant import csa  # noqa: E402
from mindformers.pynative.transformers.experimental_attention_variant import utils as indexer_utils  # noqa: E402
from mindformers.pynative.transformers.moe import router as router_mod  # noqa: E402
from mindformers.pynative.transformers.moe.moe_utils import get_moe_layer_wise_logging_tracker  # noqa: E402

B, S, V, E, TOPK, COEFF, LAMBDA = 4, 16, 32, 4, 2, 0.01, 0.3
LENGTHS = (16, 0, 9, 3)  # loss-bearing tokens per row: a full row, a row without targets, ragged rows
ASL = np.array([[16, 16], [16, 16], [5, 16], [16, 16]], np.int32)  # row 2 packs two documents


def _config() -> Any:
    """DeepSeek-V3's architecture at toy size. Deviations from the released recipe, each for a CPU reason:
    float32 everywhere; softmax routing without expert bias and without group-limited routing (that path
    writes its group mask with ``Tensor.scatter_`` inside the router, which we did not stand in);
    ``moe_router_fusion`` / ``moe_permute_fusion`` off (fused Ascend-only kernels)."""
    return DeepseekV3Config(
        vocab_size=V, seq_length=S, max_position_embeddings=S, hidden_size=16, intermediate_size=32,
        num_hidden_layers=2, first_k_dense_replace=1, num_attention_heads=2, num_key_value_heads=2,
        multi_latent_attention=True, q_lora_rank=8, kv_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=4,
        v_head_dim=8, qk_layernorm=True, use_flash_attention=True, position_embedding_type="rope",
        params_dtype="float32", compute_dtype="float32", layernorm_compute_dtype="float32",
        softmax_compute_dtype="float32", rotary_dtype="float32", router_dense_type="float32",
        num_nextn_predict_layers=1, mtp_loss_scaling_factor=LAMBDA, n_routed_experts=E, num_experts_per_tok=TOPK,
        n_shared_experts=1, moe_intermediate_size=8, moe_shared_expert_intermediate_size=8, gated_linear_unit=True,
        moe_grouped_gemm=True, moe_router_load_balancing_type="global_aux_loss", moe_aux_loss_coeff=COEFF,
        moe_router_score_function="softmax", moe_router_enable_expert_bias=False, moe_router_fusion=False,
        moe_permute_fusion=False, n_group=None, topk_group=None, hidden_dropout=0.0, attention_dropout=0.0,
        add_bias_linear=False, hidden_act="silu", pad_token_id=0,
    )  # fmt: skip


class Recorder:
    """What the model handed to the hooked calls, in call order: (labels, logits) of the main loss and of each
    MTP depth, and (probs, routing map, A_m) of every router's global_aux_loss."""

    def __init__(self) -> None:
        self.main: list[np.ndarray] = []
        self.mtp: list[np.ndarray] = []
        self.probs: list[np.ndarray] = []
        self.routing: list[np.ndarray] = []
        self.aux: list[float] = []


def _host(t: Tensor) -> np.ndarray:
    # GPTModel casts the hidden states to bfloat16 before the output layer, so the logits are bfloat16:
    # float32 holds them exactly
    return t.astype(ms.float32).asnumpy()


def _build() -> tuple[Any, Recorder]:
    net = PyNativeDeepseekV3ForCausalLM(_config())
    rng = np.random.default_rng(1)
    for p in net.get_parameters():  # random weights; buffers (router counts, ga_steps) start at 0
        if p.requires_grad:
            base = 1.0 if p.ndim == 1 else 0.0  # the RMSNorm gains around 1
            p.set_data(Tensor((base + rng.normal(0.0, 0.3, p.shape)).astype(np.float32)))
        else:
            p.set_data(Tensor(np.zeros(p.shape, np.float32)).astype(p.dtype))
    net.set_train(True)
    rec = Recorder()
    gpt = net.model
    original = gpt.compute_language_model_loss

    def compute_language_model_loss(labels: Tensor, logits: Tensor, loss_mask: Tensor = None) -> Any:
        (rec.main if loss_mask is not None else rec.mtp).append(_host(logits).reshape(*labels.shape, -1))
        return original(labels, logits, loss_mask)

    gpt.compute_language_model_loss = compute_language_model_loss  # under the hook: it sees what the hook sees
    routers = [c for _, c in net.cells_and_names() if isinstance(c, router_mod.TopKRouter)]
    assert len(routers) == 2  # decoder layer 2 and the MTP layer
    for r in routers:
        attach = r._attach_and_log_aux_loss

        def _attach(top: Tensor, loss: Tensor, coeff: float, attach: Any = attach) -> Tensor:
            rec.aux.append(float(loss.asnumpy().reshape(-1)[0]))
            return attach(top, loss, coeff)

        r._attach_and_log_aux_loss = _attach
    return net, rec


_COUNT = router_mod.get_tokens_per_expert_and_token_count
_SWITCH = router_mod.switch_load_balancing_loss_func


def _recording_router_functions(rec: Recorder, monkeypatch: pytest.MonkeyPatch) -> None:
    # module-level look-ups of MindFormers' router (released and fixed _apply_global_aux_loss both make them)
    def count(routing_map: Tensor, *args: Any, **kwargs: Any) -> Any:
        rec.routing.append(routing_map.asnumpy().astype(np.float64))
        return _COUNT(routing_map, *args, **kwargs)

    def switch(*args: Any, probs: Tensor, **kwargs: Any) -> Any:
        rec.probs.append(_host(probs))
        return _SWITCH(*args, probs=probs, **kwargs)

    monkeypatch.setattr(router_mod, "get_tokens_per_expert_and_token_count", count)
    monkeypatch.setattr(router_mod, "switch_load_balancing_loss_func", switch)


class ProbeTrainer:
    """MindFormers' ``Trainer._split_micro_batch`` / ``compute_loss`` and its ``training_step`` algebra over ``K``
    microbatches (each loss ÷ K, backward with MindFormers' ``get_loss_sense``, the MTP auto-scaler's scale set as
    ``Trainer.__init__`` sets it), with ``ms.value_and_grad`` for MindFormers' backward (hyper_parallel's
    ``Tensor.backward``). The gradient taken is w.r.t. zero probes added to the logits that the hooked loss calls
    receive (main loss and MTP depth 1): the gradient of the step's objective w.r.t. the logits."""

    _split_micro_batch = Trainer._split_micro_batch
    compute_loss = Trainer.compute_loss

    def __init__(self, net: Any, k: int) -> None:
        from mindformers.pynative.trainer.utils import set_auxiliary_loss_backward_scale  # noqa: PLC0415

        self.model = [net]
        self.num_accumulation_steps, self.enable_parallel, self.world_size = k, False, 1
        self.metric_reduce_group, self.compute_loss_func = None, None
        self.config = SimpleNamespace(
            parallelism=SimpleNamespace(pipeline_parallel=1, context_parallel=1),
            training=SimpleNamespace(local_batch_size=B // k),
        )
        set_auxiliary_loss_backward_scale(self.config.parallelism, self.enable_parallel, k)
        zeros = np.zeros((B, S, V), np.float32)
        self.probes = [Parameter(Tensor(zeros), name="probe_main"), Parameter(Tensor(zeros), name="probe_mtp")]
        self.micro = 0
        self.grads: list[np.ndarray] = []

    def probe(self, hooked: Any) -> Any:
        """``hooked`` (lossparity's loss call) given ``logits + probe`` of this microbatch's rows, in float32
        (bfloat16 would round the gradient; the bfloat16 logits are exact in float32)."""

        def compute_language_model_loss(labels: Tensor, logits: Tensor, loss_mask: Tensor = None) -> Any:
            rows = labels.shape[0]
            probe = self.probes[0 if loss_mask is not None else 1][self.micro * rows : (self.micro + 1) * rows]
            return hooked(labels, logits.astype(ms.float32) + probe.reshape(logits.shape), loss_mask)

        return compute_language_model_loss

    def training_step(self, inputs: dict[str, Tensor], loss: Any, grad_norm: Any, step: int) -> Any:
        from mindformers.pynative.distributed.utils import get_loss_sense  # noqa: PLC0415

        k = self.num_accumulation_steps
        sense = get_loss_sense(self.config.parallelism, self.enable_parallel, k, apply_gradient_accumulation=False)
        grads = [ops.zeros((B, S, V), ms.float32) for _ in self.probes]
        for micro in range(k):
            self.micro = micro
            micro_inputs = self._split_micro_batch(inputs, micro)

            def forward(mi: dict[str, Tensor] = micro_inputs) -> Tensor:
                return self.compute_loss(self.model, mi) / k

            value, micro_grads = ms.value_and_grad(forward, None, weights=self.probes)()
            grads = [g + mg * sense for g, mg in zip(grads, micro_grads, strict=True)]
            loss = loss + value
        self.grads = [g.asnumpy() for g in grads]
        return loss, grad_norm


def _batch() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    mask = np.zeros((B, S), np.float32)
    for i, n in enumerate(LENGTHS):
        mask[i, :n] = 1.0
    return {
        "input_ids": rng.integers(1, V, (B, S)).astype(np.int32),  # no pad id (0): every position attends
        "labels": rng.integers(0, V, (B, S)).astype(np.int32),
        "loss_mask": mask,
    }


def _run(net: Any, rec: Recorder, mode: str, k: int) -> dict[str, Any]:
    """One training step of the model at GA ``k`` with the hook installed in ``mode``."""
    for name in vars(rec):
        getattr(rec, name).clear()
    # no reset here: the routers' running counts carry over from the previous case unless the hook's
    # global_aux_reset fix resets them at the start of the step (the torch reference starts each case fresh)
    get_moe_layer_wise_logging_tracker().clear()
    inputs = {key: Tensor(v) for key, v in _batch().items()}
    if mode == "per_document":
        inputs["actual_seq_len"] = Tensor(ASL)
    trainer = ProbeTrainer(net, k)
    handle = lpmf.install(trainer, mode)
    gpt = net.model
    gpt.compute_language_model_loss = trainer.probe(gpt.compute_language_model_loss)  # above the hook
    try:
        loss, _ = trainer.training_step(inputs, 0.0, 0.0, 0)
    finally:
        handle.uninstall()  # puts back the recorder (the probe goes with the hook)
    return {
        "loss": float(np.asarray(loss.asnumpy()).reshape(-1)[0]),
        "lm_objective": handle.logs["lossparity/lm_objective"].asnumpy(),
        "mtp_objective": handle.logs["lossparity/mtp_objective"].asnumpy(),
        "tracker": get_moe_layer_wise_logging_tracker()["values"].asnumpy(),
        "grads": trainer.grads,
        "main": np.concatenate(rec.main),  # [B, S, V]: the microbatches' rows in order
        "mtp": np.concatenate(rec.mtp),
        "aux": np.array(rec.aux).reshape(k, 2).T,  # [router, microbatch]: decoder MoE, then the MTP layer's
        "probs": np.stack(rec.probs).reshape(k, 2, -1, E).transpose(1, 0, 2, 3),
        "routing": np.stack(rec.routing).reshape(k, 2, -1, E).transpose(1, 0, 2, 3),
        "calls": (len(rec.main), len(rec.mtp), len(rec.aux), len(rec.probs), len(rec.routing)),
    }


def _jobs(tag: str, out: dict[str, Any], mode: str, k: int) -> dict[str, np.ndarray]:
    x = _batch()
    seg = lpm.segment_ids_from_actual_seq_len(Tensor(ASL), S).asnumpy()  # the reference evaluates every mode
    jobs = {
        f"job/{tag}lm/kind": np.array("lm"),
        f"job/{tag}lm/logits": out["main"],
        f"job/{tag}lm/labels": x["labels"],
        f"job/{tag}lm/mask": x["loss_mask"],
        f"job/{tag}lm/segment_ids": seg,
        f"job/{tag}lm/microbatch_rows": np.array(B // k),
        f"job/{tag}mtp/kind": np.array("mtp"),
        f"job/{tag}mtp/mtp_logits": out["mtp"][None],  # [D=1, B, S, V]
        f"job/{tag}mtp/labels": x["labels"],
        f"job/{tag}mtp/mask": x["loss_mask"],
        f"job/{tag}mtp/segment_ids": seg,
        f"job/{tag}mtp/mode": np.array(mode),
        f"job/{tag}mtp/scale": np.array(LAMBDA),
    }
    for r in range(2):
        jobs.update(
            {
                f"job/{tag}aux{r}/kind": np.array("moe"),
                f"job/{tag}aux{r}/probs": out["probs"][r],
                f"job/{tag}aux{r}/counts": out["routing"][r].sum(1),
                f"job/{tag}aux{r}/tokens": np.full(k, out["probs"].shape[2], np.int64),
                f"job/{tag}aux{r}/topk": np.array(TOPK),
                f"job/{tag}aux{r}/coeff": np.array(COEFF),
            }
        )
    return jobs


CASES = [("per_sample", 1), ("per_sample", 2), ("per_sample", 4), ("per_token", 2), ("per_document", 4)]


@pytest.fixture(scope="module")
def runs() -> dict[tuple[str, int], tuple[dict[str, Any], dict[str, np.ndarray]]]:
    """Every case run on one model (built once), then one torch-reference call for all of them."""
    net, rec = _build()
    patch = pytest.MonkeyPatch()
    _recording_router_functions(rec, patch)
    try:
        outs = {case: _run(net, rec, *case) for case in CASES}
    finally:
        patch.undo()
    jobs: dict[str, np.ndarray] = {}
    for (mode, k), out in outs.items():
        jobs.update(_jobs(f"{mode}{k}", out, mode, k))
    ref = run(jobs)
    return {
        (mode, k): (out, {key[len(f"{mode}{k}") :]: v for key, v in ref.items() if key.startswith(f"{mode}{k}")})
        for (mode, k), out in outs.items()
    }


def _released_loss(logits: np.ndarray, k: int) -> float:
    """MindFormers' logged loss in float64 from the recorded logits: the mean over microbatches of each one's
    masked token mean ``Σ m·l / (Σ m + 1e-8)``."""
    x = _batch()
    z = logits.astype(np.float64)
    lse = np.log(np.exp(z - z.max(-1, keepdims=True)).sum(-1)) + z.max(-1)
    nll = lse - np.take_along_axis(z, x["labels"][..., None].astype(np.int64), -1)[..., 0]
    m, rows = x["loss_mask"], B // k
    means = [(nll[r : r + rows] * m[r : r + rows]).sum() / (m[r : r + rows].sum() + 1e-8) for r in range(0, B, rows)]
    return float(sum(means) / k)


@pytest.mark.parametrize(("mode", "k"), CASES)
def test_tiny_deepseek_v3_objective_mtp_aux_and_logit_gradients_match_torch(runs, mode: str, k: int) -> None:
    out, ref = runs[(mode, k)]
    assert out["calls"] == (k, k, 2 * k, 2 * k, 2 * k)  # per microbatch: 1 main loss, 1 MTP depth, 2 routers
    np.testing.assert_allclose(out["lm_objective"], ref[f"lm/{mode}/objective"], rtol=1e-6)
    np.testing.assert_allclose(LAMBDA * out["mtp_objective"], ref["mtp/objective"], rtol=1e-6)
    np.testing.assert_allclose(out["loss"], _released_loss(out["main"], k), rtol=1e-6)  # MindFormers' own, kept
    for r in range(2):  # both routers' global_aux_loss A_m, microbatch by microbatch
        np.testing.assert_allclose(out["aux"][r], ref[f"aux{r}/global_running"], rtol=1e-6)
    # MindFormers' layer-wise tracker (slots: dense layer 1, MoE layer 2, the MTP layer): Σ_m A_m / coeff
    np.testing.assert_allclose(out["tracker"] * COEFF, [0.0, *out["aux"].sum(1)], rtol=1e-6)
    np.testing.assert_allclose(out["grads"][0], ref[f"lm/{mode}/grad"], rtol=1e-5, atol=1e-6)
    # MTP: MindFormers 2.0.0's process_mtp_loss divides each microbatch's depth loss by its own token count
    # with no guard, so a microbatch without a depth-1 target (GA 4: row 1 alone) back-propagates 0/0 into its
    # MTP logits, with or without lossparity (the hook's own term is finite there: its log matched above)
    rows = B // k
    depth_mask = np.concatenate([_batch()["loss_mask"][:, 1:], np.zeros((B, 1), np.float32)], 1)
    empty = np.repeat(depth_mask.reshape(k, rows * S).sum(1) == 0, rows)
    assert empty.any() == (k == 4)
    assert np.isnan(out["grads"][1][empty]).all()
    np.testing.assert_allclose(out["grads"][1][~empty], ref["mtp/grad"][0][~empty], rtol=1e-5, atol=1e-6)


# -- the tiny DeepSeek-V4 model: the indexer loss over its 3 layers --------------------------------------------


def _v4_config() -> Any:
    """DeepSeek-V4's hybrid attention at toy size: 3 layers, each a compressed sparse attention with an indexer
    (compress ratio 4), hyper-connections (2 streams), MoE layers. CPU deviations: float32, softmax routing,
    no hash layers, no MTP, the unfused (naive) indexer and CSA paths (``apply_dsa_kernel_fusion`` off:
    the fused path is Ascend-only and requires ``csa_window_size`` 128)."""
    return DeepseekV4Config(
        vocab_size=V, seq_length=S, max_position_embeddings=S, hidden_size=16, num_hidden_layers=3,
        num_nextn_predict_layers=0, num_attention_heads=2, num_key_value_heads=1, head_dim=8, qk_nope_head_dim=4,
        qk_rope_head_dim=4, v_head_dim=8, q_lora_rank=8, o_lora_rank=8, o_groups=2, index_n_heads=2,
        index_head_dim=4, index_topk=4, num_hash_layers=0, compress_ratios=[4, 4, 4], sliding_window=4,
        hc_mult=2, n_routed_experts=E, num_experts_per_tok=TOPK, moe_intermediate_size=8,
        moe_shared_expert_intermediate_size=8, scoring_func="softmax", moe_grouped_gemm=True,
        moe_router_fusion=False, moe_permute_fusion=False, moe_router_enable_expert_bias=False,
        moe_router_load_balancing_type="global_aux_loss", moe_aux_loss_coeff=COEFF, apply_dsa_kernel_fusion=False,
        use_fused_mhc=False, dsa_indexer_loss_coeff=0.01, params_dtype="float32", compute_dtype="float32",
        layernorm_compute_dtype="float32", softmax_compute_dtype="float32", rotary_dtype="float32",
        router_dense_type="float32", pad_token_id=0,
    )  # fmt: skip


def test_tiny_deepseek_v4_index_loss_is_the_mean_over_its_3_layers(monkeypatch) -> None:
    """``get_index_loss()`` of the model after a step: with the hook's ``indexer_layers`` fix, the mean over the
    3 layers of the indexer losses their CSA cores computed; as released (``fixes="mindformers-2.0.0"``),
    layers 1 and 2 share slot 1 and the sum is divided by the 2 slots."""
    monkeypatch.setattr(ms.ops, "rms_norm", _cpu_ops._rms_norm)  # the hyper-connections and CSA take it at build
    net = PyNativeDeepseekV4ForCausalLM(_v4_config())
    rng = np.random.default_rng(2)
    for p in net.get_parameters():
        if p.requires_grad:
            p.set_data(Tensor(((1.0 if p.ndim == 1 else 0.0) + rng.normal(0.0, 0.3, p.shape)).astype(np.float32)))
        else:
            p.set_data(Tensor(np.zeros(p.shape, np.float32)).astype(p.dtype))
    net.set_train(True)
    calls: list[tuple[int, float]] = []
    save = csa.save_to_indexer_losses_tracker

    def record(loss: Tensor, layer_number: int, num_layers: int) -> None:
        calls.append((int(layer_number), float(loss.asnumpy().reshape(-1)[0])))
        save(loss, layer_number, num_layers)

    monkeypatch.setattr(csa, "save_to_indexer_losses_tracker", record)
    inputs = {key: Tensor(v) for key, v in _batch().items()}
    results = {}
    for fixes in ("lossparity", "mindformers-2.0.0"):
        calls.clear()
        indexer_utils.get_indexer_loss_tracker().clear()
        trainer = ProbeTrainer(net, 1)
        handle = lpmf.install(trainer, "per_sample", fixes=fixes)
        try:  # forward only (one microbatch): the indexer's backward is not part of this check
            trainer.compute_loss(trainer.model, trainer._split_micro_batch(inputs, 0))
        finally:
            handle.uninstall()
        results[fixes] = (list(calls), float(net.get_index_loss().asnumpy().reshape(-1)[0]))
    (fixed_calls, fixed), (released_calls, released) = results["lossparity"], results["mindformers-2.0.0"]
    per_layer = np.array([v for _, v in fixed_calls], np.float64)
    assert [slot for slot, _ in fixed_calls] == [1, 2, 3]
    assert [slot for slot, _ in released_calls] == [1, 1, 2]  # MindFormers 2.0.0: max(1, layer_number)
    np.testing.assert_allclose([v for _, v in released_calls], per_layer, rtol=1e-6)  # the same forward
    assert per_layer.min() > 0
    np.testing.assert_allclose(fixed, per_layer.mean(), rtol=1e-6)
    np.testing.assert_allclose(released, per_layer.sum() / 2, rtol=1e-6)
