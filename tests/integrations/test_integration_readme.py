"""The integration snippets of docs/integrations.md run as written (each framework's section, executed in a namespace
that provides the user's objects) and give the numbers of an independent naive computation."""

from __future__ import annotations

import pathlib
import re
from types import SimpleNamespace

import pytest
import torch

PAGE = pathlib.Path(__file__).resolve().parents[2] / "docs" / "integrations.md"


def _snippet(title: str) -> str:
    text = PAGE.read_text()
    section = text[text.index(title + "\n") :]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def _run(title: str, ns: dict) -> dict:
    exec(compile(_snippet(title), f"docs/integrations.md {title}", "exec"), ns)
    return ns


@pytest.fixture(autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def test_hf_trainer_snippet(tmp_path):
    pytest.importorskip("transformers")
    from _hf_common import RowDataset, naive_step1_objective, padded_rows, tiny_model, training_args

    ns = _run(
        "## Hugging Face Trainer",
        {
            "model": tiny_model(),
            "args": training_args(str(tmp_path), 2, 4, steps=1),
            "train_dataset": RowDataset(padded_rows()),
        },
    )
    assert ns["step1"]["objective"] == pytest.approx(naive_step1_objective("per_sample", padded_rows()), rel=1e-5)
    assert "lm_loss" in ns["step1"]


def test_readme_hf_snippet(tmp_path):
    """The README's two-line HF example: the trainer it builds optimizes the per-sample objective."""
    pytest.importorskip("transformers")
    from _hf_common import RowDataset, naive_step1_objective, padded_rows, tiny_model, training_args

    readme = PAGE.parents[1] / "README.md"
    text = readme.read_text()
    code = re.search(r"```python\n(.*?)```", text[text.index("## Plug into your trainer") :], re.S).group(1)
    ns = {
        "model": tiny_model(),
        "args": training_args(str(tmp_path), 2, 4, steps=1),
        "train_dataset": RowDataset(padded_rows()),
    }
    exec(compile(code, "README plug into your trainer", "exec"), ns)
    ns["trainer"].train()
    step1 = ns["trainer"].state.log_history[0]
    assert step1["objective"] == pytest.approx(naive_step1_objective("per_sample", padded_rows()), rel=1e-5)


def test_trl_snippet(tmp_path):
    pytest.importorskip("trl")
    import datasets
    from _hf_common import tiny_model
    from _trl_common import examples, naive_mean_of_example_means, sft_args, tokenizer

    ns = _run(
        "## TRL SFTTrainer",
        {
            "model": tiny_model(),
            "tokenizer": tokenizer(),
            "sft_args": sft_args(str(tmp_path), 2, 4, padding_free=True, steps=1),
            "sft_dataset": datasets.Dataset.from_list(examples()),
        },
    )
    ns["sft"].train()
    first = [ns["sft"].train_dataset[i] for i in range(8)]
    assert ns["sft"].state.log_history[0]["objective"] == pytest.approx(naive_mean_of_example_means(first), rel=1e-5)


def test_megatron_snippet():
    pytest.importorskip("megatron.core")
    g = torch.Generator().manual_seed(0)
    losses = torch.rand(3, 5, generator=g, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0, 0, 0], [0] * 5, [1, 1, 1, 1, 1]], dtype=torch.float64)
    ns = _run("## Megatron-core", {"config": SimpleNamespace(calculate_per_token_loss=True)})
    batch = {"tokens": None, "labels": None, "loss_mask": mask}
    output, loss_func = ns["forward_step"](iter([batch]), lambda tokens, labels: losses)
    num, count, report = loss_func(output)
    naive = sum(float((losses[i] * mask[i]).sum()) / max(float(mask[i].sum()), 1.0) for i in range(3))
    assert float(num) == pytest.approx(naive, rel=1e-12) and int(count) == 3
    assert report["objective"].tolist() == pytest.approx([naive, 3.0])


def test_torchtitan_snippet():
    pytest.importorskip("torchtitan.trainer", exc_type=ImportError)
    from _titan_workers import titan_step
    from test_integration_torchtitan import _reference, _rel

    ns = _run("## torchtitan", {})
    got = titan_step("per_sample", slice(0, 16), 4, cls=ns["LossParityTrainer"], install=ns["use_lossparity"])
    assert _rel(got, _reference("per_sample")) <= 1e-10
