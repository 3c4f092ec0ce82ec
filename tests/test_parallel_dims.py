"""ParallelDims: validation messages, and the groups of a built mesh against rank arithmetic.

Expected group memberships are computed here from the layout's rank formula
``rank = ((p·D + d)·C + c)·T + t`` (pp outermost, tp innermost), independently of the mesh code.
"""

from __future__ import annotations

import itertools

import pytest
import torch.distributed as dist

from lossparity.distributed.launch import spawn
from lossparity.distributed.parallel_dims import ParallelDims


@pytest.mark.parametrize(
    "kwargs,world,needle",
    [
        ({"dp": 2, "cp": 2}, 8, "--dp × --cp × --tp × --pp = 2×2×1×1 = 4, but the world size is 8"),
        ({"dp": 3, "ep": 2}, 3, "--ep=2 must divide --dp × --cp"),
        ({"tp": 1, "sp": True}, 1, "--sp (sequence parallelism) needs --tp > 1"),
        ({"pp_virtual": 2}, 1, "--pp-virtual=2"),
        ({"dp": 0}, None, "--dp must be an integer >= 1"),
        ({"cp": 2, "engine": "fsdp"}, 2, "--engine fsdp"),
        ({"engine": "zero3"}, 1, "unknown engine 'zero3'"),
    ],
)
def test_validate_names_the_flags(kwargs, world, needle):
    dims = ParallelDims(**kwargs)
    before = repr(dims)
    with pytest.raises(ValueError) as e:
        dims.validate(world)
    assert needle in str(e.value)
    assert repr(dims) == before  # validate never mutates


def test_single_process_has_no_groups():
    dims = ParallelDims()
    dims.validate(1)
    assert dims.build_mesh() is None
    assert dims.token_group is None and dims.grad_group is None and dims.ep_group is None
    assert (dims.dp_rank, dims.cp_rank, dims.tp_rank, dims.pp_rank, dims.ep_rank) == (0, 0, 0, 0, 0)


def _ranks(group: object | None) -> list[int] | None:
    return None if group is None else sorted(dist.get_process_group_ranks(group))


def _groups(rank: int, world: int, kwargs: dict) -> dict:
    dims = ParallelDims(**kwargs)
    dims.build_mesh("cpu")
    roles = ("token", "row", "grad", "ep", "edp", "dp", "cp", "tp", "pp")
    out = {r: _ranks(getattr(dims, f"{r}_group")) for r in roles}
    out["coord"] = (dims.pp_rank, dims.dp_rank, dims.cp_rank, dims.tp_rank, dims.ep_rank)
    out["ep_mesh"] = None if dims.ep_mesh is None else _ranks(dims.ep_mesh.get_group())  # the one EP mesh
    return out


