"""Non-chat routes: ``GET /v1/models`` and the ``/_sim`` control endpoints.

``GET /_sim/stats`` (counters, window maxima and, under ``"bound"``, what was
admitted against each limit: the window maximum, or a bucket's ``max_burst`` and
total charge), ``GET /_sim/log`` (``?item=``,
``?limit=``), ``POST /_sim/reset``, ``GET``/``POST /_sim/config`` (run-time changes),
``GET``/``POST /_sim/deployments`` (simulated deployments: ``{"name": {limits and
fault mode}}``, set afresh, their fault mode's time counted from then).
"""

from __future__ import annotations

import time

from aiohttp import web

from batchgen.simulator.batch_jobs import JOBS
from batchgen.simulator.state import STATE


async def _models(request: web.Request) -> web.Response:
    state = request.app[STATE]
    names = list(state.models)
    if "anthropic-version" in request.headers:
        data = [
            {"type": "model", "id": m, "display_name": m, "created_at": "2024-01-01T00:00:00Z"}
            for m in names
        ]
        return web.json_response(
            {
                "data": data,
                "has_more": False,
                "first_id": names[0] if names else None,
                "last_id": names[-1] if names else None,
            }
        )
    now = int(time.time())
    return web.json_response(
        {
            "object": "list",
            "data": [
                {"id": m, "object": "model", "created": now, "owned_by": "simulator"} for m in names
            ],
        }
    )


async def _sim_stats(request: web.Request) -> web.Response:
    return web.json_response(request.app[STATE].stats())


async def _sim_log(request: web.Request) -> web.Response:
    entries = request.app[STATE].entries(request.query.get("item"))
    if "limit" in request.query:
        entries = entries[-int(request.query["limit"]) :]
    return web.json_response(entries)


async def _sim_last_request(request: web.Request) -> web.Response:
    """The last request body the simulator got on ``?api=openai|anthropic`` (a chat
    call) or ``?api=anthropic_batch`` (a Message Batch's creation)."""
    body = request.app[STATE].last_request.get(request.query.get("api", "openai"))
    return web.json_response(body)


async def _sim_reset(request: web.Request) -> web.Response:
    request.app[STATE].reset()
    request.app[JOBS].reset()
    return web.json_response({"ok": True})


async def _sim_config(request: web.Request) -> web.Response:
    state = request.app[STATE]
    if request.method == "POST":
        try:
            changes = await request.json()
            if not isinstance(changes, dict):
                raise ValueError("body must be a JSON object")
            state.apply_config(changes)
        except (ValueError, TypeError) as exc:
            return web.json_response({"error": str(exc)}, status=400)
    return web.json_response(state.config.as_dict())


async def _sim_deployments(request: web.Request) -> web.Response:
    state = request.app[STATE]
    if request.method == "POST":
        try:
            lanes = await request.json()
            if not isinstance(lanes, dict):
                raise ValueError("body must be a JSON object of deployments by name")
            state.set_lanes(lanes)
        except (ValueError, TypeError) as exc:
            return web.json_response({"error": str(exc)}, status=400)
    return web.json_response({name: c.as_dict() for name, c in state.lane_configs.items()})


async def _native_models(request: web.Request) -> web.Response:
    """Gemini's and Vertex AI's models listings (a key or a bearer token required), and
    Bedrock's ``ListFoundationModels`` (signed)."""
    headers = request.headers
    if not (headers.get("x-goog-api-key") or headers.get("authorization")):
        body = {"error": {"code": 401, "message": "no credentials", "status": "UNAUTHENTICATED"}}
        return web.json_response(body, status=401)
    names = sorted(request.app[STATE].models)
    if request.path.endswith("/foundation-models"):
        summaries = [{"modelId": name, "modelArn": f"arn:aws:bedrock:::{name}"} for name in names]
        return web.json_response({"modelSummaries": summaries})
    return web.json_response({"models": [{"name": f"models/{name}"} for name in names]})


def add_admin_routes(app: web.Application) -> None:
    """Register ``/v1/models`` and ``/_sim/*`` on ``app``."""
    app.router.add_get("/v1/models", _models)
    app.router.add_get("/{version}/models", _native_models)
    vertex = "/{version}/projects/{project}/locations/{location}/publishers/google/models"
    app.router.add_get(vertex, _native_models)
    app.router.add_get("/foundation-models", _native_models)
    app.router.add_get("/_sim/stats", _sim_stats)
    app.router.add_get("/_sim/log", _sim_log)
    app.router.add_post("/_sim/reset", _sim_reset)
    app.router.add_get("/_sim/last_request", _sim_last_request)
    app.router.add_get("/_sim/config", _sim_config)
    app.router.add_post("/_sim/config", _sim_config)
    app.router.add_get("/_sim/deployments", _sim_deployments)
    app.router.add_post("/_sim/deployments", _sim_deployments)
