# One image for every service of docker-compose.yml (see its commands).
FROM python:3.11-slim
WORKDIR /srv
ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
COPY pyproject.toml README.md celeryconfig.py ./
COPY app ./app
COPY tasks ./tasks
COPY migrations ./migrations
COPY examples ./examples
# gunicorn serves the API in production ('batchgen.api:create_app()').
RUN pip install -e . "gunicorn>=22" \
 && mkdir -p /srv/data /srv/examples/nightly/out \
 && chown -R nobody:nogroup /srv/data /srv/examples/nightly/out
# Beat's schedule file and the nightly output are the only things written.
ENV BATCHGEN_DATA_DIR=/srv/data
USER nobody
EXPOSE 8000 5555 8099
CMD ["batchgen", "--help"]
