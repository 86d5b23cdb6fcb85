"""The Batch API's store on a real PostgreSQL (Debian's server, started by the test): the store's unit tests
again, each on a fresh database of its own. The same SQLAlchemy code runs both databases; this is what
shows the second one works."""

from __future__ import annotations

import itertools

import pytest
import sqlalchemy as sa

from tests.integration.postgres import postgres_server
from tests.unit.test_batch_store import (  # noqa: F401 - collected here again, on PostgreSQL
    store,
    test_a_batch_goes_through_openais_statuses_stamping_each,
    test_an_owner_sees_only_its_own_files_and_an_admin_sees_every_one,
    test_batches_are_listed_newest_first_per_owner,
    test_each_line_is_finished_once_and_the_results_come_in_input_order,
    test_files_are_listed_newest_first_a_page_at_a_time,
    test_racing_runners_finish_a_line_once,
    test_the_state_outlives_the_store_that_wrote_it,
)

pytestmark = pytest.mark.integration

_numbers = itertools.count()


@pytest.fixture(scope="module")
def server() -> str:
    with postgres_server() as url:
        yield url


@pytest.fixture
def store_url(server: str) -> str:
    name = f"batch_{next(_numbers)}"
    admin = sa.create_engine(server.replace("postgresql://", "postgresql+psycopg://"), isolation_level="AUTOCOMMIT")
    with admin.connect() as db:
        db.execute(sa.text(f"CREATE DATABASE {name}"))
    admin.dispose()
    return server.rsplit("/", 1)[0] + f"/{name}"
