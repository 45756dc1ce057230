"""Routes: named ways to serve a request, each with its drafter, guardrails, mode and canary.

A route is chosen per request by the `X-Specdec-Route` header, or else by the request's `model`
(a route name or one of its aliases; the served model name means the default route). Every
answer names the route that served it in the same header. Routes come from a YAML file
(`specdec-fast serve --routes FILE`):

    routes:
      code:   {drafter: "ngram:8", aliases: [tiny-code-code]}
      chat:   {drafter: "draft:tiny-code-draft:4", mode: shadow}
      beta:   {drafter: suffix, canary: 0.05, max_tokens: 256}

- `drafter`: a drafter SPEC (`specdec_fast.drafters.registry`; "none" for plain decoding);
- `mode: speculate` (default): the route's requests speculate, `canary` (default 1.0) of them,
  drawn at random (seeded), the others decode plainly on the route;
- `max_tokens`: the most tokens a completion on the route may ask for (a 400 past it; the
  server's `--max-tokens-limit` when absent, the smaller of the two when both are set);
- `mode: shadow`: every request is served plainly; a copy speculates beside it (when the queue
  has room), its output is compared with the one served and counted, never returned. A greedy
  copy that differs is reported to the route's guard as a quality regression.

Each route with a drafter has the guardrail policy of its name (`Guardrails`, per-route
overrides included): a breach switches the route to plain decoding, which re-probes after the
cool-down (the scheduler applies it, see `specdec_fast.serving.scheduler`).
"""

from __future__ import annotations

import difflib
import random
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

from specdec_fast.drafters.registry import DrafterSpec
from specdec_fast.guardrails import DEFAULT_ROUTE
from specdec_fast.serving.errors import RequestError
from specdec_fast.serving.scheduler import (
    CANCEL_REASONS,
    FAILED,
    Completion,
    Handle,
    QueueFull,
    Request,
    Scheduler,
)

ROUTE_HEADER = "X-Specdec-Route"
PLAIN_ROUTE = "plain"
MODES = ("speculate", "shadow")
_FIELDS = ("drafter", "mode", "canary", "aliases", "max_tokens")


