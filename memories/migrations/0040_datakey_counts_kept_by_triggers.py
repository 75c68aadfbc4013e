"""PostgreSQL: the data keys by state (``current``, ``retired``, ``destroyed``), kept up to
date by triggers on the key store's ``memories_datakey``, in the transaction of the change,
so that ``GET /metrics`` reads at most 48 small rows instead of counting every key (56 ms a
scrape at 500k keys, growing with them; zeromem/kit/metrics.py).

Why triggers and not a count cached by a periodic job: the figure is exact at every commit
whatever changed the rows (a write making a subject's key, a rotation, a forget's shred,
a bulk or raw-SQL change, a rolled-back one counting nothing), with no job to schedule and
no staleness to explain. Statement-level triggers with transition tables: one upsert per
statement that changes states (a rotation of 10k keys is one), none for a change that keeps
them (a re-wrap). The counts are spread over 16 slots by the backend's pid, so concurrent
writers making keys for new subjects rarely wait on one row; the scrape adds the slots up.
Each statement's upsert takes its rows in one order (by state).

Runs on the key store database (``ZEROMEM_KEYSTORE_URL``) with the table it counts. The
initial counts are taken in this migration's transaction, after the triggers are created
(CREATE TRIGGER locks out writers of the table until the commit): no change is counted
twice or missed. SQLite (development) has no triggers here; the gauge counts there.
"""

from django.db import migrations

FORWARD = r"""
CREATE TABLE memories_datakey_count (
    state varchar(16) NOT NULL,
    slot smallint NOT NULL,
    n bigint NOT NULL DEFAULT 0,
    PRIMARY KEY (state, slot)
);

CREATE FUNCTION zeromem_datakey_state(retired_at timestamptz, destroyed_at timestamptz) RETURNS text
LANGUAGE sql IMMUTABLE AS $$
    SELECT CASE WHEN destroyed_at IS NOT NULL THEN 'destroyed'
                WHEN retired_at IS NOT NULL THEN 'retired'
                ELSE 'current' END
$$;

CREATE FUNCTION zeromem_datakey_count_add() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'INSERT' THEN
        INSERT INTO memories_datakey_count AS c (state, slot, n)
        SELECT zeromem_datakey_state(retired_at, destroyed_at) AS s, pg_backend_pid() % 16, count(*)
        FROM new_rows GROUP BY s ORDER BY s
        ON CONFLICT (state, slot) DO UPDATE SET n = c.n + EXCLUDED.n;
    ELSIF TG_OP = 'DELETE' THEN
        INSERT INTO memories_datakey_count AS c (state, slot, n)
        SELECT zeromem_datakey_state(retired_at, destroyed_at) AS s, pg_backend_pid() % 16, -count(*)
        FROM old_rows GROUP BY s ORDER BY s
        ON CONFLICT (state, slot) DO UPDATE SET n = c.n + EXCLUDED.n;
    ELSIF TG_OP = 'UPDATE' THEN
        INSERT INTO memories_datakey_count AS c (state, slot, n)
        SELECT s, pg_backend_pid() % 16, sum(d)
        FROM (
            SELECT zeromem_datakey_state(retired_at, destroyed_at) AS s, 1 AS d FROM new_rows
            UNION ALL
            SELECT zeromem_datakey_state(retired_at, destroyed_at), -1 FROM old_rows
        ) AS moved
        GROUP BY s HAVING sum(d) <> 0 ORDER BY s
        ON CONFLICT (state, slot) DO UPDATE SET n = c.n + EXCLUDED.n;
    ELSE  -- TRUNCATE: every key gone at once
        DELETE FROM memories_datakey_count;
    END IF;
    RETURN NULL;
END $$;

CREATE TRIGGER memories_datakey_count_insert AFTER INSERT ON memories_datakey
    REFERENCING NEW TABLE AS new_rows FOR EACH STATEMENT EXECUTE FUNCTION zeromem_datakey_count_add();
CREATE TRIGGER memories_datakey_count_update AFTER UPDATE ON memories_datakey
    REFERENCING OLD TABLE AS old_rows NEW TABLE AS new_rows
    FOR EACH STATEMENT EXECUTE FUNCTION zeromem_datakey_count_add();
CREATE TRIGGER memories_datakey_count_delete AFTER DELETE ON memories_datakey
    REFERENCING OLD TABLE AS old_rows FOR EACH STATEMENT EXECUTE FUNCTION zeromem_datakey_count_add();
CREATE TRIGGER memories_datakey_count_truncate AFTER TRUNCATE ON memories_datakey
    FOR EACH STATEMENT EXECUTE FUNCTION zeromem_datakey_count_add();

INSERT INTO memories_datakey_count (state, slot, n)
SELECT zeromem_datakey_state(retired_at, destroyed_at) AS s, 0, count(*) FROM memories_datakey GROUP BY s;
"""

REVERSE = r"""
DROP TRIGGER IF EXISTS memories_datakey_count_insert ON memories_datakey;
DROP TRIGGER IF EXISTS memories_datakey_count_update ON memories_datakey;
DROP TRIGGER IF EXISTS memories_datakey_count_delete ON memories_datakey;
DROP TRIGGER IF EXISTS memories_datakey_count_truncate ON memories_datakey;
DROP FUNCTION IF EXISTS zeromem_datakey_count_add();
DROP FUNCTION IF EXISTS zeromem_datakey_state(timestamptz, timestamptz);
DROP TABLE IF EXISTS memories_datakey_count;
"""


def _run(schema_editor, sql: str) -> None:
    if schema_editor.connection.vendor == "postgresql":
        with schema_editor.connection.cursor() as cursor:
            cursor.execute(sql)


def forward(apps, schema_editor):
    _run(schema_editor, FORWARD)


def reverse(apps, schema_editor):
    _run(schema_editor, REVERSE)


class Migration(migrations.Migration):
    dependencies = [("memories", "0039_forgetrequest_tenant_end_user")]

    # The hint routes it to the database holding the data keys (memories/routers.py).
    operations = [migrations.RunPython(forward, reverse, hints={"model_name": "datakey"})]
