"""The Django admin for batchgen: batches, items, results and usage, read-only, with
filters by status, tenant and model, links from a batch to its items and results,
and a cancel action (through batchgen, as ``services.cancel_batch``).

Registered when ``django.contrib.admin`` is installed; the models need batchgen's
database alias (:mod:`batchgen.integrations.django.routers`).
"""

from __future__ import annotations

from typing import Any

from django.contrib import admin, messages
from django.db.models import QuerySet
from django.http import HttpRequest
from django.urls import reverse
from django.utils.html import format_html

from batchgen.errors import BatchgenError
from batchgen.integrations.django import models
from batchgen.integrations.django.services import cancel_batch


class ReadOnly(admin.ModelAdmin):  # type: ignore[type-arg]
    """Shown, never changed here: batchgen owns every state move."""

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


def _changelist(model: str, **filters: str) -> str:
    query = "&".join(f"{k}={v}" for k, v in filters.items())
    return f"{reverse(f'admin:batchgen_{model}_changelist')}?{query}"


@admin.register(models.Batch)
class BatchAdmin(ReadOnly):
    list_display = (
        "id",
        "tenant",
        "status",
        "priority",
        "total_items",
        "created_at",
        "finished_at",
    )
    list_filter = ("status", "priority", "offload", "route", "tenant")
    search_fields = ("id",)
    readonly_fields = ("items_link", "results_link")
    actions = ("cancel",)

    @admin.display(description="items")
    def items_link(self, batch: models.Batch) -> str:
        url = _changelist("item", batch__id__exact=batch.id)
        return format_html('<a href="{}">{} items</a>', url, batch.total_items)

    @admin.display(description="results")
    def results_link(self, batch: models.Batch) -> str:
        return format_html(
            '<a href="{}">results</a>', _changelist("result", batch__id__exact=batch.id)
        )

    @admin.action(description="Cancel the selected batches")
    def cancel(self, request: HttpRequest, queryset: QuerySet[models.Batch]) -> None:
        done = 0
        for batch in queryset.select_related("tenant"):
            try:
                cancel_batch(batch.id, tenant=batch.tenant.name)
                done += 1
            except BatchgenError as exc:
                self.message_user(request, f"{batch.id}: {exc}", messages.ERROR)
        self.message_user(request, f"{done} batches cancelled", messages.SUCCESS)


@admin.register(models.Item)
class ItemAdmin(ReadOnly):
    list_display = ("id", "batch", "custom_id", "model", "status", "attempts", "error_code")
    list_filter = ("status", "model", "tenant")
    search_fields = ("custom_id", "batch__id")


@admin.register(models.Result)
class ResultAdmin(ReadOnly):
    list_display = ("item", "batch", "prompt_tokens", "completion_tokens", "cost_usd", "created_at")
    list_filter = ("tenant",)
    search_fields = ("batch__id",)


@admin.register(models.Usage)
class UsageAdmin(ReadOnly):
    list_display = (
        "created_at",
        "tenant",
        "model",
        "route",
        "tier",
        "prompt_tokens",
        "completion_tokens",
        "cost_usd",
        "waste_reason",
    )
    list_filter = ("model", "route", "tier", "tenant")


@admin.register(models.Tenant)
class TenantAdmin(ReadOnly):
    list_display = ("name", "key_prefix", "weight", "max_pending_items", "is_admin", "revoked_at")
