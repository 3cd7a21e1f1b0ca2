"""A host job: submit through the host's own view, look at both dashboards; prints JSON."""

from __future__ import annotations

import json
import sys

from app import app

client = app.test_client()
answer = client.post(f"/shops/{sys.argv[1]}/describe?n=3")
print(
    json.dumps(
        {
            "status_code": answer.status_code,
            "batch": answer.json,
            "host_dashboard": client.get("/dashboard").text,
            "batchgen_dashboard": client.get("/llm/dashboard").text,
        }
    )
)
