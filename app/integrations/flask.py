"""The Flask extension: mount the batch API in a host app and hand it the Python API.

    from flask import Flask
    from batchgen.integrations.flask import BatchGen

    app = Flask(__name__)
    app.config["BATCHGEN_URL_PREFIX"] = "/llm"   # default "/batchgen"
    batchgen = BatchGen(app)                      # or BatchGen().init_app(app)

    @app.post("/shops/<shop>/describe")
    def describe(shop):
        batch = batchgen.submit_batch(rows, tenant=shop)   # or current_app.extensions["batchgen"]

    @batch_finished.connect_via(app)          # app.config["BATCHGEN_SIGNAL_POLL_S"] = 2
    def on_batch_finished(sender, batch_id, status, request_counts, **extra): ...

The API's routes answer under the prefix exactly as the standalone API does
(``POST <prefix>/v1/batches`` …), every error below the prefix included (404,
405, 500, 503 as JSON; the host's pages elsewhere are left alone); a
:class:`~batchgen.errors.BatchgenError` raised in any view of the host app becomes
the same JSON error answer. Access logs of the host's server lose their query
strings (they may carry a batch's ``metadata``).
"""

from __future__ import annotations

from typing import Any

from blinker import Namespace
from flask import Flask

from batchgen import python_api
from batchgen.integrations import SIGNAL_POLL_KEY, apply_settings, start_signal_poller

DEFAULT_URL_PREFIX = "/batchgen"
EXTENSION_KEY = "batchgen"

_signals = Namespace()
#: Sent (sender: the app) when a batch ended, with keyword arguments ``batch_id``,
#: ``status``, ``request_counts``, ``finished_at`` (and ``type``), at least once per
#: batch across the host's processes, from the thread ``BATCHGEN_SIGNAL_POLL_S`` starts
#: or from :meth:`BatchGen.deliver_signals`.
batch_finished = _signals.signal("batchgen.batch-finished")


class BatchGen:
    """Flask extension: ``BatchGen(app)`` or ``BatchGen().init_app(app)``."""

    def __init__(self, app: Flask | None = None) -> None:
        if app is not None:
            self.init_app(app)

    def init_app(self, app: Flask) -> None:
        """Export the app's ``BATCHGEN_*`` config, mount the API, register the extension."""
        from batchgen.api import blueprint, install_error_handlers
        from batchgen.dashboard import dashboard
        from batchgen.logs import redact_access_logs

        apply_settings(app.config)
        prefix = app.config.setdefault("BATCHGEN_URL_PREFIX", DEFAULT_URL_PREFIX)
        mount = (prefix or "").rstrip("/")
        app.register_blueprint(blueprint, url_prefix=mount or None)
        app.register_blueprint(dashboard, url_prefix=mount or None)
        install_error_handlers(app, mount)
        redact_access_logs()
        app.extensions[EXTENSION_KEY] = self
        poll_s = app.config.get(SIGNAL_POLL_KEY)
        if poll_s:
            start_signal_poller(self._firing(app), float(poll_s), "batchgen-flask-signals")

    @staticmethod
    def _firing(app: Flask) -> Any:
        def fire(payload: dict[str, Any]) -> None:
            batch_finished.send(app, **payload)

        return fire

    def deliver_signals(self, app: Flask, limit: int = 100) -> int:
        """Send :data:`batch_finished` for the batches that ended since (a cron job or a
        CLI command of the host's may call this instead of the polling thread)."""
        return python_api.deliver_signals(self._firing(app), limit)

    # The Python API (batchgen.python_api), for the host app's own views and jobs.
    submit_batch = staticmethod(python_api.submit_batch)
    get_batch = staticmethod(python_api.get_batch)
    list_batches = staticmethod(python_api.list_batches)
    iter_results = staticmethod(python_api.iter_results)
    cancel_batch = staticmethod(python_api.cancel_batch)
    # The OpenAI Files flow and Anthropic's Message Batches, as the SDK routes serve them.
    upload_file = staticmethod(python_api.upload_file)
    create_batch = staticmethod(python_api.create_batch)
    get_file = staticmethod(python_api.get_file)
    iter_file_content = staticmethod(python_api.iter_file_content)
    create_message_batch = staticmethod(python_api.create_message_batch)
    get_message_batch = staticmethod(python_api.get_message_batch)
    iter_message_batch_results = staticmethod(python_api.iter_message_batch_results)
    usage = staticmethod(python_api.usage)
