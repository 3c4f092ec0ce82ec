"""check_pipeline_split / check_model_chunks on hand-made configs (no megatron needed): Megatron's even split
puts num_layers / (pp·vpp) layers in every model chunk."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from lossparity.integrations.megatron_pipeline import check_model_chunks, check_pipeline_split


def _config(layers, pp, vpp=None, **over):
    return SimpleNamespace(
        num_layers=layers, pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vpp, **over
    )


def test_even_splits_pass_and_uneven_ones_name_the_sizes():
    for layers, pp, vpp in [(4, 2, 2), (4, 2, None), (4, 1, None), (8, 2, 4)]:
        check_pipeline_split(_config(layers, pp, vpp))
    for layers, pp, vpp in [(4, 2, 3), (3, 2, None), (4, 4, 2), (6, 2, 2)]:
        with pytest.raises(ValueError, match=rf"config.num_layers={layers} cannot be split .* = {pp * (vpp or 1)} "):
            check_pipeline_split(_config(layers, pp, vpp))
    # Megatron's own uneven-split options: left to Megatron
    check_pipeline_split(_config(5, 2, None, num_layers_in_first_pipeline_stage=3))


def test_model_chunks_must_be_one_per_virtual_stage():
    check_model_chunks([object(), object()], _config(4, 2, 2))
    check_model_chunks([object()], _config(4, 1, None))
    with pytest.raises(ValueError, match="model: 1 model chunk"):
        check_model_chunks([object()], _config(4, 2, 2))
