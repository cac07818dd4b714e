"""A kvroute strategy distribution: the module the ``kvroute`` entry point names.

kvroute imports this module when it loads plugins and calls the hook below, which
registers the strategy under the name users write in ``--strategy``.
"""

from __future__ import annotations

from collections.abc import Callable

import kvroute
from kvroute_strategy_template.strategy import Rendezvous, score

__all__ = ["Rendezvous", "kvroute_register_strategies", "score"]


@kvroute.hookimpl
def kvroute_register_strategies(register: Callable[..., None]) -> None:
    register("template-rendezvous", Rendezvous)
