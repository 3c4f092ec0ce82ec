"""The README and the pages of docs/ hold code that runs as written.

Every ``python`` block of README.md and docs/*.md must be listed in ``EXECUTED`` with the test that runs it;
the blocks of this file's own tests are checked against independent computations (naive float64 formulas).
"""

from __future__ import annotations

import contextlib
import io
import pathlib
import re

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
_BLOCK = re.compile(r"```python\n(.*?)```", re.S)

# (page, first line of the block) -> the test that executes it
EXECUTED = {
    ("README.md", "import torch"): "tests/test_readme.py::test_quick_start_snippet_runs_and_matches_naive_formula",
    (
        "README.md",
        "from lossparity.integrations.hf import LossParityTrainer  # was: from transformers import Trainer",
    ): ("tests/integrations/test_integration_readme.py::test_readme_hf_snippet"),
    ("docs/accountant.md", "import torch"): "tests/test_docs.py::test_accountant_fused_head_block",
    ("docs/moe.md", "import torch"): "tests/test_docs.py::test_moe_worked_example_matches_megatron",
    (
        "docs/integrations.md",
        "from lossparity.integrations.hf import LossParityTrainer  # was: from transformers import Trainer",
    ): ("tests/integrations/test_integration_readme.py::test_hf_trainer_snippet"),
    ("docs/integrations.md", "import trl"): "tests/integrations/test_integration_readme.py::test_trl_snippet",
    ("docs/integrations.md", "import torch"): (
        "tests/integrations/test_integration_deepspeed.py::test_documented_recipe_steps_on_the_objective_gradient"
    ),
    ("docs/integrations.md", "from functools import partial"): (
        "tests/integrations/test_integration_readme.py::test_megatron_snippet"
    ),
    ("docs/integrations.md", "from torchtitan.trainer import Trainer"): (
        "tests/integrations/test_integration_readme.py::test_torchtitan_snippet"
    ),
    (
        "docs/jax.md",
        "import os",
    ): "tests/jax/test_jax_readme.py::test_maxtext_step_with_ga_and_mesh_matches_float64_and_maxtext_formulas",
    ("docs/jax.md", "import jax"): "tests/jax/test_jax_readme.py::test_maxtext_recipe_runs_with_documented_output",
    ("docs/mindformers.md", "import lossparity.mindformers as lpmf"): (
        "tests/mindformers/test_mindformers_hook.py::test_docs_page_block_runs"
    ),
    ("docs/megatron.md", "from functools import partial"): (
        "tests/integrations/test_integration_megatron_moe.py::test_moe_terms_dp2_tp2_sp_cp2_pp2_give_the_objective_gradients_and_logs"
    ),
    ("docs/hf-trainer.md", "import torch"): "tests/integrations/test_hf_docs.py::test_hf_trainer_doc_block_runs",
    ("docs/audit.md", "import torch"): "tests/audit/test_audit_stacks.py::test_docs_audit_page_block_runs",
    ("docs/rl.md", "import torch"): "tests/test_rl_modes.py::test_rl_doc_block_runs",
    # "*": one test runs every python block of the page
    ("docs/accountant-internals.md", "*"): "tests/test_accountant.py::test_docs_accountant_page_code_blocks_run",
    ("docs/checkpoints.md", "*"): "tests/test_checkpoint_safety.py::test_checkpoint_doc_python_blocks_run",
    ("docs/verify-your-model.md", "*"): "tests/integrations/test_verify_hf.py::test_docs_model_example_runs",
    ("docs/cli-output.md", "*"): "tests/test_cli_text.py::test_cli_output_page_code_blocks_run",
    (
        "docs/parity-guard.md",
        "*",
    ): "tests/test_parity_guard_doc.py::test_python_blocks_run_and_print_what_the_page_shows",
}


def python_blocks(page: str) -> list[str]:
    """The ``python`` code blocks of a page of the repository, in order."""
    return _BLOCK.findall((ROOT / page).read_text())


def block(page: str, first_line: str) -> str:
    """The ``python`` block of ``page`` whose first line is ``first_line``."""
    found = [b for b in python_blocks(page) if b.split("\n", 1)[0] == first_line]
    assert len(found) == 1, f"{page}: {len(found)} python blocks start with {first_line!r}"
    return found[0]


