"""batchgen's tables as read-only, unmanaged Django models, for the admin and for a
site's own queries (``Batch.objects.filter(tenant__name="acme")``).

The schema is Alembic's (``batchgen db upgrade``): Django never creates, migrates
or writes these tables. They live in batchgen's PostgreSQL, which the site names
as a database alias (``DATABASES["batchgen"] = database_from_url(BATCHGEN_DATABASE_URL)``,
:mod:`batchgen.integrations.django.routers`); every change goes through batchgen
(``services.cancel_batch``), so a row's state moves stay in one place. Prompt and
answer bodies are left out.
"""

from __future__ import annotations

from django.contrib.postgres.fields import ArrayField
from django.db import models


class Tenant(models.Model):
    id = models.BigAutoField(primary_key=True)
    name = models.CharField(max_length=200, unique=True)
    weight = models.IntegerField()
    max_pending_items = models.IntegerField(null=True, blank=True)
    daily_token_quota = models.BigIntegerField(null=True, blank=True)
    tokens_per_min = models.IntegerField(null=True, blank=True)
    max_files = models.IntegerField(null=True, blank=True)
    max_file_bytes = models.BigIntegerField(null=True, blank=True)
    is_admin = models.BooleanField()
    webhook_url = models.CharField(max_length=2000, null=True)
    created_at = models.DateTimeField()
    # Suspended: none of its keys works.
    revoked_at = models.DateTimeField(null=True, verbose_name="suspended at")

    class Meta:
        managed = False
        db_table = "tenants"
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name


class ApiKey(models.Model):
    """One of a tenant's API keys: its prefix, never its secret nor its hash."""

    id = models.BigAutoField(primary_key=True)
    tenant = models.ForeignKey(Tenant, on_delete=models.DO_NOTHING, db_constraint=False)
    name = models.CharField(max_length=200)
    key_prefix = models.CharField(max_length=16)
    scopes = ArrayField(models.CharField(max_length=16))
    requests_per_min = models.IntegerField(null=True)
    expires_at = models.DateTimeField(null=True)
    revoked_at = models.DateTimeField(null=True)
    last_used_at = models.DateTimeField(null=True)
    rotated_from = models.BigIntegerField(null=True)
    created_at = models.DateTimeField()

    class Meta:
        managed = False
        db_table = "api_keys"
        ordering = ["tenant", "id"]
        verbose_name = "API key"

    def __str__(self) -> str:
        return f"{self.name} ({self.key_prefix}…)"


class AuditEntry(models.Model):
    """One change to a tenant or a key: who, what, when, before and after."""

    id = models.BigAutoField(primary_key=True)
    at = models.DateTimeField()
    actor = models.CharField(max_length=300)
    action = models.CharField(max_length=64)
    tenant = models.ForeignKey(Tenant, null=True, on_delete=models.DO_NOTHING, db_constraint=False)
    key_id = models.BigIntegerField(null=True)
    before = models.JSONField(null=True)
    after = models.JSONField(null=True)

    class Meta:
        managed = False
        db_table = "audit_log"
        ordering = ["-id"]
        verbose_name = "audit log entry"
        verbose_name_plural = "audit log"

    def __str__(self) -> str:
        return f"{self.action} by {self.actor}"


class Batch(models.Model):
    id = models.CharField(max_length=40, primary_key=True)
    tenant = models.ForeignKey(Tenant, on_delete=models.DO_NOTHING, db_constraint=False)
    status = models.CharField(max_length=20)
    endpoint = models.CharField(max_length=100)
    priority = models.CharField(max_length=20)
    offload = models.CharField(max_length=10)
    route = models.CharField(max_length=10)
    completion_window_s = models.IntegerField()
    deadline_at = models.DateTimeField()
    metadata = models.JSONField(null=True)
    total_items = models.IntegerField()
    on_finished = models.CharField(max_length=200, null=True)
    webhook_url = models.CharField(max_length=2000, null=True)
    created_at = models.DateTimeField()
    cancel_requested_at = models.DateTimeField(null=True)
    finished_at = models.DateTimeField(null=True)

    class Meta:
        managed = False
        db_table = "batches"
        ordering = ["-created_at"]
        verbose_name_plural = "batches"

    def __str__(self) -> str:
        return self.id


class Item(models.Model):
    id = models.BigAutoField(primary_key=True)
    batch = models.ForeignKey(Batch, on_delete=models.DO_NOTHING, db_constraint=False)
    tenant = models.ForeignKey(Tenant, on_delete=models.DO_NOTHING, db_constraint=False)
    line_no = models.IntegerField()
    custom_id = models.CharField(max_length=512)
    model = models.CharField(max_length=200)
    status = models.CharField(max_length=20)
    attempts = models.IntegerField()
    prompt_tokens_est = models.IntegerField()
    max_tokens = models.IntegerField()
    deadline_at = models.DateTimeField()
    created_at = models.DateTimeField()
    finished_at = models.DateTimeField(null=True)
    error_code = models.CharField(max_length=64, null=True)
    job_id = models.BigIntegerField(null=True)

    class Meta:
        managed = False
        db_table = "items"
        ordering = ["batch", "line_no"]

    def __str__(self) -> str:
        return f"{self.batch_id}:{self.custom_id}"


class Result(models.Model):
    item = models.OneToOneField(
        Item, primary_key=True, on_delete=models.DO_NOTHING, db_constraint=False
    )
    batch = models.ForeignKey(Batch, on_delete=models.DO_NOTHING, db_constraint=False)
    tenant = models.ForeignKey(Tenant, on_delete=models.DO_NOTHING, db_constraint=False)
    attempt = models.IntegerField()
    provider_request_id = models.CharField(max_length=200, null=True)
    prompt_tokens = models.IntegerField()
    completion_tokens = models.IntegerField()
    # The kinds of token in them priced apart (docs/cost.md).
    cached_tokens = models.IntegerField()
    cache_write_tokens = models.IntegerField()
    reasoning_tokens = models.IntegerField()
    cost_usd = models.DecimalField(max_digits=20, decimal_places=10)
    upstream_latency_ms = models.IntegerField()
    queue_wait_ms = models.IntegerField()
    created_at = models.DateTimeField()

    class Meta:
        managed = False
        db_table = "results"
        ordering = ["batch", "item"]

    def __str__(self) -> str:
        return f"result of item {self.item_id}"


class Usage(models.Model):
    """One billed provider call (the usage ledger), waste included."""

    id = models.BigAutoField(primary_key=True)
    item = models.ForeignKey(Item, on_delete=models.DO_NOTHING, db_constraint=False)
    attempt = models.IntegerField()
    tenant = models.ForeignKey(Tenant, on_delete=models.DO_NOTHING, db_constraint=False)
    batch = models.ForeignKey(Batch, on_delete=models.DO_NOTHING, db_constraint=False)
    model = models.CharField(max_length=200)
    prompt_tokens = models.IntegerField()
    completion_tokens = models.IntegerField()
    # The kinds of token in them priced apart (docs/cost.md).
    cached_tokens = models.IntegerField()
    cache_write_tokens = models.IntegerField()
    reasoning_tokens = models.IntegerField()
    cost_usd = models.DecimalField(max_digits=20, decimal_places=10)
    waste_reason = models.CharField(max_length=64, null=True)
    route = models.CharField(max_length=10)
    tier = models.CharField(max_length=10)  # standard, flex or batch: its price tier
    created_at = models.DateTimeField()

    class Meta:
        managed = False
        db_table = "usage_ledger"
        ordering = ["-created_at"]
        verbose_name = "usage record"

    def __str__(self) -> str:
        return f"call {self.item_id}:{self.attempt}"
