"""Megatron-core pipeline checks that give one clear error on every rank before the first step.

Megatron splits ``num_layers`` evenly: ``num_layers / pp`` per pipeline stage, then ``/ vpp`` per model chunk
(virtual stage) of the interleaved schedule. A count that does not divide stops the build at an
``assert`` deep inside ``TransformerBlock`` (or, where ``assert`` is compiled out, builds chunks of the wrong
size). :func:`check_pipeline_split` looks only at the config, so every rank raises the same ``ValueError``
before any model chunk or collective exists; :func:`check_model_chunks` checks that a rank passes all of its
chunks (one per virtual stage) to code that numbers the layers of the whole model.
"""

from __future__ import annotations

from typing import Any

__all__ = ["check_model_chunks", "check_pipeline_split"]

# Megatron's options for an uneven split: with any of them set, Megatron's own checks apply.
_UNEVEN = (
    "num_layers_in_first_pipeline_stage",
    "num_layers_in_last_pipeline_stage",
    "pipeline_model_parallel_layout",
    "account_for_embedding_in_pipeline_split",
    "account_for_loss_in_pipeline_split",
)


def check_pipeline_split(config: Any) -> None:
    """Raise ``ValueError`` unless ``config.num_layers`` splits evenly into ``pp·vpp`` model chunks.

    ``pp = config.pipeline_model_parallel_size``, ``vpp = config.virtual_pipeline_model_parallel_size`` (1 when
    unset): Megatron's even split needs ``num_layers % pp == 0`` and ``(num_layers / pp) % vpp == 0``, i.e.
    ``num_layers % (pp·vpp) == 0``, each chunk holding ``num_layers / (pp·vpp) >= 1`` layers. A config that
    uses one of Megatron's uneven-split options (``num_layers_in_first/last_pipeline_stage``,
    ``pipeline_model_parallel_layout``, ``account_for_embedding/loss_in_pipeline_split``) is left to Megatron.
    Depends on the config only, so every rank raises the same error."""
    if any(getattr(config, name, None) for name in _UNEVEN):
        return
    pp = int(getattr(config, "pipeline_model_parallel_size", 1) or 1)
    vpp = int(getattr(config, "virtual_pipeline_model_parallel_size", None) or 1)
    layers = int(config.num_layers)
    if layers % (pp * vpp) or layers < pp * vpp:
        raise ValueError(
            f"config.num_layers={layers} cannot be split into pipeline_model_parallel_size={pp} × "
            f"virtual_pipeline_model_parallel_size={vpp} = {pp * vpp} model chunks of equal size (Megatron's even "
            f"split needs num_layers to be a positive multiple of {pp * vpp}); change num_layers or the pipeline "
            "sizes, or set num_layers_in_first_pipeline_stage / num_layers_in_last_pipeline_stage"
        )


def check_model_chunks(chunks: list[Any], config: Any) -> None:
    """Raise ``ValueError`` unless ``chunks`` holds one model chunk per virtual stage (``vpp``, 1 when unset),
    after :func:`check_pipeline_split`."""
    check_pipeline_split(config)
    vpp = int(getattr(config, "virtual_pipeline_model_parallel_size", None) or 1)
    pp = int(getattr(config, "pipeline_model_parallel_size", 1) or 1)
    if pp > 1 and len(chunks) != vpp:
        raise ValueError(
            f"model: {len(chunks)} model chunk(s) given for virtual_pipeline_model_parallel_size={vpp}; pass the "
            "list of all of this rank's chunks (one per virtual stage), as Megatron's schedules take them"
        )
