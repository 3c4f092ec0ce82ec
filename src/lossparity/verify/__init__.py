"""``lossparity verify``: prove that a model's objective, logs, gradients and updated parameters do not
depend on the parallel layout.

- :mod:`.layouts`: the layout grammar (``D2xC2xT2+SPxK2``) and the default, quick and full sets;
- :mod:`.reference`: the reference MoE+MTP model trained under each layout against one process;
- :mod:`.hf`, :mod:`.hf_compare`, :mod:`.user_models`: the same proof for a Hugging Face model
  (``--hf``) or any torch model (``--model``), and its table.

Imports flow down: this package uses the trainer (:mod:`lossparity.training`) and the integrations; nothing
below imports it.
"""
