"""MoE accounting on top of the accountant: :class:`~.accounting.MoEAccounting` turns the routers' records
into the exact load-balancing and z-loss shares of every scope (semantics §5).

- :mod:`.accounting`: the owner (one scope, one z form, one collective per step);
- :mod:`.scopes`: one small strategy per load-balancing scope and z-loss form;
- :mod:`.grad`: the gradient plan of the shares; :mod:`.logs`: the logged values; :mod:`.checks`: argument
  and protocol checks.

The formulas themselves are pure functions in :mod:`lossparity.losses.moe` (public as :mod:`lossparity.moe`).
"""
