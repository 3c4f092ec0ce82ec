"""MoE models recognised by structure (``lossparity.integrations.hf_moe``) and their aux term in
``LossParityTrainer``: JetMoE (coefficient ``aux_loss_coef``) and DBRX (experts, top-k and coefficient in
``ffn_config``), whose terms were silently dropped when only ``router_aux_loss_coef`` was read.

Expected values: the model's own ``aux_loss`` (transformers' ``load_balancing_loss_func``), a float64
cross-entropy by hand from the model's logits, and plain ``transformers.Trainer`` (which adds
``coef · aux_loss`` inside the model's forward) on the whole batch."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from _hf_common import VOCAB, RowDataset, grad_recorder, padded_rows, training_args  # noqa: E402

COEF = 0.5  # large, so that a dropped or mis-weighted aux term shows far above float32 noise
TOL = 1e-6  # plain Trainer's aux term is computed in float32 inside transformers


@pytest.fixture(autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def moe_model(kind: str):
    """JetMoE or DBRX: 2 layers, 4 experts top-2, float64, eager experts, router logits on, seeded."""
    import transformers

    torch.manual_seed(0)
    if kind == "jetmoe":
        config = transformers.JetMoeConfig(
            vocab_size=VOCAB,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            kv_channels=8,
            num_local_experts=4,
            num_experts_per_tok=2,
            aux_loss_coef=COEF,
            output_router_logits=True,
        )
    else:
        config = transformers.DbrxConfig(
            vocab_size=VOCAB,
            d_model=16,
            n_heads=2,
            n_layers=2,
            max_seq_len=64,
            # transformers' DBRX attention reads rope_theta and clip_qkv from attn_config (no default)
            attn_config={"kv_n_heads": 1, "clip_qkv": 8.0, "rope_theta": 10000.0},
            ffn_config={"hidden_size": 16, "ffn_hidden_size": 32, "moe_num_experts": 4, "moe_top_k": 2},
            output_router_logits=True,
        )
        config.ffn_config.moe_loss_weight = COEF
    config._experts_implementation = "eager"
    return transformers.AutoModelForCausalLM.from_config(config).double()


def _batch() -> dict[str, torch.Tensor]:
    rows = padded_rows(8)
    return {k: torch.stack([r[k] for r in rows]) for k in ("input_ids", "attention_mask", "labels")}


def _run(tmp_path, kind: str, b: int, ga: int, steps: int, scope: str | None):
    import transformers

    from lossparity.integrations.hf import LossParityTrainer

    rec = grad_recorder()
    kw = dict(
        model=moe_model(kind),
        args=training_args(str(tmp_path), b, ga, steps, learning_rate=0.0),
        train_dataset=RowDataset(padded_rows(8)),
        callbacks=[rec],
    )
    trainer = (
        transformers.Trainer(**kw) if scope is None else LossParityTrainer(**kw, loss_mode="per_token", aux_scope=scope)
    )
    trainer.train()
    return rec.grads, trainer.state.log_history


def _rel(a: dict, b: dict) -> float:
    num = sum(float(((a[n] - b[n]) ** 2).sum()) for n in b)
    return (num / sum(float((b[n] ** 2).sum()) for n in b)) ** 0.5


def test_configs_are_read_through_the_name_table():
    import transformers

    from lossparity.integrations.hf_moe import aux_coefficient, moe_info

    jet = moe_model("jetmoe")
    info = moe_info(jet.config, jet)
    assert (info.experts, info.top_k, info.coef, info.coef_field) == (4, 2, COEF, "aux_loss_coef")
    dbrx = moe_model("dbrx")
    info = moe_info(dbrx.config, dbrx)
    assert (info.experts, info.top_k, info.coef) == (4, 2, COEF)
    assert (info.experts_field, info.coef_field) == ("ffn_config.moe_num_experts", "ffn_config.moe_loss_weight")
    aria = transformers.AriaTextConfig(moe_num_experts=8, moe_topk=2)
    aria_info = moe_info(aria)
    assert (aria_info.experts, aria_info.top_k, aria_info.coef) == (8, 2, None)
    assert moe_info(transformers.LlamaConfig()) is None
    # An MoE whose configuration has no coefficient under any known name is refused, not trained without it.
    ds = transformers.DeepseekV3Config(n_routed_experts=4, num_experts_per_tok=2, output_router_logits=True)
    with pytest.raises(ValueError, match="no load-balancing coefficient under any of router_aux_loss_coef"):
        aux_coefficient(ds)
    ds.output_router_logits = False
    assert aux_coefficient(ds) is None  # router logits off: the model's own loss has no aux term either


@pytest.mark.parametrize("kind", ["jetmoe", "dbrx"])
def test_aux_term_is_in_the_loss_and_ga4_equals_ga1(tmp_path, kind):
    batch = _batch()
    model = moe_model(kind)
    with torch.no_grad():
        out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False)
    own_aux = float(out.aux_loss)  # transformers' load_balancing_loss_func on the whole batch
    y = F.pad(batch["labels"][:, 1:], (0, 1), value=-100)
    lm = float(F.cross_entropy(out.logits.double().flatten(0, 1), y.flatten(), ignore_index=-100))  # per_token

    plain, _ = _run(tmp_path / "plain", kind, 8, 1, 1, None)  # coef · aux added by the model's forward
    whole, logs1 = _run(tmp_path / "ga1", kind, 8, 1, 2, "global_lagged")
    ga4, logs4 = _run(tmp_path / "ga4", kind, 2, 4, 2, "global_lagged")
    # lr 0, one batch: step 2's lagged fractions are the whole batch's own, so it is HF's term on the batch.
    for logs in (logs1, logs4):
        step2 = [x for x in logs if "aux_loss" in x][1]
        print(f"measured: {kind} aux {step2['aux_loss']!r} (model's own {own_aux!r}), objective {step2['objective']!r}")
        assert step2["aux_loss"] == pytest.approx(own_aux, rel=TOL)
        assert step2["lm_loss"] == pytest.approx(lm, rel=TOL)  # logged through float32
        assert step2["objective"] == pytest.approx(lm + COEF * own_aux, rel=TOL)
    assert _rel(whole[-1], plain[0]) <= TOL  # the term is in the gradient, as plain Trainer has it at GA 1
    dist = _rel(ga4[-1], whole[-1])
    print(f"measured: {kind} global_lagged GA 4 vs GA 1 gradient: {dist:.1e}")
    assert dist <= 1e-12