def test_every_python_block_is_executed_by_a_test():
    pages = ["README.md", *sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").glob("*.md"))]
    unlisted = [
        (page, b.split("\n", 1)[0])
        for page in pages
        for b in python_blocks(page)
        if (page, b.split("\n", 1)[0]) not in EXECUTED and (page, "*") not in EXECUTED
    ]
    assert not unlisted, f"python blocks that no test executes (add a test and list it in EXECUTED): {unlisted}"
    for (page, first), test in EXECUTED.items():
        if first == "*":
            assert python_blocks(page), f"{page} has no python block"
        else:
            block(page, first)  # still there, once
        path, name = test.split("::")
        assert f"def {name}(" in (ROOT / path).read_text(), f"{test} does not exist"


def test_accountant_fused_head_block():
    out = io.StringIO()
    ns: dict = {}
    torch.manual_seed(0)
    with contextlib.redirect_stdout(out):
        exec(compile(block("docs/accountant.md", "import torch"), "docs/accountant.md", "exec"), ns)
    body, head, tokens, labels, mask, seg = (ns[k] for k in ("body", "head", "tokens", "labels", "mask", "segment_ids"))
    # Naive float64 per-document mean over the documents (row, id) of contiguous ids, from full logits.
    emb, w_out = body.weight.detach().double(), head.weight.detach().double().requires_grad_(True)
    logits = emb[tokens] @ w_out.T
    lse = torch.logsumexp(logits, -1)
    ce = lse - logits.gather(-1, labels.clamp(min=0)[..., None])[..., 0]
    docs = []
    for i in range(mask.shape[0]):
        for d in seg[i].unique().tolist():
            if d == 0:
                continue
            sel = (seg[i] == d) & (mask[i] > 0)
            docs.append((ce[i][sel].sum(), float(sel.sum())))
    objective = sum(s / max(n, 1.0) for s, n in docs) / len(docs)
    lm_loss = float(sum(s.detach() for s, _ in docs) / sum(n for _, n in docs))
    objective.backward()
    assert ns["logs"]["objective"] == pytest.approx(float(objective.detach()), rel=1e-5)
    assert ns["logs"]["lm_loss"] == pytest.approx(lm_loss, rel=1e-5)
    assert ns["logs"]["documents"] == len(docs) == 4
    assert torch.allclose(head.weight.grad.double(), w_out.grad, rtol=1e-4, atol=1e-6)
    assert out.getvalue().startswith("objective ")


def test_readme_compare_example_runs(tmp_path, monkeypatch, capsys):
    """The README's three commands run as written (in-process) and the two layouts agree."""
    from lossparity.cli import main

    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Check two runs") :]
    commands = re.search(r"```bash\n(.*?)```", section, re.S).group(1).strip().split("\n")
    assert [c.split()[:2] for c in commands] == [
        ["lossparity", "train"],
        ["lossparity", "train"],
        ["lossparity", "compare"],
    ]
    monkeypatch.chdir(tmp_path)
    codes = [main(c.split()[1:]) for c in commands]
    printed = capsys.readouterr().out
    assert codes == [0, 0, 0], printed
    assert "lossparity compare: PARITY" in printed
    documented = re.search(r"<!-- compare-example -->\n```\n(.*?)```", section, re.S).group(1)
    metrics = [line.split()[0] for line in documented.split("\n")[4:] if line.strip().endswith(" ok")]
    got = [
        line.split()[0]
        for line in printed.split("lossparity compare:")[1].split("\n")[4:]
        if line.strip().endswith(" ok")
    ]
    assert metrics == got  # the same metrics compared as the README shows


def test_readme_starts_with_install_commands_and_quick_start():
    lines = (ROOT / "README.md").read_text().split("\n")[:80]
    head = "\n".join(lines)
    assert "./dev.sh main" in head and "./dev.sh test" in head
    start = head.index("## Quick start")
    assert head.count("```", start) >= 2, "the quick start's code block ends within the first 80 lines"


def test_moe_worked_example_matches_megatron(monkeypatch):
    """docs/moe.md's worked example runs, and every number equals megatron-core's own functions on the same
    logits (CPU; the one-rank group reductions replaced by the identity)."""
    import types

    ns: dict = {}
    with contextlib.redirect_stdout(io.StringIO()) as out:
        exec(compile(block("docs/moe.md", "import torch"), "docs/moe.md", "exec"), ns)
    assert out.getvalue().startswith("aux ")
    mu = pytest.importorskip("megatron.core.transformer.moe.moe_utils")
    router_mod = pytest.importorskip("megatron.core.transformer.moe.router")
    monkeypatch.setattr(mu, "reduce_from_tensor_model_parallel_region", lambda x, group=None: x)
    monkeypatch.setattr(torch.distributed, "all_reduce", lambda *a, **k: None)
    monkeypatch.setattr(mu.parallel_state, "get_tensor_and_data_parallel_group", lambda *a, **k: None)
    s, b, e, k = (ns[n] for n in ("S", "B", "E", "k"))
    flat = ns["logits"].reshape(-1, e)
    m_probs, m_map = mu.topk_routing_with_score_function(
        flat, k, scaling_factor=2.5, score_function="sigmoid", expert_bias=ns["expert_bias"]
    )
    assert torch.equal(ns["routing_map"], m_map)
    torch.testing.assert_close(ns["gates"], m_probs, rtol=1e-6, atol=1e-7)
    a_map, a_scores = mu.compute_routing_scores_for_aux_loss(flat, k, "sigmoid")
    m_aux = mu.switch_load_balancing_loss_func(a_scores, a_map.sum(0), s * b, k, e, ns["aux_coeff"])
    torch.testing.assert_close(ns["aux"], m_aux, rtol=1e-6, atol=0)

    class _One:
        def size(self) -> int:
            return 1

    captured = {}
    fake = types.SimpleNamespace(
        topk=k,
        config=types.SimpleNamespace(num_moe_experts=e, moe_router_fusion=False),
        tp_cp_group=_One(),
        get_aux_loss_coeff=lambda name: ns["aux_coeff"],
        attach_and_log_load_balancing_loss=lambda act, c, loss, *a, **kw: captured.setdefault("seq", loss),
    )
    router_mod.TopKRouter._apply_seq_aux_loss(fake, torch.zeros(1), a_scores, a_map, s, b)
    torch.testing.assert_close(ns["seq_aux"], captured["seq"], rtol=1e-6, atol=0)
    torch.testing.assert_close(ns["z"], mu.z_loss_func(flat, ns["z_coeff"]), rtol=1e-6, atol=0)
    m_bias = mu.get_updated_expert_bias(m_map.sum(0).float(), ns["expert_bias"].clone(), ns["bias_rate"])
    assert torch.equal(ns["new_bias"], m_bias)
