"""What a run costs and how healthy it is, as plain numbers: FLOPs per token and utilisation
(:mod:`.flops`), a model's parameter counts and FLOPs read off it (:mod:`.model_facts`), peak FLOP/s
by chip (:mod:`.peaks`), prices and energy (:mod:`.cost`) and numerical health (:mod:`.health`).

May import: torch, the standard library, :mod:`lightning_scale.core.compat`,
:mod:`lightning_scale.core.checks` and :mod:`lightning_scale.core.parallel`.
"""
