"""PostgreSQL: TRUNCATE of the audit tables is refused too. Row triggers (0003) never see a
TRUNCATE, which empties a table at once: a statement-level BEFORE TRUNCATE trigger refuses
it, unless the session announces a deliberate wipe of the whole database with
``SET zeromem.audit_mode = 'flush'`` (the test suite's ``flush`` between transactional
tests does; ``manage.py flush`` on a live database does not, and fails).
"""

from django.db import migrations

TABLES = ("audit_auditevent", "audit_auditseal", "audit_auditcheckpoint")

FORWARD = r"""
CREATE OR REPLACE FUNCTION zeromem_audit_refuse_truncate() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF coalesce(current_setting('zeromem.audit_mode', true), '') = 'flush' THEN
        RETURN NULL;
    END IF;
    RAISE EXCEPTION '% rows are append-only (TRUNCATE refused)', TG_TABLE_NAME
        USING ERRCODE = 'insufficient_privilege';
END $$;
""" + "".join(
    f"CREATE TRIGGER {table}_no_truncate BEFORE TRUNCATE ON {table} "
    "FOR EACH STATEMENT EXECUTE FUNCTION zeromem_audit_refuse_truncate();\n"
    for table in TABLES
)

REVERSE = "".join(f"DROP TRIGGER IF EXISTS {table}_no_truncate ON {table};\n" for table in TABLES) + (
    "DROP FUNCTION IF EXISTS zeromem_audit_refuse_truncate();\n"
)


def _run(schema_editor, sql: str) -> None:
    if schema_editor.connection.vendor == "postgresql":
        # No parameters, so the '%' of RAISE formats is not taken for a placeholder.
        with schema_editor.connection.cursor() as cursor:
            cursor.execute(sql)


def forward(apps, schema_editor):
    _run(schema_editor, FORWARD)


def reverse(apps, schema_editor):
    _run(schema_editor, REVERSE)


class Migration(migrations.Migration):
    dependencies = [("audit", "0006_concurrency_slots")]

    operations = [migrations.RunPython(forward, reverse)]
