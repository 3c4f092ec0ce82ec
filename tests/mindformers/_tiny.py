"""A stand-in trainer for the hook tests: MindFormers' own loss path on a logits table, driven by MindFormers'
own ``Trainer`` methods where they run on a CPU.

- :class:`TinyLM`: a cell whose one parameter is the logits table ``Z [B, S, V]`` of every row of the step (so
  the gradient w.r.t. it is the gradient w.r.t. the logits); its forward lays the microbatch's logits out as
  MindFormers' ``GPTModel.construct`` does (``[b·S, V]``, row-major) and calls MindFormers' real
  ``GPTModel.compute_language_model_loss`` with its real ``CrossEntropyLoss``.
- :class:`TinyTrainer`: MindFormers' real ``Trainer._split_micro_batch`` and ``Trainer.compute_loss``; its
  ``training_step`` is MindFormers' ``training_step`` + ``_forward_backward`` algebra (each microbatch's loss
  divided by ``K``, backward with MindFormers' own ``get_loss_sense``, ``1/world`` with several ranks; the
  gradients summed over the ranks and the logged loss averaged, as MindFormers' trainer does), with
  ``ms.value_and_grad`` for MindSpore's missing ``Tensor.backward`` (MindFormers gets that from hyper_parallel,
  which no registry here serves).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import mindspore as ms
import numpy as np
from mindformers.pynative.base_models.gpt.gpt_model import GPTModel
from mindformers.pynative.loss.loss import CrossEntropyLoss
from mindformers.pynative.trainer.trainer import Trainer
from mindspore import Parameter, Tensor, nn, ops


class TinyLM(nn.Cell):
    compute_language_model_loss = GPTModel.compute_language_model_loss

    def __init__(self, logits: np.ndarray) -> None:
        super().__init__()
        self.z = Parameter(Tensor(logits), name="z")
        self.loss = CrossEntropyLoss()
        self.pad_token_id, self.ignore_token_id = 0, -100
        self.calculate_per_token_loss = False

    def construct(self, input_ids, labels, loss_mask, row_index, actual_seq_len=None):  # noqa: ANN001, ANN201
        logits = ops.gather(self.z, row_index, 0)
        logits = logits.reshape(-1, logits.shape[-1])
        return (self.compute_language_model_loss(labels, logits, loss_mask),)


class TinyTrainer:
    _split_micro_batch = Trainer._split_micro_batch
    compute_loss = Trainer.compute_loss

    def __init__(self, model: TinyLM, k: int, rows: int, world: int = 1) -> None:
        self.model = [model]
        self.num_accumulation_steps = k
        self.enable_parallel = world > 1
        self.world_size = world
        self.metric_reduce_group = None  # the world group: data parallelism only
        self.config = SimpleNamespace(
            parallelism=SimpleNamespace(pipeline_parallel=1, context_parallel=1),
            training=SimpleNamespace(local_batch_size=rows // k),
        )
        self.compute_loss_func = None  # MindFormers default: the loss is the model output
        # the MoE/MTP/indexer auto-scalers' backward scale sense/K, as MindFormers' Trainer.__init__ sets it
        from mindformers.pynative.trainer.utils import set_auxiliary_loss_backward_scale  # noqa: PLC0415

        set_auxiliary_loss_backward_scale(self.config.parallelism, self.enable_parallel, k)
        self.grad: Any = None

    def training_step(self, inputs: dict[str, Tensor], loss: Any, grad_norm: Any, step: int) -> Any:
        from mindformers.pynative.distributed.utils import get_loss_sense  # noqa: PLC0415

        k = self.num_accumulation_steps
        z = self.model[0].z
        sense = get_loss_sense(self.config.parallelism, self.enable_parallel, k, apply_gradient_accumulation=False)
        self.grad = ops.zeros(z.shape, ms.float32)
        for micro in range(k):
            micro_inputs = self._split_micro_batch(inputs, micro)

            def forward(mi: dict[str, Tensor] = micro_inputs) -> Tensor:
                out = self.compute_loss(self.model, mi)
                return out / k if k > 1 else out

            value, grads = ms.value_and_grad(forward, None, weights=[z])()
            self.grad = self.grad + grads[0] * sense
            loss = loss + value
        if self.enable_parallel:
            from mindspore.mint.distributed import all_reduce  # noqa: PLC0415

            all_reduce(self.grad)  # the data-parallel gradient sum
            all_reduce(loss)
            loss = loss / self.world_size
        return loss, grad_norm


class TinyMTPLM(TinyLM):
    """:class:`TinyLM` plus ``D`` MTP depths through MindFormers' real ``process_mtp_loss`` and MTP auto-scaler:
    depth ``d``'s logits are the table ``Zm[d]`` (the "output layer" is the identity on them), and the main
    logits depend on the returned hidden states (× 0) so that the auto-scaler's backward runs, as in GPTModel."""

    def __init__(self, logits: np.ndarray, mtp_logits: np.ndarray, scale: float) -> None:
        from mindformers.pynative.transformers.multi_token_prediction import MTPLossAutoScaler  # noqa: PLC0415

        super().__init__(logits)
        self.zm = Parameter(Tensor(mtp_logits), name="zm")  # [D, B, S, V]
        depths = int(mtp_logits.shape[0])
        self.config = SimpleNamespace(
            mtp_num_layers=depths, mtp_loss_scaling_factor=scale, calculate_per_token_loss=False, chunk_loss_num=0
        )
        self.mtp_process = True
        self.mtp_loss_auto_scaler = MTPLossAutoScaler()

    def construct(self, input_ids, labels, loss_mask, row_index, actual_seq_len=None):  # noqa: ANN001, ANN201
        from mindformers.pynative.transformers.multi_token_prediction import process_mtp_loss  # noqa: PLC0415

        main = ops.gather(self.z, row_index, 0)  # [b, S, V]
        depths = [ops.gather(self.zm[d], row_index, 0) for d in range(self.config.mtp_num_layers)]
        hidden = ops.concat([x.transpose(1, 0, 2) for x in [ops.zeros_like(main), *depths]], 0)  # [(1+D)·S, b, V]
        out = process_mtp_loss(
            hidden,
            labels,
            loss_mask,
            lambda h, weight: h,
            None,
            self.compute_language_model_loss,
            self.config,
            self.mtp_loss_auto_scaler,
        )
        logits = (main + out.sum() * 0).reshape(-1, main.shape[-1])
        return (self.compute_language_model_loss(labels, logits, loss_mask),)


