"""The Django app config: exports the project's ``BATCHGEN_*`` settings at start-up and
makes the site the origin of the batches submitted in its processes."""

from __future__ import annotations

from django.apps import AppConfig


class BatchgenConfig(AppConfig):
    name = "batchgen.integrations.django"
    label = "batchgen"
    verbose_name = "batchgen"

    def ready(self) -> None:
        from django.conf import settings

        from batchgen.integrations import apply_settings
        from batchgen.logs import redact_access_logs

        apply_settings({key: getattr(settings, key) for key in dir(settings) if key.isupper()})
        redact_access_logs()  # runserver's log line would carry ?metadata=…
        from batchgen import python_api
        from batchgen.integrations.django import checks  # noqa: F401  (registers them)
        from batchgen.integrations.django.signals import origin

        # No signal thread here: receivers run in `manage.py batchgen_signals` only.
        python_api.register_origin(origin, process_wide=True)
