"""The Flask extension: mount the batch API in a host app and hand it the Python API.

    from flask import Flask
    from batchgen.integrations.flask import BatchGen

    app = Flask(__name__)
    app.config["BATCHGEN_URL_PREFIX"] = "/llm"   # default "/batchgen"
    batchgen = BatchGen(app)                      # or BatchGen().init_app(app)

    @app.post("/shops/<shop>/describe")
    def describe(shop):
        batch = batchgen.submit_batch(rows, tenant=shop)   # or current_app.extensions["batchgen"]

    @batch_finished.connect_via(app)
    def on_batch_finished(sender, batch_id, status, request_counts, **extra): ...

    # the receivers run in the process of:  flask --app shop batchgen signals --follow

Batches submitted inside the app (the Python API in an app context, or HTTP through
the mount) are the app's (``origin``: ``BATCHGEN_APP_ID``, default ``app.name``);
``batch_finished`` fires only for them, once each, and only in the process running
``flask --app <app> batchgen signals [--follow] [--poll-s S]``.

Configuration is per app: ``BATCHGEN_*`` keys of ``app.config`` over the environment
make the app's own settings, engine and Redis client (``os.environ`` is left alone),
in force while an app context of that app is pushed (its requests, a CLI command, a
job that pushes ``app.app_context()``) and inside the extension's Python API calls.
Two apps in one process may so use two databases. :meth:`BatchGen.close` (also run
at exit) disposes of the app's connections.

The API's routes answer under the prefix exactly as the standalone API does
(``POST <prefix>/v1/batches`` …), every error below the prefix included (404,
405, 500, 503 as JSON; the host's pages elsewhere are left alone); a
:class:`~batchgen.errors.BatchgenError` raised in any view of the host app becomes
the same JSON error answer. Access logs of the host's server lose their query
strings (they may carry a batch's ``metadata``).
"""

from __future__ import annotations

import atexit
import functools
import logging
from collections.abc import Callable, Iterator
from typing import Any, ParamSpec, TypeVar

import click
from blinker import Namespace
from flask import Flask, appcontext_pushed, current_app, g, has_app_context
from flask.cli import AppGroup

from batchgen import python_api
from batchgen.config import SettingsScope, activate_scope, deactivate_scope
from batchgen.integrations import (
    APP_ID_KEY,
    DEFAULT_SIGNAL_POLL_S,
    SIGNAL_POLL_KEY,
    run_signals,
    settings_from_config,
)
from batchgen.worker import money_alerts

log = logging.getLogger(__name__)
P = ParamSpec("P")
R = TypeVar("R")
SCOPE_KEY = "batchgen.scope"
_TOKENS = "_batchgen_scope_tokens"

DEFAULT_URL_PREFIX = "/batchgen"
EXTENSION_KEY = "batchgen"

_signals = Namespace()
#: Sent (sender: the app) when one of the app's batches ended, with keyword arguments
#: ``batch_id``, ``status``, ``request_counts``, ``finished_at`` (and ``type``), once per
#: batch, in the process running ``flask batchgen signals`` (or
#: :meth:`BatchGen.deliver_signals`). A receiver that raises is logged; the others
#: still get it, and it is not sent again.
batch_finished = _signals.signal("batchgen.batch-finished")
#: Sent (sender: None) when a dollar budget's period reached one of its soft thresholds,
#: once per threshold and period, with the event's fields as keyword arguments
#: (``tenant``, ``budget_id``, ``key_id``, ``period``, ``period_key``,
#: ``threshold_pct``, ``used_usd``, ``limit_usd``, ``resets_at``, ``type``), in the
#: process that saw it: this app's (a call it serves) or its worker's (a dispatch).
budget_alert = _signals.signal("batchgen.budget-alert")


def _send_budget_alert(alert: money_alerts.Alert) -> None:
    if budget_alert.receivers:
        budget_alert.send(None, **money_alerts.event(alert, money_alerts.tenant_name(alert)))


money_alerts.on_alert(_send_budget_alert)


def app_id(app: Flask) -> str:
    """The app's id, its batches' ``origin``: ``BATCHGEN_APP_ID``, else ``app.name``."""
    return str(app.config.get(APP_ID_KEY) or app.name)


def _origin() -> str | None:
    """The app id of the Flask app whose context this is, if it has the extension."""
    if not has_app_context():
        return None
    app = current_app._get_current_object()  # type: ignore[attr-defined]
    return app_id(app) if EXTENSION_KEY in app.extensions else None


cli = AppGroup("batchgen", help="batchgen commands of this app.")


@cli.command("signals")
@click.option("--follow", is_flag=True, help="Keep delivering as batches end.")
@click.option("--poll-s", type=float, default=None, help="Seconds between polls (1).")
def signals_command(follow: bool, poll_s: float | None) -> None:
    """Send batch_finished for this app's batches that ended (receivers run here)."""
    app = current_app._get_current_object()  # type: ignore[attr-defined]
    ext: BatchGen = app.extensions[EXTENSION_KEY]
    every_s = poll_s or float(app.config.get(SIGNAL_POLL_KEY) or DEFAULT_SIGNAL_POLL_S)
    sent = run_signals(lambda: ext.deliver_signals(app), follow=follow, poll_s=every_s)
    click.echo(f"{sent} batch_finished signals sent")


def app_scope(app: Flask) -> SettingsScope:
    """The settings scope of an app that has the extension (its settings and clients)."""
    scope = app.extensions.get(SCOPE_KEY)
    if not isinstance(scope, SettingsScope):
        raise RuntimeError(f"batchgen's extension is not initialised on app {app.name!r}")
    return scope


