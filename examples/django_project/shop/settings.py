"""Settings of the example shop: batchgen is one installed app among others."""

from pathlib import Path

BASE_DIR = Path(__file__).resolve().parent.parent
SECRET_KEY = "example-only-not-secret"
DEBUG = True
ALLOWED_HOSTS = ["localhost", "127.0.0.1"]

INSTALLED_APPS = [
    "django.contrib.contenttypes",
    "django.contrib.auth",
    "batchgen.integrations.django",  # batchgen: the API's URLs, services, batchgen_submit
    "shop",
]
MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
]
ROOT_URLCONF = "shop.urls"
# The shop's own database. batchgen keeps its data in its own PostgreSQL
# (DATABASE_URL or BATCHGEN_DATABASE_URL), with its schema from its migrations.
DATABASES = {"default": {"ENGINE": "django.db.backends.sqlite3", "NAME": BASE_DIR / "shop.db"}}
USE_TZ = True

# Every BATCHGEN_* setting is handed to batchgen (app/config.py lists them);
# the rest come from the environment.
BATCHGEN_MAX_BATCH_LINES = 10_000
