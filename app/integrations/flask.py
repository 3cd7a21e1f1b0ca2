"""The Flask extension: mount the batch API in a host app and hand it the Python API.

    from flask import Flask
    from batchgen.integrations.flask import BatchGen

    app = Flask(__name__)
    app.config["BATCHGEN_URL_PREFIX"] = "/llm"   # default "/batchgen"
    batchgen = BatchGen(app)                      # or BatchGen().init_app(app)

    @app.post("/shops/<shop>/describe")
    def describe(shop):
        batch = batchgen.submit_batch(rows, tenant=shop)   # or current_app.extensions["batchgen"]

The API's routes answer under the prefix exactly as the standalone API does
(``POST <prefix>/v1/batches`` …), every error below the prefix included (404,
405, 500, 503 as JSON; the host's pages elsewhere are left alone); a
:class:`~batchgen.errors.BatchgenError` raised in any view of the host app becomes
the same JSON error answer. Access logs of the host's server lose their query
strings (they may carry a batch's ``metadata``).
"""

from __future__ import annotations

from flask import Flask

from batchgen import python_api
from batchgen.integrations import apply_settings

DEFAULT_URL_PREFIX = "/batchgen"
EXTENSION_KEY = "batchgen"


class BatchGen:
    """Flask extension: ``BatchGen(app)`` or ``BatchGen().init_app(app)``."""

    def __init__(self, app: Flask | None = None) -> None:
        if app is not None:
            self.init_app(app)

    def init_app(self, app: Flask) -> None:
        """Export the app's ``BATCHGEN_*`` config, mount the API, register the extension."""
        from batchgen.api import blueprint, install_error_handlers
        from batchgen.logs import redact_access_logs

        apply_settings(app.config)
        prefix = app.config.setdefault("BATCHGEN_URL_PREFIX", DEFAULT_URL_PREFIX)
        mount = (prefix or "").rstrip("/")
        app.register_blueprint(blueprint, url_prefix=mount or None)
        install_error_handlers(app, mount)
        redact_access_logs()
        app.extensions[EXTENSION_KEY] = self

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
