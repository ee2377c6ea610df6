"""Math and mechanisms with no Lightning in them.

Only ``torch`` and the standard library may be imported here (``tests/test_layering.py`` checks
it), so everything in this package can be tested without a Trainer or a process group.
"""

from lightning_scale.core.checks import divisors, format_choices, suggest_multiples
from lightning_scale.core.schedules import warmup_cosine

__all__ = ["divisors", "format_choices", "suggest_multiples", "warmup_cosine"]