@dataclass(frozen=True)
class RouteConfig:
    """One route: `drafter` SPEC, `mode` ("speculate" or "shadow"), `canary` share in [0, 1] of
    its requests that speculate (speculate mode), `aliases` (model names that select it),
    `max_tokens` (the most tokens a completion on it may ask for; None: the server's limit)."""

    name: str
    drafter: str = "none"
    mode: str = "speculate"
    canary: float = 1.0
    aliases: tuple[str, ...] = ()
    max_tokens: int | None = None

    def __post_init__(self) -> None:
        where = f"routes.{self.name}"
        DrafterSpec.parse(self.drafter)
        if self.mode not in MODES:
            raise ValueError(f"{where}.mode: expected one of {', '.join(MODES)}, got {self.mode!r}")
        canary = self.canary
        if isinstance(canary, bool) or not isinstance(canary, (int, float)) or not 0 <= canary <= 1:
            raise ValueError(f"{where}.canary: expected a number in [0, 1], got {canary!r}")
        if not all(isinstance(alias, str) and alias for alias in self.aliases):
            raise ValueError(f"{where}.aliases: expected a list of names, got {self.aliases!r}")
        cap = self.max_tokens
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap < 1):
            raise ValueError(f"{where}.max_tokens: expected an integer >= 1, got {cap!r}")

    @property
    def spec(self) -> DrafterSpec:
        return DrafterSpec.parse(self.drafter)

    @classmethod
    def from_mapping(cls, name: str, values: Mapping | None) -> RouteConfig:
        values = values or {}
        if not isinstance(values, Mapping):
            raise ValueError(f"routes.{name}: expected a mapping of {', '.join(_FIELDS)}")
        for key in values:
            if key not in _FIELDS:
                close = difflib.get_close_matches(str(key), _FIELDS, n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                raise ValueError(f"routes.{name}.{key}: unknown field{hint}")
        aliases = values.get("aliases", ())
        aliases = (aliases,) if isinstance(aliases, str) else tuple(aliases)
        return cls(
            name,
            str(values.get("drafter", "none")),
            values.get("mode", "speculate"),
            values.get("canary", 1.0),
            aliases,
            values.get("max_tokens"),
        )


def load_routes(source: str | Path) -> list[RouteConfig]:
    """The routes of a YAML file (or YAML text holding a newline) with a top-level `routes`."""
    import yaml

    text = str(source)
    if isinstance(source, Path) or "\n" not in text:
        text = Path(source).read_text()
    document = yaml.safe_load(text)
    if not isinstance(document, Mapping) or not isinstance(document.get("routes"), Mapping):
        raise ValueError("routes file: expected a top-level `routes` mapping of route names")
    return [RouteConfig.from_mapping(str(name), v) for name, v in document["routes"].items()]


def server_routes(
    drafter: str, extra: list[RouteConfig], *, mode: str = "speculate", canary: float = 1.0
) -> list[RouteConfig]:
    """The routes of a server: `default` (the `--drafter`, in `mode` with `canary`), `plain`
    (always plain decoding, the baseline of `bench --url`) and `extra` (from a routes file)."""
    routes = {
        DEFAULT_ROUTE: RouteConfig(DEFAULT_ROUTE, drafter, mode, canary),
        PLAIN_ROUTE: RouteConfig(PLAIN_ROUTE),
    }
    for route in extra:
        if route.name in (DEFAULT_ROUTE, PLAIN_ROUTE):
            raise ValueError(f"routes.{route.name}: the name is reserved for a built-in route")
        routes[route.name] = route
    return list(routes.values())


@dataclass
class ShadowCounters:
    """Shadow copies of a route: `requests` compared, `mismatches` among them (outputs that
    differ from the one served), `skipped` (no room in the queue for the copy)."""

    requests: int = 0
    mismatches: int = 0
    skipped: int = 0


@dataclass
class _Pair:
    """A served request and its shadow copy, compared when both have ended."""

    greedy: bool
    completions: dict[str, Completion] = field(default_factory=dict)
    shadow: Handle | None = None


class RouteTable:
    """The names requests give: the served model name (the default route), every route's name
    and aliases; what each selects. It needs no scheduler: a server whose scheduler runs in
    another process resolves requests with it.

    Args:
        routes: the route configurations.
        served_model: the model name that selects the default route.
    """

    def __init__(self, routes: list[RouteConfig], served_model: str):
        self.routes = {route.name: route for route in routes}
        self.served_model = served_model
        self._models: dict[str, str] = {served_model: DEFAULT_ROUTE}
        for route in routes:
            for name in (route.name, *route.aliases):
                if self._models.setdefault(name, route.name) != route.name:
                    raise ValueError(f"routes.{route.name}: the model name {name!r} is taken")

    @property
    def model_names(self) -> list[str]:
        """Every name a request's `model` may give (served model, routes, aliases)."""
        return list(self._models)

    def describe(self, model: str) -> dict:
        """What `model` (a name of `model_names`) selects: route, drafter SPEC, N, mode, canary."""
        route = self.routes[self._models[model]]
        return {
            "route": route.name,
            "drafter": route.drafter,
            "nodes": route.spec.nodes(),
            "mode": route.mode,
            "canary": route.canary,
            "max_tokens": route.max_tokens,
        }

    def resolve(self, model: str | None, header: str | None) -> str:
        """The route of a request: the header's, else the model's; `RequestError` naming the
        field for an unknown one."""
        if model is not None and model not in self._models:
            raise RequestError(
                f"The model `{model}` does not exist; models: {', '.join(self._models)}",
                "model",
                "model_not_found",
            )
        if header is not None:
            if header not in self.routes:
                known = ", ".join(self.routes)
                raise RequestError(
                    f"unknown route {header!r}; routes: {known}", ROUTE_HEADER, "route_not_found"
                )
            return header
        return DEFAULT_ROUTE if model is None else self._models[model]


class Router(RouteTable):
    """Routes requests to the scheduler: picks the route, draws the canary, makes shadow copies.

    Args:
        scheduler: serves every route (its routes are these routes' names).
        routes: the route configurations.
        served_model: the model name that selects the default route.
        observe: called with (route, completion) when a served request ends (the metrics).
        seed: of the canary draws (and of the seeds shadowed sampled requests share); each
            route draws from its own generator, seeded by `seed` and its name.
    """

    def __init__(
        self,
        scheduler: Scheduler,
        routes: list[RouteConfig],
        served_model: str,
        observe: Callable[[str, Completion], None] | None = None,
        seed: int = 0,
    ):
        super().__init__(routes, served_model)
        self.scheduler = scheduler
        self.observe = observe
        self.shadow = {route.name: ShadowCounters() for route in routes}
        # Requests of each speculate-mode route that were drawn to speculate.
        self.canary_speculating = dict.fromkeys(self.routes, 0)
        # One generator per route: a route's draws do not depend on other routes' traffic.
        self._random = {route.name: random.Random(f"{seed}:{route.name}") for route in routes}
        self._lock = threading.Lock()

    def submit(self, route: str, request: Request) -> Handle:
        """Submit `request` on `route` (its `speculate` set by the route's mode and canary).
        Raises what `Scheduler.submit` raises for the served request."""
        config = self.routes[route]
        request = replace(request, route=route)
        if config.spec.info is None:
            return self.scheduler.submit(self._observed(request, route))
        if config.mode == "speculate":
            with self._lock:
                draw = self._random[route].random()
                speculate = config.canary >= 1.0 or draw < config.canary
                self.canary_speculating[route] += int(speculate)
            return self.scheduler.submit(
                self._observed(replace(request, speculate=speculate), route)
            )
        if request.seed is None:
            # The copy must draw what the served request draws.
            with self._lock:
                request = replace(request, seed=self._random[route].getrandbits(62))
        served_finish = request.on_finish
        pair = _Pair(greedy=request.temperature == 0.0)

        def finished(side: str, completion: Completion) -> None:
            with self._lock:
                pair.completions[side] = completion
                both = len(pair.completions) == 2
            ended = side == "served" and completion.finish_reason in (*CANCEL_REASONS, FAILED)
            if ended and pair.shadow is not None:
                pair.shadow.cancel()
            if both:
                self._compare(route, pair)

        def served(completion: Completion) -> None:
            finished("served", completion)
            if served_finish is not None:
                served_finish(completion)

        primary = replace(request, speculate=False, on_finish=served)
        handle = self.scheduler.submit(self._observed(primary, route))
        copy = replace(
            request,
            speculate=True,
            on_tokens=None,
            on_finish=lambda completion: finished("shadow", completion),
        )
        try:
            pair.shadow = self.scheduler.submit(copy)
        except QueueFull:
            self.shadow[route].skipped += 1
        return handle

    def _observed(self, request: Request, route: str) -> Request:
        """`request` whose end is reported to `observe`, then to its own `on_finish`."""
        callback, observe = request.on_finish, self.observe

        def on_finish(completion: Completion) -> None:
            if observe is not None:
                observe(route, completion)
            if callback is not None:
                callback(completion)

        return replace(request, on_finish=on_finish)

    def _compare(self, route: str, pair: _Pair) -> None:
        served, shadow = pair.completions["served"], pair.completions["shadow"]
        if {served.finish_reason, shadow.finish_reason} & {*CANCEL_REASONS, FAILED}:
            return
        counters = self.shadow[route]
        counters.requests += 1
        if served.tokens != shadow.tokens:
            counters.mismatches += 1
            if pair.greedy and self.scheduler.lanes[route].guard is not None:
                self.scheduler.record_quality_regression(route)
