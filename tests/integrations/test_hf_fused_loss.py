"""LossParityMixin's fused loss (the default): the loss from the LM head's input and weight, no logits tensor.

The reference is the logits path of the same trainer (``fused_loss=False``: ``F.cross_entropy`` on the
model's logits, float64 for a float64 model), itself checked against plain ``transformers.Trainer`` and
naive loops in test_integration_hf.py. Models: tiny float64 Llama (untied and tied head), Cohere
(``logits · logit_scale``, tied), Granite (``logits / logits_scaling``), and Gemma2 (final logit
soft-capping: the fallback with its note).
"""

from __future__ import annotations

import sys

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402
from _hf_common import TINY, VOCAB, RowDataset, grad_recorder, rows_for, training_args  # noqa: E402


def model_of(kind: str, dtype: torch.dtype = torch.float64):
    """A seeded 1-layer model from a config."""
    import transformers

    torch.manual_seed(0)
    if kind == "llama_tied":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY, tie_word_embeddings=True))
    elif kind == "cohere":
        model = transformers.CohereForCausalLM(transformers.CohereConfig(**TINY, logit_scale=0.37))
    elif kind == "granite":
        model = transformers.GraniteForCausalLM(transformers.GraniteConfig(**TINY, logits_scaling=3.0))
    elif kind == "gemma2":
        config = transformers.Gemma2Config(**TINY, head_dim=8, final_logit_softcapping=2.0)
        model = transformers.Gemma2ForCausalLM(config)
    elif kind == "scaled_unknown":  # a custom model that scales its logits after the head, unknown to lossparity

        class Scaled(transformers.LlamaForCausalLM):
            def forward(self, input_ids=None, attention_mask=None, position_ids=None, **kw):
                kw.update(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids)
                out = super().forward(**kw)
                out.logits = out.logits * 2.0
                return out

        model = Scaled(transformers.LlamaConfig(**TINY))
    else:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY))
    return model.to(dtype)


def one_step(tmp_path, kind: str, mode: str, fused: bool, data: str, b: int = 2, ga: int = 2):
    """One SGD step at learning rate 0 (8 rows); returns (the step's gradients, its logs, the trainer)."""
    from lossparity.integrations.hf import LossParityTrainer

    rec = grad_recorder()
    trainer = LossParityTrainer(
        model=model_of(kind),
        args=training_args(str(tmp_path), b, ga, 1, learning_rate=0.0),
        train_dataset=RowDataset(rows_for(data)[: b * ga]),
        callbacks=[rec],
        loss_mode=mode,
        fused_loss=fused,
    )
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # 2 shared cores: one intra-op thread, restored afterwards
    # count the fused kernel's calls in training: a silent fall back to the logits path would make none
    hf_module, calls = sys.modules[LossParityTrainer.__module__], []
    kernel = hf_module.fused_linear_cross_entropy

    def counted(*args, **kwargs):
        calls.append(1)
        return kernel(*args, **kwargs)

    hf_module.fused_linear_cross_entropy = counted
    try:
        trainer.train()
    finally:
        torch.set_num_threads(threads)
        hf_module.fused_linear_cross_entropy = kernel
    trainer.fused_calls = len(calls)
    logs = [x for x in trainer.state.log_history if "objective" in x]
    return rec.grads[0], logs[0], trainer


@pytest.mark.parametrize(
    "kind,mode,data",
    [
        ("llama", "per_sample", "padded"),
        ("llama", "per_token", "padded"),
        ("llama_tied", "per_document", "packed"),
        ("cohere", "per_sample", "padded"),
        ("granite", "per_document", "packed"),
    ],
)
def test_fused_and_logits_paths_agree_in_float64(tmp_path, kind, mode, data):
    g_fused, log_fused, fused = one_step(tmp_path, kind, mode, True, data)
    g_logits, log_logits, logits = one_step(tmp_path, kind, mode, False, data)
    # the fused run took the fused path in each of its 2 microbatches, the logits run never
    assert (fused.fused_calls, logits.fused_calls) == (2, 0)
    assert g_fused.keys() == g_logits.keys()
    worst = max(float((g_fused[n] - g).abs().max() / g.abs().max()) for n, g in g_logits.items() if g.abs().max() > 0)
    print(f"measured: {kind} {mode} fused vs logits path, float64 step gradients: max rel {worst:.1e}")
    for name, g in g_logits.items():
        torch.testing.assert_close(g_fused[name], g, rtol=1e-10, atol=1e-13, msg=name)
    for key in ("objective", "lm_loss"):
        assert log_fused[key] == pytest.approx(log_logits[key], rel=1e-12), key


