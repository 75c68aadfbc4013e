"""PostgreSQL: the (tenant, target) index serves key-prefix filters (``target LIKE 'p%'``),
which a btree on a non-C collation cannot: rebuilt with varchar_pattern_ops (which serves
the equality lookups of redaction too). The admin's key-prefix filter on 1M events took
441 ms before this."""

from django.db import migrations

FORWARD = """
DROP INDEX IF EXISTS audit_tenant_target;
CREATE INDEX audit_tenant_target ON audit_auditevent (tenant_id, target varchar_pattern_ops);
"""
REVERSE = """
DROP INDEX IF EXISTS audit_tenant_target;
CREATE INDEX audit_tenant_target ON audit_auditevent (tenant_id, target);
"""


def _run(sql):
    def run(apps, schema_editor):
        if schema_editor.connection.vendor == "postgresql":
            schema_editor.execute(sql)

    return run


class Migration(migrations.Migration):
    dependencies = [("audit", "0003_append_only_triggers")]

    operations = [migrations.RunPython(_run(FORWARD), _run(REVERSE))]
