"""The Django app config: exports the project's ``BATCHGEN_*`` settings at start-up."""

from __future__ import annotations

from django.apps import AppConfig

from batchgen.integrations import SIGNAL_POLL_KEY, start_signal_poller


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
        from batchgen.integrations.django import checks  # noqa: F401  (registers them)

        poll_s = getattr(settings, SIGNAL_POLL_KEY, None)
        if poll_s:
            from batchgen.integrations.django.signals import fire

            start_signal_poller(fire, float(poll_s), "batchgen-django-signals")
