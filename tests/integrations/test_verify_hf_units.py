"""Single-process parts of ``lossparity verify --hf`` (issue 33): the tiny configuration's vocabulary sizes and
sliding window (``hf_tiny``), the float32 watch's parameters computed in float32 and the ``T`` run's reference
buffers (``hf_run``). No ranks are started; the real runs are in test_verify_hf.py."""

from __future__ import annotations

import types

import pytest
import torch
from torch import nn

pytest.importorskip("transformers")

from lossparity.verify.hf_run import BUFFERS, _Float32Watch, _reference_buffers  # noqa: E402
from lossparity.verify.hf_tiny import TINY, _vocab_sizes, tiny_config  # noqa: E402


# ------------------------------------------------------------------ hf_tiny
def _default(**fields):
    return types.SimpleNamespace(to_dict=lambda: dict(fields), **fields)


def test_other_sizes_of_the_vocabulary_follow_the_tiny_one():
    # 200058 lies in (201024 / 2, 201024]: the head's rows of the same vocabulary; 2 is a vocabulary of its own
    default = _default(vocab_size=201024, unpadded_vocab_size=200058, type_vocab_size=2, hidden_size=4608)
    assert _vocab_sizes(default) == {"unpadded_vocab_size": TINY["vocab_size"]}
    # Gemma-3n: 262144 in (262400 / 2, 262400]
    default = _default(vocab_size=262400, vocab_size_per_layer_input=262144, vocab_size_per_layer=2)
    assert _vocab_sizes(default) == {"vocab_size_per_layer_input": TINY["vocab_size"]}


@pytest.mark.parametrize("model_type", ["inkling2_text", "inkling2_loop_text"])
def test_inkling2_head_has_the_tiny_vocabulary_and_builds(model_type):
    """Its head has ``unpadded_vocab_size`` rows: left at 200058 with vocab_size 256, the model raised
    "negative dimension -199802" (a traceback in the sweep)."""
    from lossparity.verify.user_models import build_hf_model, hf_config

    config = hf_config(model_type)  # the CLI's: the tiny configuration, eager experts (float64)
    assert config.unpadded_vocab_size == config.vocab_size == 256
    model = build_hf_model(config, 0, torch.float64)
    logits = model(input_ids=torch.tensor([[3, 4, 5]])).logits
    assert tuple(logits.shape) == (1, 3, 256)


@pytest.mark.parametrize(
    "model_type, field",
    [("gemma2", "sliding_window"), ("mistral", "sliding_window"), ("inkling2_text", "sliding_window_size")],
)
def test_sliding_window_is_shorter_than_the_rows(model_type, field):
    from lossparity.verify.hf_spec import SEQ

    # rows of 4 to 16 tokens: a query at position 15 of a 4-token row needs a window over 15 - 3 = 12 to see a
    # key (with 8, gemma2's padded queries had none: NaN loss on every layout)
    window = getattr(tiny_config(model_type), field)
    assert window == 13 and SEQ - 4 < window < SEQ


# ------------------------------------------------------------------ _Float32Watch
class _Mixer(nn.Module):
    """Three float32 computations of a float64 model: a parameter cast (Jamba's ``A_log.float()``), a
    function of parameters alone reduced in float32 (DiffLlama's lambdas), an activation upcast (a norm)."""

    def __init__(self) -> None:
        super().__init__()
        self.A_log = nn.Parameter(torch.zeros(4, dtype=torch.float64))
        self.lq = nn.Parameter(torch.full((4,), 0.5, dtype=torch.float64))
        self.lk = nn.Parameter(torch.full((4,), 0.25, dtype=torch.float64))
        self.w = nn.Parameter(torch.ones(4, dtype=torch.float64))

    def forward(self, x, which):
        if which == "cast":
            return x * torch.exp(self.A_log.float()).double()
        if which == "lambda":
            return x * torch.exp(torch.sum(self.lq * self.lk, dim=-1, dtype=torch.float32)).double()
        return self.w * (x.float() / x.float().pow(2).mean(-1, keepdim=True).sqrt()).double()  # activation only


@pytest.mark.parametrize(
    "which, casts", [("cast", ["A_log"]), ("lambda", ["lk", "lq"]), ("norm", [])], ids=["cast", "lambda", "norm"]
)
def test_float32_watch_names_float64_parameters_computed_in_float32(which, casts):
    model = nn.Sequential(_Mixer())
    returns, computes, found = [], [], []
    x = torch.arange(1.0, 5.0, dtype=torch.float64)
    with _Float32Watch(model, returns, computes, found):
        model[0](x, which).sum().backward()
    assert found == [f"0.{n}" for n in casts]
    assert returns == []  # every module returns float64
    assert computes == ["0"]  # each variant computes in float32 somewhere inside the module