def moe_config(num_experts: int, topk: int, coeff: float) -> Any:
    """A tiny MindFormers ``TransformerConfig`` whose routers use ``global_aux_loss``."""
    from mindformers.parallel_core.transformer_config import TransformerConfig  # noqa: PLC0415

    return TransformerConfig(
        num_layers=2,
        hidden_size=16,
        num_attention_heads=2,
        ffn_hidden_size=32,
        num_moe_experts=num_experts,
        moe_router_topk=topk,
        moe_ffn_hidden_size=8,
        moe_router_load_balancing_type="global_aux_loss",
        moe_aux_loss_coeff=coeff,
        add_bias_linear=False,
        params_dtype="float32",
        compute_dtype="float32",
    )


class TinyMoELM(TinyLM):
    """:class:`TinyLM` plus one real MindFormers ``TopKRouter`` (``global_aux_loss``) that sees fixed router
    scores and routing maps of the microbatch's tokens through its own ``_apply_global_aux_loss``; the model's
    ``reset_model_temporary_tensors`` is GPTModel's. ``aux`` collects each microbatch's ``A_m`` as MindFormers'
    own layer-wise tracker records it (``aux_loss / coeff``)."""

    reset_model_temporary_tensors = GPTModel.reset_model_temporary_tensors
    _get_global_aux_loss_modules = GPTModel._get_global_aux_loss_modules

    def __init__(self, logits: np.ndarray, probs: np.ndarray, routing: np.ndarray, config: Any) -> None:
        from mindformers.pynative.transformers.moe.router import TopKRouter  # noqa: PLC0415

        super().__init__(logits)
        self.config = config
        self.router = TopKRouter(config, layer_number=1)
        self.router.reset_global_aux_loss_tracker()
        self.probs, self.routing = Tensor(probs), Tensor(routing)
        self.aux: list[float] = []

    def set_tables(self, probs: np.ndarray, routing: np.ndarray) -> None:
        self.probs, self.routing = Tensor(probs), Tensor(routing)

    def construct(self, input_ids, labels, loss_mask, row_index, actual_seq_len=None):  # noqa: ANN001, ANN201
        from mindformers.pynative.transformers.moe.moe_utils import get_moe_layer_wise_logging_tracker  # noqa: PLC0415

        e = self.probs.shape[-1]
        probs = ops.gather(self.probs, row_index, 0).reshape(-1, e)
        routing = ops.gather(self.routing, row_index, 0).reshape(-1, e)
        tracker = get_moe_layer_wise_logging_tracker()
        before = float(tracker["values"][1].asnumpy()) if tracker else 0.0
        self.router._apply_global_aux_loss(ops.ones((probs.shape[0], 2), ms.float32), probs, routing)
        after = float(get_moe_layer_wise_logging_tracker()["values"][1].asnumpy())
        self.aux.append((after - before) * self.config.moe_aux_loss_coeff)
        return super().construct(input_ids, labels, loss_mask, row_index, actual_seq_len)
