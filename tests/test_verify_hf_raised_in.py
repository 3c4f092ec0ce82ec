"""``verify --hf``'s ERROR rows say whose code raised: from the innermost frame outwards, past torch's own
frames, the first frame when it lies in an installed package; nothing for user or lossparity frames."""

from __future__ import annotations

from lossparity.verify.hf import raised_in

_TB = """Traceback (most recent call last):
  File "/x/src/lossparity/verify/hf_run.py", line 250, in _step
    out = model(**mb)
  File "/venv/lib/python3.11/site-packages/transformers/models/doge/modeling_doge.py", line 321, in forward
    attn = attn + mask
  File "/venv/lib/python3.11/site-packages/torch/distributed/tensor/_dispatch.py", line 170, in dispatch
    raise RuntimeError("size")
RuntimeError: size
"""


def test_names_the_models_file_before_torchs():
    assert raised_in(_TB) == " (raised in transformers/models/doge/modeling_doge.py:321)"


def test_nothing_when_the_users_or_lossparitys_code_raised_or_called_torch():
    only_torch = "\n".join(line for line in _TB.splitlines() if "transformers" not in line)
    assert raised_in(only_torch) == ""  # lossparity's hf_run.py called torch
    user = _TB.replace("/venv/lib/python3.11/site-packages/transformers/models/doge", "/tmp/mine")
    assert raised_in(user) == ""
    own = 'Traceback (most recent call last):\n  File "/x/src/lossparity/verify/hf.py", line 3, in f\nValueError: x\n'
    assert raised_in(own) == "" and raised_in("no traceback") == ""
