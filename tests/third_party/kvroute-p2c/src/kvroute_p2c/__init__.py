"""Power of two choices: sample two candidates, keep the one with fewer requests in flight."""

import random

import attrs

import kvroute
from kvroute.options import optional_int_option


@attrs.define
class PowerOfTwo(kvroute.BaseStrategy):
    seed: int | None = optional_int_option()
    _rng: random.Random = attrs.field(init=False)

    def __attrs_post_init__(self):
        self._rng = random.Random(self.seed)

    def pick(self, request, candidates):
        if len(candidates) == 1:
            return kvroute.Decision(candidates[0].backend, reason="only_candidate")
        a, b = self._rng.sample(list(candidates), 2)
        best = a if a.in_flight / a.weight <= b.in_flight / b.weight else b
        return kvroute.Decision(best.backend, reason="p2c", detail={"versus": (b if best is a else a).id})


@kvroute.hookimpl
def kvroute_register_strategies(register):
    register("p2c", PowerOfTwo)


@kvroute.hookimpl
def kvroute_register_commands(cli):
    import click

    @cli.command("p2c-info")
    def p2c_info():
        """Say what the p2c strategy does (a command added by a third-party plugin)."""
        click.echo("p2c: sample two backends, route to the one with fewer requests in flight per unit of weight")
