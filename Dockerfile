# One image for every service of docker-compose.yml (see its commands).
#
# Stage 1 builds batchgen's wheel and the wheels of its dependencies, pinned by
# constraints.txt (the versions the tests ran), so a rebuild installs the same set.
FROM python:3.11-slim AS build
WORKDIR /src
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
COPY pyproject.toml README.md LICENSE constraints.txt ./
COPY app ./app
COPY tasks ./tasks
COPY migrations ./migrations
# gunicorn serves the API in production ('batchgen.api:create_app()').
RUN pip wheel --no-deps --wheel-dir /wheels . \
 && pip wheel --wheel-dir /wheels --constraint constraints.txt /wheels/batchgen_llm-*.whl "gunicorn>=22"

# Stage 2: a plain (not editable) install of those wheels, nothing else; no source tree.
FROM python:3.11-slim
ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN --mount=type=bind,from=build,source=/wheels,target=/wheels \
    --mount=type=bind,from=build,source=/src/constraints.txt,target=/constraints.txt \
    pip install --no-index --find-links /wheels --constraint /constraints.txt batchgen-llm gunicorn \
 && useradd --system --uid 10001 --user-group --home-dir /srv --no-create-home batchgen
WORKDIR /srv
COPY app/models.toml ./models.toml
COPY examples ./examples
# Beat's schedule file and the nightly output are the only things written.
RUN mkdir -p /srv/data /srv/examples/nightly/out \
 && chown -R batchgen:batchgen /srv/data /srv/examples/nightly/out
ENV BATCHGEN_DATA_DIR=/srv/data \
    BATCHGEN_MODELS_FILE=/srv/models.toml
USER batchgen
EXPOSE 8000 5555 8099
# The API's own check (docker-compose.yml gives every other service its own).
HEALTHCHECK --interval=10s --timeout=5s --start-period=20s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/healthz', timeout=4)"]
CMD ["batchgen", "--help"]