# ------------------------------------------------------------------ reference buffers for T
def test_T_model_gets_the_reference_builds_buffers(tmp_path):
    class WithBuffers(nn.Module):
        def __init__(self, fill: float) -> None:
            super().__init__()
            self.register_buffer("pos", torch.full((3,), fill), persistent=False)
            self.register_buffer("shard", torch.full((2,), fill))  # another shape there: kept

    torch.save({"pos": torch.tensor([1.0, 2.0, 3.0]), "shard": torch.zeros(4)}, tmp_path / BUFFERS)
    model = WithBuffers(7.0)
    _reference_buffers(model, str(tmp_path))
    assert model.pos.tolist() == [1.0, 2.0, 3.0] and model.shard.tolist() == [7.0, 7.0]
    _reference_buffers(WithBuffers(7.0), str(tmp_path / "absent"))  # no saved buffers: nothing to do


def test_a_model_transformers_cannot_save_makes_T_an_error_not_a_traceback(tmp_path, monkeypatch):
    """Saving for ``from_pretrained`` (T's build) raised outside any layout (Inkling-2 before its vocabulary
    fix: a traceback, exit 1): now the reason is kept and T's build raises it, one line, for its ERROR row."""
    from lossparity.verify import hf, user_models
    from lossparity.verify.hf_run import _build
    from lossparity.verify.hf_spec import ModelSpec, parse_hf_layouts

    class Unsaveable(nn.Module):
        def save_pretrained(self, path):
            raise RuntimeError("Trying to create tensor with negative dimension -199802: [-199802, 32]")

    monkeypatch.setattr(user_models, "build_hf_model", lambda *a: Unsaveable())
    spec = ModelSpec("llama", hf_config=user_models.hf_config("llama"))
    layouts = parse_hf_layouts("K=2,T2", spec)
    spec = hf._with_tp_dir(spec, layouts, str(tmp_path))
    assert spec.tp_dir is None and spec.tp_error is not None
    with pytest.raises(ValueError, match=r"^T: transformers cannot save the model .*negative dimension -199802"):
        _build(spec, layouts[1])


def test_longcat_zero_computation_experts_are_tiny_too():
    """LongCat-Flash routes over its routed experts plus ``zero_expert_num`` zero-computation experts (256 by
    default): the tiny configuration keeps 2 of them beside its 4 routed experts."""
    config = tiny_config("longcat_flash")
    assert config.zero_expert_num == 2 and config.n_routed_experts == 4


def test_kolibri1_1_tiny_config_passes_its_own_validation():
    """Kolibri-1.1 validates NVFP4-sized K/V heads (a multiple of 16) and at most as many indexer heads as
    query heads per K/V head: its tiny configuration was refused (exit 2 in the sweep)."""
    config = tiny_config("kolibri1_1")
    assert config.head_dim == 16 and config.index_num_heads == 2
    assert config.index_num_heads <= config.num_attention_heads // config.num_key_value_heads


def test_keep_float64_computes_the_models_float32_in_float64_with_gradients():
    """``KeepFloat64`` (the second opinion's mode): ``x.float()``, ``.to(float32)`` and ``F.linear`` with a
    float32 weight stay float64, and the float32 parameter still gets its (float32) gradient."""
    from lossparity.verify.hf_run import KeepFloat64

    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    w = nn.Parameter(torch.randn(2, 4, dtype=torch.float32))
    with KeepFloat64():
        a = x.float()
        b = x.to(torch.float32)
        y = torch.nn.functional.linear(x, w)
        s = x.sum(dtype=torch.float32)
    assert a.dtype == b.dtype == y.dtype == s.dtype == torch.float64
    # the values too: float64 all the way (a float64 tensor of float32-rounded values has the right dtype);
    # randn's float64 draws need all 53 bits, so a rounding through float32 changes them
    assert not torch.equal(x.float().double(), x)
    assert torch.equal(a, x) and torch.equal(b, x) and torch.equal(s, x.sum())
    assert torch.equal(y, torch.nn.functional.linear(x, w.double()))
    y.sum().backward()
    assert w.grad is not None and w.grad.dtype == torch.float32
    expected = x.detach().sum(0).float().expand(2, 4)  # d(sum(x @ w.T))/dw = column sums of x, per output row
    assert torch.allclose(w.grad, expected)
