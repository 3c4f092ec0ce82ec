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

from typing import Any

import mindspore as ms
import numpy as np
import pytest
from _torch_ref import run
from mindspore import Tensor

import lossparity.mindformers as lpmf
import lossparity.mindspore as lpm

ms.set_context(mode=ms.PYNATIVE_MODE, device_target="CPU")

import _cpu_ops  # noqa: E402 (after the context is set)

_cpu_ops.enable_model()
from mindformers.models.deepseek3.configuration_deepseek_v3 import DeepseekV3Config  # noqa: E402
from mindformers.models.deepseek3.modeling_deepseek_v3_pynative import PyNativeDeepseekV3ForCausalLM  # noqa: E402
from mindformers.pynative.trainer.trainer import Trainer  # noqa: E402
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


class ForwardTrainer:
    """MindFormers' ``Trainer._split_micro_batch`` and ``compute_loss`` over ``K`` microbatches, each loss ÷ K
    summed as ``Trainer.training_step`` logs it; forward only (MindFormers' backward needs hyper_parallel)."""

    _split_micro_batch = Trainer._split_micro_batch
    compute_loss = Trainer.compute_loss

    def __init__(self, net: Any, k: int) -> None:
        from types import SimpleNamespace  # noqa: PLC0415

        self.model = [net]
        self.num_accumulation_steps, self.enable_parallel, self.world_size = k, False, 1
        self.metric_reduce_group, self.compute_loss_func = None, None
        self.config = SimpleNamespace(
            parallelism=SimpleNamespace(pipeline_parallel=1, context_parallel=1),
            training=SimpleNamespace(local_batch_size=B // k),
        )

    def training_step(self, inputs: dict[str, Tensor], loss: Any, grad_norm: Any, step: int) -> Any:
        k = self.num_accumulation_steps
        for micro in range(k):
            loss = loss + self.compute_loss(self.model, self._split_micro_batch(inputs, micro)) / k
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


@pytest.fixture(scope="module")
def model() -> tuple[Any, Recorder]:
    return _build()


def _run(model: tuple[Any, Recorder], mode: str, k: int, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    net, rec = model
    for name in vars(rec):
        getattr(rec, name).clear()
    _recording_router_functions(rec, monkeypatch)
    net.reset_model_temporary_tensors()  # the routers' running counts (MindFormers' own reset)
    get_moe_layer_wise_logging_tracker().clear()
    x = _batch()
    inputs = {key: Tensor(v) for key, v in x.items()}
    if mode == "per_document":
        inputs["actual_seq_len"] = Tensor(ASL)
    trainer = ForwardTrainer(net, k)
    handle = lpmf.install(trainer, mode)
    try:
        loss, _ = trainer.training_step(inputs, 0.0, 0.0, 0)
    finally:
        handle.uninstall()
    tracker = get_moe_layer_wise_logging_tracker()["values"].asnumpy()
    return {"loss": float(np.asarray(loss.asnumpy()).reshape(-1)[0]), "logs": handle.logs, "tracker": tracker}


def _jobs(rec: Recorder, mode: str, k: int) -> dict[str, np.ndarray]:
    x = _batch()
    seg = lpm.segment_ids_from_actual_seq_len(Tensor(ASL), S).asnumpy()  # the reference evaluates every mode
    logits = np.concatenate(rec.main)  # [B, S, V], the microbatches' rows in order
    mtp = np.concatenate(rec.mtp)[None]  # [1, B, S, V]
    jobs = {
        "job/lm/kind": np.array("lm"),
        "job/lm/logits": logits,
        "job/lm/labels": x["labels"],
        "job/lm/mask": x["loss_mask"],
        "job/lm/segment_ids": seg,
        "job/lm/microbatch_rows": np.array(B // k),
        "job/mtp/kind": np.array("mtp"),
        "job/mtp/mtp_logits": mtp,
        "job/mtp/labels": x["labels"],
        "job/mtp/mask": x["loss_mask"],
        "job/mtp/segment_ids": seg,
        "job/mtp/mode": np.array(mode),
        "job/mtp/scale": np.array(LAMBDA),
    }
    for r in range(2):  # router r's microbatches: calls r, r+2, ... (decoder MoE, then the MTP layer's MoE)
        probs = np.stack(rec.probs[r::2]).astype(np.float32)
        routing = np.stack(rec.routing[r::2])
        jobs.update(
            {
                f"job/aux{r}/kind": np.array("moe"),
                f"job/aux{r}/probs": probs,
                f"job/aux{r}/counts": routing.sum(1),
                f"job/aux{r}/tokens": np.full(len(probs), probs.shape[1], np.int64),
                f"job/aux{r}/topk": np.array(TOPK),
                f"job/aux{r}/coeff": np.array(COEFF),
            }
        )
    return jobs


def _released_loss(rec: Recorder, k: int) -> float:
    """MindFormers' logged loss in float64 from the recorded logits: the mean over microbatches of each one's
    masked token mean ``Σ m·l / (Σ m + 1e-8)``."""
    x = _batch()
    z = np.concatenate(rec.main).astype(np.float64)
    lse = np.log(np.exp(z - z.max(-1, keepdims=True)).sum(-1)) + z.max(-1)
    nll = lse - np.take_along_axis(z, x["labels"][..., None].astype(np.int64), -1)[..., 0]
    m, rows = x["loss_mask"], B // k
    return float(
        sum((nll[r : r + rows] * m[r : r + rows]).sum() / (m[r : r + rows].sum() + 1e-8) for r in range(0, B, rows)) / k
    )


@pytest.mark.parametrize(
    ("mode", "k"), [("per_sample", 1), ("per_sample", 2), ("per_sample", 4), ("per_token", 2), ("per_document", 4)]
)
def test_tiny_deepseek_v3_objective_mtp_and_aux_match_torch(model, monkeypatch, mode: str, k: int) -> None:
    out = _run(model, mode, k, monkeypatch)
    rec = model[1]
    assert len(rec.main) == k and len(rec.mtp) == k and len(rec.aux) == 2 * k == len(rec.probs)
    ref = run(_jobs(rec, mode, k))
    logs = out["logs"]
    np.testing.assert_allclose(logs["lossparity/lm_objective"].asnumpy(), ref[f"lm/{mode}/objective"], rtol=1e-6)
    np.testing.assert_allclose(LAMBDA * logs["lossparity/mtp_objective"].asnumpy(), ref["mtp/objective"], rtol=1e-6)
    np.testing.assert_allclose(out["loss"], _released_loss(rec, k), rtol=1e-6)  # MindFormers' loss, as released
    aux = np.array(rec.aux).reshape(k, 2).T  # [router, microbatch]
    for r in range(2):
        np.testing.assert_allclose(aux[r], ref[f"aux{r}/global_running"], rtol=1e-6)
    # MindFormers' layer-wise tracker: Σ over layers and microbatches of A_m / coeff
    np.testing.assert_allclose(out["tracker"].sum() * COEFF, aux.sum(), rtol=1e-6)