def _expected(rank: int, P: int, D: int, C: int, T: int, E: int, sp: bool) -> dict:
    grid = {
        ((p * D + d) * C + c) * T + t: (p, d, c, t)
        for p, d, c, t in itertools.product(range(P), range(D), range(C), range(T))
    }
    p0, d0, c0, t0 = grid[rank]
    f0 = d0 * C + c0

    def members(keep) -> list[int] | None:
        ms = sorted(r for r, q in grid.items() if keep(*q))
        return ms if len(ms) > 1 else None

    return {
        "token": members(lambda p, d, c, t: p == p0 and (sp or t == t0)),
        "row": members(lambda p, d, c, t: p == p0 and d == d0 and (sp or t == t0)),
        "grad": members(lambda p, d, c, t: p == p0 and t == t0),
        "ep": members(lambda p, d, c, t: p == p0 and t == t0 and (d * C + c) // E == f0 // E) if E > 1 else None,
        "edp": members(lambda p, d, c, t: p == p0 and t == t0 and (d * C + c) % E == f0 % E),
        "dp": members(lambda p, d, c, t: (p, c, t) == (p0, c0, t0)),
        "cp": members(lambda p, d, c, t: (p, d, t) == (p0, d0, t0)),
        "tp": members(lambda p, d, c, t: (p, d, c) == (p0, d0, c0)),
        "pp": members(lambda p, d, c, t: (d, c, t) == (d0, c0, t0)),
        "coord": (p0, d0, c0, t0, f0 % E),
        "ep_mesh": members(lambda p, d, c, t: p == p0 and t == t0 and (d * C + c) // E == f0 // E) if E > 1 else None,
    }


@pytest.mark.slow
@pytest.mark.parametrize(
    "kwargs",
    [
        {"dp": 2, "cp": 2, "tp": 2, "sp": True, "ep": 2},
        {"dp": 2, "tp": 2, "pp": 2, "ep": 2},
    ],
)
def test_groups_match_rank_arithmetic(kwargs):
    P, D, C, T = (kwargs.get(k, 1) for k in ("pp", "dp", "cp", "tp"))
    out = spawn(_groups, P * D * C * T, kwargs, timeout_s=120)
    for rank, got in enumerate(out):
        want = _expected(rank, P, D, C, T, kwargs.get("ep", 1), kwargs.get("sp", False))
        assert got == want, (rank, got, want)


@pytest.mark.parametrize(
    "name, want",
    [
        ("D2xC2xT2+SPxK2+recompute", dict(dp=2, cp=2, tp=2, sp=True, ga=2, recompute=True, pp=1)),
        ("T2xC2", dict(dp=1, cp=2, tp=2, sp=False, ga=1)),
        ("P2xV2", dict(pp=2, pp_virtual=2, ga=2)),  # an omitted K is P under a pipeline
        ("D2xK2+fsdp", dict(dp=2, ga=2, engine="fsdp")),
        ("K=4", dict(dp=1, ga=4)),
    ],
)
def test_layout_grammar(name, want):
    from lossparity.verify.reference import parse_layout

    lay = parse_layout(name)
    assert {k: getattr(lay, k) for k in want} == want


@pytest.mark.parametrize(
    "name, needle",
    [
        ("D2xQ2", "cannot read 'Q2'"),
        ("D2xD2", "cannot read 'D2'"),
        ("V2xP2", "cannot read 'V2'"),
        ("D2xT2+SPxE2", "--ep=2 is not combined with --sp"),
        ("D2xE3", "--ep=3 must divide --dp × --cp"),
        ("C2xK2+fsdp", "--engine fsdp"),
        ("T1+SP", "--sp (sequence parallelism) needs --tp > 1"),
        ("D3", "not divisible by dp*ga=3*1"),
    ],
)
def test_layout_grammar_refuses_with_the_reason(name, needle):
    from lossparity.verify.reference import parse_layout

    with pytest.raises(ValueError) as e:
        parse_layout(name)
    assert name in str(e.value) and needle in str(e.value)


def _adopted(rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("tp", "dp"))  # not the pp, dp, cp, tp order
    dims = ParallelDims.from_mesh(mesh)
    roles = ("token", "row", "grad", "dp", "tp", "log")
    return {
        "sizes": (dims.dp, dims.cp, dims.tp, dims.pp),
        "coord": (dims.dp_rank, dims.tp_rank),
        **{r: _ranks(getattr(dims, f"{r}_group")) for r in roles},
    }


def test_from_mesh_adopts_a_mesh_in_any_dimension_order():
    # ParallelDims.from_mesh replaces the accountant's own group resolution (groups.py): one layout object.
    out = spawn(_adopted, 4, timeout_s=120)
    for rank, got in enumerate(out):
        t, d = divmod(rank, 2)  # rank = t·D + d for the mesh (tp=2, dp=2)
        same_t = sorted(r for r in range(4) if r // 2 == t)
        same_d = sorted(r for r in range(4) if r % 2 == d)
        want = {"sizes": (2, 1, 2, 1), "coord": (d, t), "token": same_t, "row": None, "grad": same_t}
        want |= {"dp": same_t, "tp": same_d, "log": [0, 1, 2, 3]}
        assert got == want, (rank, got, want)


def test_from_group_single_process():
    dims = ParallelDims.from_group(None)
    assert dims.built and dims.world_size == 1 and dims.token_group is None and dims.token_rank() == 0