def _enter(sender: Flask, **_: Any) -> None:
    # Sent by the app context's push (sender: its app), inside the pushed context.
    tokens = g.setdefault(_TOKENS, [])
    tokens.append(activate_scope(app_scope(sender)))


def _leave(exc: BaseException | None = None) -> None:
    tokens = g.get(_TOKENS) or []
    if tokens:
        deactivate_scope(tokens.pop())


def _scoped(method: Callable[P, R]) -> Callable[..., R]:
    @functools.wraps(method)
    def call(self: BatchGen, *args: P.args, **kwargs: P.kwargs) -> R:
        with self.scope().active():
            return method(*args, **kwargs)

    return call


def _scoped_iter(method: Callable[P, Iterator[R]]) -> Callable[..., Iterator[R]]:
    @functools.wraps(method)
    def call(self: BatchGen, *args: P.args, **kwargs: P.kwargs) -> Iterator[R]:
        scope = self.scope()
        with scope.active():
            iterator = iter(method(*args, **kwargs))
        # Each step runs in the app's scope, whoever iterates and wherever.
        while True:
            with scope.active():
                try:
                    item = next(iterator)
                except StopIteration:
                    return
            yield item

    return call


class BatchGen:
    """Flask extension: ``BatchGen(app)`` or ``BatchGen().init_app(app)``."""

    def __init__(self, app: Flask | None = None) -> None:
        self.app = app
        self._scopes: list[SettingsScope] = []
        if app is not None:
            self.init_app(app)

    def init_app(self, app: Flask) -> None:
        """Build the app's settings from its ``BATCHGEN_*`` config, mount the API,
        register the extension."""
        from batchgen.admin_api import admin_blueprint
        from batchgen.api import blueprint, install_error_handlers
        from batchgen.dashboard import dashboard
        from batchgen.logs import redact_access_logs

        scope = SettingsScope(settings_from_config(app.config))
        app.extensions[SCOPE_KEY] = scope
        self._scopes.append(scope)
        if not self._scopes[1:]:
            atexit.register(self.close)
        appcontext_pushed.connect(_enter, app, weak=False)
        app.teardown_appcontext(_leave)
        prefix = app.config.setdefault("BATCHGEN_URL_PREFIX", DEFAULT_URL_PREFIX)
        mount = (prefix or "").rstrip("/")
        app.register_blueprint(blueprint, url_prefix=mount or None)
        app.register_blueprint(dashboard, url_prefix=mount or None)
        app.register_blueprint(admin_blueprint, url_prefix=mount or None)
        install_error_handlers(app, mount)
        redact_access_logs()
        app.extensions[EXTENSION_KEY] = self
        app.config.setdefault(APP_ID_KEY, app.name)
        python_api.register_origin(_origin)
        app.cli.add_command(cli)

    def scope(self, app: Flask | None = None) -> SettingsScope:
        """The settings scope of ``app`` (default: the current app if it has this
        extension, else the app given to the constructor)."""
        if app is None and has_app_context() and current_app.extensions.get(EXTENSION_KEY) is self:
            app = current_app._get_current_object()  # type: ignore[attr-defined]
        app = app or self.app
        if app is None:
            if len(self._scopes) == 1:
                return self._scopes[0]
            raise RuntimeError("BatchGen serves several apps: call it inside an app context")
        return app_scope(app)

    def close(self) -> None:
        """Dispose of the connections the apps' settings opened (engines, Redis pools);
        they are opened again on next use. Run at exit too."""
        for scope in self._scopes:
            scope.close()

    @staticmethod
    def _firing(app: Flask) -> Any:
        def fire(payload: dict[str, Any]) -> None:
            for receiver in batch_finished.receivers_for(app):
                try:
                    receiver(app, **payload)
                except Exception as exc:  # the others still get it; never sent again
                    log.error(
                        "batch_finished receiver %s failed for batch %s: %s",
                        getattr(receiver, "__qualname__", receiver),
                        payload.get("batch_id"),
                        type(exc).__name__,
                    )

        return fire

    def deliver_signals(self, app: Flask, limit: int = 100) -> int:
        """Send :data:`batch_finished` for the app's batches that ended since, once each
        (what ``flask batchgen signals`` runs); returns how many batches."""
        with self.scope(app).active():
            return python_api.deliver_signals(self._firing(app), limit, origin=app_id(app))

    # The Python API (batchgen.python_api), for the host app's own views and jobs, run
    # with the app's settings (also outside a request).
    submit_batch = _scoped(python_api.submit_batch)
    get_batch = _scoped(python_api.get_batch)
    list_batches = _scoped(python_api.list_batches)
    iter_results = _scoped_iter(python_api.iter_results)
    cancel_batch = _scoped(python_api.cancel_batch)
    # The OpenAI Files flow and Anthropic's Message Batches, as the SDK routes serve them.
    upload_file = _scoped(python_api.upload_file)
    create_batch = _scoped(python_api.create_batch)
    get_file = _scoped(python_api.get_file)
    iter_file_content = _scoped_iter(python_api.iter_file_content)
    create_message_batch = _scoped(python_api.create_message_batch)
    get_message_batch = _scoped(python_api.get_message_batch)
    iter_message_batch_results = _scoped_iter(python_api.iter_message_batch_results)
    usage = _scoped(python_api.usage)
