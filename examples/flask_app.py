"""A host Flask app that generates product descriptions through batchgen.

    batchgen db upgrade && batchgen tenants create acme
    batchgen dispatcher & batchgen worker &      # and a provider (batchgen simulator)
    flask --app examples/flask_app.py run

    # the batch API, mounted by the extension under BATCHGEN_URL_PREFIX:
    curl -X POST localhost:5000/batchgen/v1/batches -H "Authorization: Bearer $KEY" \\
         --data-binary @requests.jsonl
    # the app's own routes, calling the Python API:
    curl -X POST localhost:5000/shops/acme/descriptions -H 'Content-Type: application/json' \\
         -d '[{"id": "sku-1", "name": "Teapot", "material": "cast iron"}]'
    curl localhost:5000/shops/acme/descriptions/<batch id>

The shop comes from the URL to keep the example short; a real app takes it
from the signed-in user.
"""

from __future__ import annotations

from typing import Any

from flask import Flask, jsonify, request
from flask.typing import ResponseReturnValue

from batchgen.integrations.flask import BatchGen

batchgen = BatchGen()


def product_request(product: dict[str, Any], model: str) -> dict[str, Any]:
    """One OpenAI Batch request line asking for a description of ``product``."""
    facts = ", ".join(f"{k}: {v}" for k, v in product.items() if k != "id")
    return {
        "custom_id": str(product["id"]),
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {
            "model": model,
            "max_tokens": 120,
            "messages": [{"role": "user", "content": f"Describe this product. {facts}"}],
        },
    }


def create_app(config: dict[str, Any] | None = None) -> Flask:
    """The example app (``flask --app examples/flask_app.py run`` finds this factory)."""
    app = Flask(__name__)
    app.config.update(BATCHGEN_URL_PREFIX="/batchgen", DESCRIPTION_MODEL="sim-small")
    app.config.update(config or {})
    batchgen.init_app(app)

    @app.post("/shops/<shop>/descriptions")
    def describe(shop: str) -> ResponseReturnValue:
        products = request.get_json()
        rows = [product_request(p, app.config["DESCRIPTION_MODEL"]) for p in products]
        batch = batchgen.submit_batch(rows, tenant=shop, completion_window="1h")
        return jsonify({"batch": batch["id"], "status": batch["status"]}), 202

    @app.get("/shops/<shop>/descriptions/<batch_id>")
    def descriptions(shop: str, batch_id: str) -> ResponseReturnValue:
        batch = batchgen.get_batch(batch_id, tenant=shop)
        if batch["finished_at"] is None:
            return jsonify({"status": batch["status"], "counts": batch["request_counts"]}), 202
        texts = {
            row["custom_id"]: row["response"]["body"]["choices"][0]["message"]["content"]
            for row in batchgen.iter_results(batch_id, tenant=shop)
            if row["error"] is None
        }
        return jsonify({"status": batch["status"], "descriptions": texts})

    return app
