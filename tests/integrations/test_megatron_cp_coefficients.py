"""The context-parallel pieces of MoETerms on hand-worked rows (no megatron needed): Megatron's zig-zag
shard positions and the whole-row coefficients ``c`` with ``numerator = Σ_t c_t·s_t``."""

from __future__ import annotations

import torch

from lossparity.integrations._common import mode_coefficients
from lossparity.integrations.megatron_moe import zigzag_positions


def test_zigzag_positions_are_get_batch_on_this_cp_rank_chunks():
    # S = 8, cp = 2: four chunks of 2; rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2
    assert zigzag_positions(0, 2, 8).tolist() == [0, 1, 6, 7]
    assert zigzag_positions(1, 2, 8).tolist() == [2, 3, 4, 5]
    assert zigzag_positions(0, 1, 4).tolist() == [0, 1, 2, 3]


def test_whole_row_coefficients_per_sample_and_per_document():
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0, 1.0, 1.0], [0.0, 0.0, 0.0, 0.0, 0.0, 0.0]])
    seg = torch.tensor([[1, 1, 2, 2, 1, 1], [1, 1, 1, 2, 2, 2]])
    # per_sample: row 0 has n = 5 tokens, row 1 none (its units count, its tokens weigh nothing)
    want = torch.tensor([[0.2, 0.2, 0.2, 0.0, 0.2, 0.2], [0.0] * 6], dtype=torch.float64)
    assert torch.allclose(mode_coefficients("per_sample", mask, None, None), want, rtol=0, atol=1e-15)
    # per_document: row 0 has three runs (ids 1, 2, 1: the second run of id 1 is another document)
    # with 2, 1 and 2 loss tokens
    want = torch.tensor([[0.5, 0.5, 1.0, 0.0, 0.5, 0.5], [0.0] * 6], dtype=torch.float64)
    assert torch.allclose(mode_coefficients("per_document", mask, seg, None), want, rtol=0, atol=1e-15)
    # per_token: the mask itself
    assert torch.equal(mode_coefficients("per_token", mask, None, None), mask.double())
