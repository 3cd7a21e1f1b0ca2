"""The Django admin for batchgen: batches, items, results and usage, read-only, with
filters by status, tenant and model, links from a batch to its items and results,
and a cancel action (through batchgen, as ``services.cancel_batch``).

Tenants and keys change through :mod:`batchgen.tenant_admin` only, so each change is in the
audit log as ``django:<user>``: a tenant's weight and quotas in its change form,
suspend / resume and "new key" actions on tenants, rotate and revoke actions on keys
(a new key's secret is shown once, on the page the action answers with, never in a
message or a cookie). The audit log is listed read-only.

Registered when ``django.contrib.admin`` is installed; the models need batchgen's
database alias (:mod:`batchgen.integrations.django.routers`).
"""

from __future__ import annotations

from typing import Any

from django.contrib import admin, messages
from django.db.models import QuerySet
from django.forms import ModelForm
from django.http import HttpRequest, HttpResponse
from django.urls import reverse
from django.utils.html import format_html, format_html_join

from batchgen import tenant_admin as batchgen_admin
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


def actor(request: HttpRequest) -> str:
    """Who the audit log says made a change from the admin."""
    return f"django:{request.user.get_username()}"


def secrets_page(title: str, made: list[dict[str, Any]]) -> HttpResponse:
    """The page that shows new keys' secrets, once (never cached)."""
    rows = format_html_join(
        "",
        "<tr><td>{}</td><td>{}</td><td>{}</td><td><code>{}</code></td></tr>",
        ((m["tenant"], m["id"], m["name"], m["secret"]) for m in made),
    )
    page = format_html(
        "<!doctype html><title>{}</title><h1>{}</h1>"
        "<p>Copy each key now: it is not shown again.</p>"
        "<table><tr><th>tenant</th><th>id</th><th>name</th><th>key</th></tr>{}</table>"
        '<p><a href="{}">back to the keys</a></p>',
        title,
        title,
        rows,
        reverse("admin:batchgen_apikey_changelist"),
    )
    response = HttpResponse(page)
    response["Cache-Control"] = "no-store"
    return response


# What a tenant's change form may change (through batchgen.tenant_admin.update_tenant).
TENANT_SETTABLE = (
    "weight",
    "max_pending_items",
    "daily_token_quota",
    "tokens_per_min",
    "max_files",
    "max_file_bytes",
)


@admin.register(models.Tenant)
class TenantAdmin(admin.ModelAdmin):  # type: ignore[type-arg]
    list_display = ("name", "weight", "daily_token_quota", "tokens_per_min", "revoked_at")
    fields = ("name", *TENANT_SETTABLE, "is_admin", "webhook_url", "revoked_at", "created_at")
    readonly_fields = ("name", "is_admin", "webhook_url", "revoked_at", "created_at")
    search_fields = ("name",)
    actions = ("suspend", "resume", "new_key")

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False  # a tenant is made with its first key: the admin API, the CLI

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def save_model(self, request: HttpRequest, obj: Any, form: ModelForm, change: bool) -> None:  # type: ignore[type-arg]
        changes = {f: form.cleaned_data[f] for f in form.changed_data if f in TENANT_SETTABLE}
        if changes:
            batchgen_admin.update_tenant(obj.name, changes, actor=actor(request))

    def _each(self, request: HttpRequest, queryset: QuerySet[models.Tenant], do: Any) -> None:
        for tenant in queryset:
            try:
                do(tenant.name, actor=actor(request))
            except BatchgenError as exc:
                self.message_user(request, f"{tenant.name}: {exc}", messages.ERROR)

    @admin.action(description="Suspend the selected tenants (every key refused)")
    def suspend(self, request: HttpRequest, queryset: QuerySet[models.Tenant]) -> None:
        self._each(request, queryset, batchgen_admin.suspend_tenant)

    @admin.action(description="Resume the selected tenants")
    def resume(self, request: HttpRequest, queryset: QuerySet[models.Tenant]) -> None:
        self._each(request, queryset, batchgen_admin.resume_tenant)

    @admin.action(description="Make a new key for each selected tenant")
    def new_key(self, request: HttpRequest, queryset: QuerySet[models.Tenant]) -> HttpResponse:
        made = [
            {
                **batchgen_admin.create_key(t.name, name="admin-made", actor=actor(request)),
                "tenant": t.name,
            }
            for t in queryset
        ]
        return secrets_page("New API keys", made)


@admin.register(models.ApiKey)
class ApiKeyAdmin(ReadOnly):
    list_display = (
        "tenant",
        "id",
        "name",
        "key_prefix",
        "scopes",
        "expires_at",
        "revoked_at",
        "last_used_at",
        "requests_per_min",
    )
    list_filter = ("tenant",)
    search_fields = ("name", "key_prefix")
    actions = ("rotate", "revoke")

    @admin.action(description="Rotate the selected keys (the old ones work 24 h more)")
    def rotate(self, request: HttpRequest, queryset: QuerySet[models.ApiKey]) -> HttpResponse:
        made = []
        for key in queryset.select_related("tenant"):
            try:
                rotated = batchgen_admin.rotate_key(key.tenant.name, key.id, actor=actor(request))
            except BatchgenError as exc:
                self.message_user(request, f"key {key.id}: {exc}", messages.ERROR)
                continue
            made.append({**rotated["new"], "tenant": key.tenant.name})
        return secrets_page("Rotated API keys", made)

    @admin.action(description="Revoke the selected keys now")
    def revoke(self, request: HttpRequest, queryset: QuerySet[models.ApiKey]) -> None:
        for key in queryset.select_related("tenant"):
            batchgen_admin.revoke_key(key.tenant.name, key.id, actor=actor(request))
        self.message_user(request, f"{queryset.count()} keys revoked", messages.SUCCESS)


@admin.register(models.AuditEntry)
class AuditEntryAdmin(ReadOnly):
    list_display = ("at", "actor", "action", "tenant", "key_id")
    list_filter = ("action", "tenant")
    search_fields = ("actor",)
