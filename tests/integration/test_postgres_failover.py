"""PostgreSQL failover through a multi-host ``DATABASE_URL`` with
``target_session_attrs=read-write`` (docs/operations.md, "High availability"): a
primary and its streaming standby of the test's own; the primary crashes, the
standby is promoted, and the process's engine finds the new primary by itself."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from sqlalchemy import create_engine, exc, text

from batchgen.config import Settings
from batchgen.store import db
from tests.invariants import wait_until
from tests.pg_standby import PrimaryStandby, need_pg_binaries

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.fixture
def pair() -> Iterator[PrimaryStandby]:
    servers = PrimaryStandby(need_pg_binaries())
    try:
        yield servers.start()
    finally:
        servers.stop()


def test_multi_host_url_follows_a_promoted_standby(pair):
    url = Settings(database_url=pair.url()).sqlalchemy_url
    engine = db.get_engine(url)

    def server() -> tuple[int, bool]:
        with engine.begin() as conn:
            port, recovering = conn.execute(
                text("SELECT inet_server_port(), pg_is_in_recovery()")
            ).one()
        return int(port), bool(recovering)

    def write(n: int) -> bool:
        try:
            with engine.begin() as conn:
                conn.execute(text("INSERT INTO t VALUES (:n)"), {"n": n})
            return True
        except exc.DBAPIError:
            return False

    try:
        # The standby is named first: read-write passes it by.
        assert server() == (pair.primary_port, False)
        with engine.begin() as conn:
            conn.execute(text("CREATE TABLE t (n int)"))
        assert write(1)
        standby = create_engine(url.split("?")[0] + f"?host=127.0.0.1:{pair.standby_port}")
        with standby.connect() as conn:
            wait_until(
                lambda: conn.execute(text("SELECT count(*) FROM pg_stat_wal_receiver")).scalar(),
                30,
                "the standby to stream",
            )
        standby.dispose()

        pair.stop_primary()
        assert not write(2), "a write went through with no primary"
        pair.promote()
        wait_until(lambda: write(3), 30, "a write on the promoted standby")

        assert server() == (pair.standby_port, False)
        with engine.begin() as conn:
            rows = sorted(conn.scalars(text("SELECT n FROM t")))
        assert rows == [1, 3]
    finally:
        engine.dispose()
