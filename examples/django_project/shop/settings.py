"""Settings of the example shop: batchgen is one installed app among others."""

import os
from pathlib import Path

from batchgen.integrations.django.routers import database_from_url

BASE_DIR = Path(__file__).resolve().parent.parent
SECRET_KEY = "example-only-not-secret"
DEBUG = True
ALLOWED_HOSTS = ["localhost", "127.0.0.1", "testserver"]

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.contenttypes",
    "django.contrib.auth",
    "django.contrib.sessions",
    "django.contrib.messages",
    "batchgen.integrations.django",  # the API's URLs, services, commands, admin, signal
    "shop",
]
MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
]
TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ]
        },
    }
]
ROOT_URLCONF = "shop.urls"
# The shop's own database. batchgen keeps its data in its own PostgreSQL, with its
# schema from its migrations; the admin reads it through the "batchgen" alias.
DATABASES = {"default": {"ENGINE": "django.db.backends.sqlite3", "NAME": BASE_DIR / "shop.db"}}
BATCHGEN_DATABASE_URL = os.environ.get("BATCHGEN_DATABASE_URL") or os.environ.get("DATABASE_URL")
if BATCHGEN_DATABASE_URL:
    DATABASES["batchgen"] = database_from_url(BATCHGEN_DATABASE_URL)
DATABASE_ROUTERS = ["batchgen.integrations.django.routers.BatchgenRouter"]
USE_TZ = True
# The batch dashboard (/batchgen/dashboard) follows the site's login: staff users see
# its operator view, anonymous visitors are sent here.
LOGIN_URL = "/admin/login/"

# Every BATCHGEN_* setting is handed to batchgen (app/config.py lists them);
# the rest come from the environment.
BATCHGEN_MAX_BATCH_LINES = 10_000