@pytest.mark.parametrize("mode", ["per_sample", "per_document", "per_microbatch"])
def test_evaluation_loss_and_its_gradients_agree(tmp_path, mode):
    # Outside training, compute_loss returns the batch's own J: from the fused loss's per-token weights, or
    # from the logits by the mode's formula. Both are differentiable; compare values and gradients.
    rows = rows_for("packed")[:4]
    batch = {k: torch.stack([r[k] for r in rows]) for k in rows[0]}
    results = []
    for fused in (True, False):
        _, _, trainer = one_step(tmp_path, "llama", mode, fused, "packed")
        model = trainer.model
        model.zero_grad()
        loss, out = trainer.compute_loss(model, dict(batch), return_outputs=True)
        loss.backward()
        results.append((float(loss), {n: p.grad.clone() for n, p in model.named_parameters()}, out.logits.shape))
    (lf, gf, shape_f), (ll, gl, shape_l) = results
    assert lf == pytest.approx(ll, rel=1e-12)
    for name, g in gl.items():
        torch.testing.assert_close(gf[name], g, rtol=1e-10, atol=1e-13, msg=name)
    # The fused path's model computed no logits: the head saw an empty slice of the sequence.
    assert tuple(shape_f) == (4, 0, VOCAB) and tuple(shape_l) == (4, batch["input_ids"].shape[1], VOCAB)


def test_soft_capped_model_falls_back_with_one_note(tmp_path, capsys):
    g_default, log_default, fell_back = one_step(tmp_path, "gemma2", "per_sample", True, "padded", b=2, ga=2)
    assert fell_back.fused_calls == 0
    printed = capsys.readouterr().out
    notes = [line for line in printed.splitlines() if line.startswith("lossparity:")]
    assert len(notes) == 1, printed
    assert "'gemma2'" in notes[0] and "soft-capped" in notes[0] and "final_logit_softcapping=2.0" in notes[0]
    # The fallback is the logits path: the same numbers as fused_loss=False, which prints nothing.
    g_logits, log_logits, _ = one_step(tmp_path, "gemma2", "per_sample", False, "padded", b=2, ga=2)
    assert not [line for line in capsys.readouterr().out.splitlines() if line.startswith("lossparity:")]
    for name, g in g_logits.items():
        assert torch.equal(g_default[name], g), name
    assert log_default["objective"] == log_logits["objective"]


def test_unknown_logit_transform_is_refused_before_the_first_step(tmp_path):
    with pytest.raises(ValueError, match=r"model: model_type 'llama' transforms the LM head's output"):
        one_step(tmp_path, "scaled_unknown", "per_sample", True, "padded")


def test_head_plans():
    import transformers

    from lossparity.integrations.hf_head import plan_head

    assert plan_head(model_of("llama")).fused and plan_head(model_of("llama_tied")).scale == 1.0
    cohere, granite = plan_head(model_of("cohere")), plan_head(model_of("granite"))
    assert cohere.fused and cohere.scale == 0.37 and cohere.scale_source == "logit_scale"
    assert granite.fused and granite.scale == pytest.approx(1 / 3.0)
    biased = model_of("llama")
    biased.lm_head = torch.nn.Linear(16, VOCAB, bias=True).double()
    plan = plan_head(biased)
    assert not plan.fused and "bias" in plan.note() and "'llama'" in plan.note()
    custom = model_of("llama")
    custom.lm_head = torch.nn.Sequential(torch.nn.Linear(16, VOCAB, bias=False))
    assert "Sequential" in plan_head(custom).note()
    assert "sharded" in plan_head(model_of("llama"), sharded=True).note()
    # soft-capping set on the text config of a multimodal-style config is found too
    config = transformers.Gemma2Config(**TINY, head_dim=8, final_logit_softcapping=None)
    assert plan_head(transformers.Gemma2ForCausalLM(config)).fused


def test_fused_loss_flag_is_checked(tmp_path):
    from lossparity.integrations.hf import LossParityTrainer

    with pytest.raises(TypeError, match="fused_loss"):
        LossParityTrainer(
            model=model_of("llama"),
            args=training_args(str(tmp_path), 2, 1, 1),
            train_dataset=RowDataset(rows_for("padded")),
            fused_loss="yes",
        )
