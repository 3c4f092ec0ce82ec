"""MTP layers in ``LossParityTrainer`` (real ``transformers.Trainer``, CPU): transformers' ``MtpModel``
attached with ``attach_mtp`` and a user's own MTP module through the ``mtp_hidden_states``/``mtp_logits``
outputs. Layouts of one global batch of 8 rows: 8 × GA 1, 2 × GA 4 (fused and logits paths), 2 gloo ranks ×
2 × GA 2. Expected values: ``_hf_mtp_common.naive_objective`` (every document run alone, float64, means
written out) and ``hand_mtp_tokens`` (a loop over the documents' labels), never lossparity's code.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402
from _hf_common import TINY, RowDataset, training_args  # noqa: E402
from _hf_mtp_common import hand_mtp_tokens, naive_objective, rows_for, run  # noqa: E402

from lossparity.distributed.launch import free_port  # noqa: E402

HERE = Path(__file__).resolve().parent
SRC = HERE.parents[1] / "src"
TOL64 = 1e-10


@pytest.fixture(autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _rel(a: dict, b: dict) -> float:
    """max over tensors of |a - b|∞ / |b|∞."""
    return max(float((a[n] - b[n]).abs().max() / b[n].abs().max().clamp_min(1e-300)) for n in b)


def _check_against_reference(spec: dict, results: dict[str, tuple], label: str) -> None:
    """Every layout's first-step gradients and final parameters equal the 8 × GA 1 run's to 1e-10, its
    step-1 objective the naive one, its MTP token counts the hand count."""
    rows = rows_for(spec["data"])
    naive = naive_objective(rows, spec["depths"], spec["mode"], spec["convention"])
    hand = [float(hand_mtp_tokens(rows, k)) for k in range(1, spec["depths"] + 1)]
    ref = results["8x1"]
    for name, (params, logs, grads, counts) in results.items():
        g, p = _rel(grads[0], ref[2][0]), _rel(params, ref[0])
        print(f"measured: HF MTP {label} {name} vs 8x1: step-1 grads {g:.1e}, params after 2 steps {p:.1e}")
        assert g <= TOL64 and p <= TOL64, (label, name, g, p)
        assert logs[0]["objective"] == pytest.approx(naive, rel=TOL64, abs=0), (label, name)
        assert counts[0] == hand, (label, name, counts[0], hand)
        assert all(f"mtp_{k}_loss" in logs[0] for k in range(1, spec["depths"] + 1))


SPECS = [
    dict(depths=1, convention="own", mode="per_sample", data="padded"),
    dict(depths=2, convention="pooled", mode="per_document", data="packed"),
]


def _label(spec: dict) -> str:
    return f"{spec['depths']} layer(s) {spec['convention']} {spec['mode']} {spec['data']}"


@pytest.mark.parametrize("spec", SPECS, ids=_label)
def test_mtp_is_ga_invariant_and_equals_naive_per_document_reference(tmp_path, spec):
    results = {}
    for name, b, ga, fused in (("8x1", 8, 1, True), ("2x4", 2, 4, True), ("2x4 logits path", 2, 4, False)):
        results[name] = run(str(tmp_path), {**spec, "b": b, "ga": ga, "fused": fused})
    _check_against_reference(spec, results, _label(spec))


@pytest.mark.slow
def test_mtp_two_gloo_ranks_equal_one_process(tmp_path):
    runs = [{**s, "name": _label(s), "b": 2, "ga": 2} for s in SPECS]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(SRC), str(HERE)]), OMP_NUM_THREADS="1")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes=1",
        "--nproc_per_node=2",
        "--master_addr=127.0.0.1",
        f"--master_port={free_port()}",
        str(HERE / "_hf_mtp_common.py"),
        str(tmp_path / "out"),
        json.dumps(runs),
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    ranks = [torch.load(tmp_path / f"out.rank{r}.pt") for r in range(2)]
    for spec in SPECS:
        got = ranks[0][_label(spec)]
        assert _rel(ranks[1][_label(spec)]["params"], got["params"]) == 0  # DDP: the same update on both ranks
        results = {
            "8x1": run(str(tmp_path), {**spec, "b": 8, "ga": 1}),
            "2 ranks x 2 x GA 2": (got["params"], got["logs"], got["grads"], got["counts"]),
        }
        _check_against_reference(spec, results, _label(spec))


def test_mtp_float32_equals_float64_reference_to_float32_rounding(tmp_path):
    spec = {**SPECS[1], "b": 2, "ga": 4}
    p64, l64, g64, _ = run(str(tmp_path), spec)
    p32, l32, g32, _ = run(str(tmp_path), {**spec, "dtype": "float32"})
    worst = _rel({n: g.double() for n, g in g32[0].items()}, g64[0])
    print(f"measured: HF MTP float32 2x4 vs float64: step-1 grads {worst:.1e}")
    assert worst <= 1e-4
    assert l32[0]["objective"] == pytest.approx(l64[0]["objective"], rel=1e-6)


class _OwnMTP(torch.nn.Module):
    """A user's MTP module: depth k maps the previous depth's hidden state through a linear layer (no token
    input, so no document can leak into another); its logits come from the shared LM head (``hidden``) or a
    head of its own (``logits``)."""

    def __init__(self, depths: int, own_head: bool) -> None:
        super().__init__()
        h = TINY["hidden_size"]
        self.proj = torch.nn.ModuleList(torch.nn.Linear(h, h) for _ in range(depths))
        self.head = torch.nn.Linear(h, TINY["vocab_size"], bias=True) if own_head else None

    def forward(self, hidden: torch.Tensor) -> list[torch.Tensor]:
        out = []
        for proj in self.proj:
            hidden = torch.tanh(proj(hidden))
            out.append(hidden if self.head is None else self.head(hidden))
        return out


def _own_model(depths: int, own_head: bool):
    import transformers

    from lossparity.integrations.hf_mtp import with_mtp_output

    class WithMTP(transformers.LlamaForCausalLM):
        def __init__(self, config):
            super().__init__(config)
            # transformers infers loss_type from the class name (…ForCausalLM); the Trainer shifts labels by it
            self.loss_type = "ForCausalLM"
            self.own_mtp = _OwnMTP(depths, own_head)

        def forward(self, input_ids=None, attention_mask=None, position_ids=None, **kw):
            kw["output_hidden_states"] = True
            out = super().forward(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, **kw)
            key = "mtp_logits" if own_head else "mtp_hidden_states"
            return with_mtp_output(out, key, self.own_mtp(out.hidden_states[-1]))

    torch.manual_seed(0)
    return WithMTP(transformers.LlamaConfig(**TINY)).double()


def _naive_own(model, rows, depths: int, own_head: bool) -> float:
    """per_document, own convention, λ = 0.5: every document alone, float64, by hand."""
    units = []
    with torch.no_grad():
        for row in rows:
            starts = [int(t) for t in torch.nonzero(row["position_ids"] == 0).flatten()] + [len(row["labels"])]
            for a, b in zip(starts, starts[1:]):
                ids, labels = row["input_ids"][a:b], row["labels"][a:b]
                hidden = model.model(input_ids=ids[None], use_cache=False).last_hidden_state
                outs = [model.lm_head(hidden)] + model.own_mtp(hidden)
                unit = []
                for k, x in enumerate(outs):
                    logp = torch.log_softmax((x if k == 0 or own_head else model.lm_head(x))[0], -1)
                    terms = [
                        -float(logp[t, labels[t + k + 1]]) for t in range(b - a - k - 1) if labels[t + k + 1] != -100
                    ]
                    unit.append(sum(terms) / max(len(terms), 1))
                units.append(unit)
    n = len(units)
    return sum(u[0] for u in units) / n + 0.5 * sum(sum(u[k] for u in units) / n for k in range(1, depths + 1)) / depths


@pytest.mark.parametrize("own_head", [False, True], ids=["mtp_hidden_states", "mtp_logits"])
def test_users_own_mtp_module_through_the_output_hook(own_head):
    from lossparity.integrations.hf import LossParityTrainer

    rows = rows_for("packed")
    naive = _naive_own(_own_model(2, own_head), rows, 2, own_head)
    params = []
    for b, ga in ((8, 1), (2, 4)):
        model = _own_model(2, own_head)
        with tempfile.TemporaryDirectory() as tmp:
            trainer = LossParityTrainer(
                model=model,
                args=training_args(tmp, b, ga, 2),
                train_dataset=RowDataset(rows),
                loss_mode="per_document",
                mtp_depths=2,
                mtp_weight=0.5,
            )
            trainer.train()
        logs = trainer.state.log_history
        assert logs[0]["objective"] == pytest.approx(naive, rel=TOL64, abs=0)
        params.append({n: p.detach().clone() for n, p in model.named_parameters()})
    assert _rel(params[1], params[0]) <= TOL64


def test_mtp_bad_input_names_the_argument(tmp_path):
    import transformers
    from _hf_mtp_common import mtp_model

    from lossparity.integrations.hf import LossParityTrainer
    from lossparity.integrations.hf_mtp import attach_mtp

    args = training_args(str(tmp_path), 2, 1, 1)
    data = RowDataset(rows_for("padded"))
    with pytest.raises(ValueError, match="mtp_depths=1 but the model has 2 MTP layers"):
        LossParityTrainer(model=mtp_model(2), args=args, train_dataset=data, mtp_depths=1)
    with pytest.raises(ValueError, match="mtp_weight"):
        LossParityTrainer(model=mtp_model(1), args=args, train_dataset=data, mtp_weight=-1.0)
    with pytest.raises(ValueError, match="mtp_convention"):
        LossParityTrainer(model=mtp_model(1), args=args, train_dataset=data, mtp_convention="mean")
    with pytest.raises(ValueError, match="already"):
        attach_mtp(mtp_model(1), 1)
    plain = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY))
    with pytest.raises(ValueError, match="num_mtp_layers"):
        attach_mtp(plain)
    trainer = LossParityTrainer(model=plain, args=args, train_dataset=data, mtp_depths=1)
    with pytest.raises(ValueError, match="^model: mtp_depths=1 but its outputs have neither"):
        trainer.train()


def test_attached_mtp_leaves_plain_forward_and_generate_alone():
    from _hf_mtp_common import mtp_model

    model, rows = mtp_model(1), rows_for("padded")
    out = model(input_ids=rows[0]["input_ids"][None])
    assert "mtp_hidden_states" not in out  # the layers run in LossParityTrainer's loss forward only
    assert any(n.startswith("lossparity_mtp.layers.0.") for n, _ in model.named_parameters())


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "logits path"])
def test_evaluate_reports_the_batch_objective_with_the_mtp_term(tmp_path, fused):
    from _hf_mtp_common import LAMBDA, mtp_model

    from lossparity.integrations.hf import LossParityTrainer

    rows = rows_for("packed")
    args = training_args(str(tmp_path), 8, 1, 1, per_device_eval_batch_size=8)
    trainer = LossParityTrainer(
        model=mtp_model(2),
        args=args,
        eval_dataset=RowDataset(rows),
        loss_mode="per_document",
        mtp_convention="pooled",
        mtp_weight=LAMBDA,
        fused_loss=fused,
    )
    got = trainer.evaluate()["eval_loss"]
    assert got == pytest.approx(naive_objective(rows, 2, "per_document", "pooled"), rel=1e-10)
