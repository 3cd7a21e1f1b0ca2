"""The host's Flask app: its own dashboard blueprint and template, batchgen under /llm.

flask --app app run                          # the site
flask --app app batchgen signals --follow    # where batch_finished is received
celery -A tasks worker -Q flask_host         # its own Celery worker
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from flask import Blueprint, Flask, render_template, request

from batchgen.integrations.flask import BatchGen, batch_finished

# The test runs batchgen's processes in this folder: none of them may import this.
if os.environ.get("HOST_MARKS"):
    Path(os.environ["HOST_MARKS"], f"{Path(__file__).parent.name}.{__name__}").touch()

dashboard = Blueprint("dashboard", __name__)


@dashboard.get("/dashboard")
def show_dashboard() -> str:
    return render_template("dashboard.html")


def create_app() -> Flask:
    flask_app = Flask(__name__)
    flask_app.config["BATCHGEN_URL_PREFIX"] = "/llm"
    flask_app.register_blueprint(dashboard)  # the host's name, registered first
    llm = BatchGen(flask_app)

    @flask_app.post("/shops/<shop>/describe")
    def describe(shop: str) -> dict[str, Any]:
        rows = [
            {
                "custom_id": f"{shop}-{i}",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {
                    "model": "sim-small",
                    "max_tokens": 5,
                    "messages": [{"role": "user", "content": f"Describe product {i}."}],
                },
            }
            for i in range(int(request.args.get("n", "3")))
        ]
        return llm.submit_batch(
            rows, tenant=shop, on_finished="flask_host.batch_done", on_finished_queue="flask_host"
        )

    @batch_finished.connect_via(flask_app)
    def on_batch_finished(sender: Flask, batch_id: str, status: str, **extra: Any) -> None:
        line = {"batch_id": batch_id, "status": status, "role": os.environ.get("HOST_ROLE")}
        with open(os.environ["HOST_SIGNALS_FILE"], "a", encoding="utf-8") as out:
            out.write(json.dumps(line) + "\n")

    flask_app.extensions["host_receiver"] = on_batch_finished  # blinker holds it weakly
    return flask_app


app = create_app()
