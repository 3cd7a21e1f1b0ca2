"""The shop's own views call batchgen's Python API (the shop comes from the URL to keep
the example short; a real app takes it from the signed-in user)."""

import json

from django.http import HttpRequest, JsonResponse
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_GET, require_POST

from batchgen.errors import ClientError
from batchgen.integrations.django.services import get_batch, iter_results, submit_batch


def _error(exc: ClientError) -> JsonResponse:
    return JsonResponse({"error": exc.to_dict()}, status=exc.status_code)


@csrf_exempt  # an example API view; a form view would keep CSRF protection
@require_POST
def describe(request: HttpRequest, shop: str) -> JsonResponse:
    products = json.loads(request.body)
    rows = [
        {
            "custom_id": str(p["id"]),
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "model": "sim-small",
                "max_tokens": 120,
                "messages": [{"role": "user", "content": f"Describe the product {p['name']}."}],
            },
        }
        for p in products
    ]
    try:
        batch = submit_batch(rows, tenant=shop, completion_window="1h")
    except ClientError as exc:
        return _error(exc)
    return JsonResponse({"batch": batch["id"], "status": batch["status"]}, status=202)


@require_GET
def descriptions(request: HttpRequest, shop: str, batch_id: str) -> JsonResponse:
    try:
        batch = get_batch(batch_id, tenant=shop)
    except ClientError as exc:
        return _error(exc)
    if batch["finished_at"] is None:
        return JsonResponse({"status": batch["status"]}, status=202)
    texts = {
        row["custom_id"]: row["response"]["body"]["choices"][0]["message"]["content"]
        for row in iter_results(batch_id, tenant=shop)
        if row["error"] is None
    }
    return JsonResponse({"status": batch["status"], "descriptions": texts})
