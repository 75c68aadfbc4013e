"""PostgreSQL: audit events, seals and checkpoints cannot be changed or deleted by the
application, except through the maintenance paths in audit/services.py, which announce
themselves with the transaction-local setting ``zeromem.audit_mode``:

* ``seal``   — an unsealed event gets its seal number and chain value, once; nothing else.
* ``redact`` — only the identifying fields and their kept commitments change.
* ``purge``  — sealed events are deleted, and a seal is marked purged (nothing else of it).

Everything else raises. (A role that may run arbitrary SQL can set the same variable; for
separation against such a role, run the app as a role without TRIGGER/ALTER rights on these
tables — see README "Audit log".) SQLite relies on the models' own refusal.
"""

from django.db import migrations

FORWARD = r"""
CREATE OR REPLACE FUNCTION zeromem_audit_event_guard() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    mode text := coalesce(current_setting('zeromem.audit_mode', true), '');
BEGIN
    IF TG_OP = 'DELETE' THEN
        IF mode = 'purge' AND OLD.seal IS NOT NULL THEN
            RETURN OLD;
        END IF;
        RAISE EXCEPTION 'audit events are append-only (DELETE of event %)', OLD.id
            USING ERRCODE = 'insufficient_privilege';
    END IF;
    IF mode = 'seal' AND OLD.seal IS NULL AND NEW.seal IS NOT NULL
       AND (NEW.id, NEW.uid, NEW.tenant_id, NEW.occurred_at, NEW.actor_kind, NEW.actor_id, NEW.actor_label,
            NEW.surface, NEW.action, NEW.target, NEW.subject, NEW.outcome, NEW.request_id, NEW.client_ip,
            NEW.count, NEW.version, NEW.detail, NEW.digest, NEW.redacted)
           IS NOT DISTINCT FROM
           (OLD.id, OLD.uid, OLD.tenant_id, OLD.occurred_at, OLD.actor_kind, OLD.actor_id, OLD.actor_label,
            OLD.surface, OLD.action, OLD.target, OLD.subject, OLD.outcome, OLD.request_id, OLD.client_ip,
            OLD.count, OLD.version, OLD.detail, OLD.digest, OLD.redacted) THEN
        RETURN NEW;
    END IF;
    IF mode = 'redact'
       AND (NEW.id, NEW.uid, NEW.tenant_id, NEW.occurred_at, NEW.actor_kind, NEW.surface, NEW.action,
            NEW.outcome, NEW.request_id, NEW.count, NEW.version, NEW.detail, NEW.digest, NEW.seal, NEW.chain)
           IS NOT DISTINCT FROM
           (OLD.id, OLD.uid, OLD.tenant_id, OLD.occurred_at, OLD.actor_kind, OLD.surface, OLD.action,
            OLD.outcome, OLD.request_id, OLD.count, OLD.version, OLD.detail, OLD.digest, OLD.seal, OLD.chain) THEN
        RETURN NEW;
    END IF;
    RAISE EXCEPTION 'audit events are append-only (UPDATE of event %)', OLD.id
        USING ERRCODE = 'insufficient_privilege';
END $$;

CREATE OR REPLACE FUNCTION zeromem_audit_seal_guard() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    mode text := coalesce(current_setting('zeromem.audit_mode', true), '');
BEGIN
    IF TG_OP = 'UPDATE' AND mode = 'purge' AND OLD.purged_at IS NULL AND NEW.purged_at IS NOT NULL
       AND (NEW.id, NEW.tenant_id, NEW.seq, NEW.first_event_id, NEW.last_event_id, NEW.count, NEW.total,
            NEW.prev_hash, NEW.hash, NEW.sealed_at)
           IS NOT DISTINCT FROM
           (OLD.id, OLD.tenant_id, OLD.seq, OLD.first_event_id, OLD.last_event_id, OLD.count, OLD.total,
            OLD.prev_hash, OLD.hash, OLD.sealed_at) THEN
        RETURN NEW;
    END IF;
    RAISE EXCEPTION 'audit seals are append-only (% of seal %)', TG_OP, OLD.seq
        USING ERRCODE = 'insufficient_privilege';
END $$;

CREATE OR REPLACE FUNCTION zeromem_audit_refuse() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION '% rows are append-only (% refused)', TG_TABLE_NAME, TG_OP
        USING ERRCODE = 'insufficient_privilege';
END $$;

CREATE TRIGGER audit_event_append_only BEFORE UPDATE OR DELETE ON audit_auditevent
    FOR EACH ROW EXECUTE FUNCTION zeromem_audit_event_guard();
CREATE TRIGGER audit_seal_append_only BEFORE UPDATE OR DELETE ON audit_auditseal
    FOR EACH ROW EXECUTE FUNCTION zeromem_audit_seal_guard();
CREATE TRIGGER audit_checkpoint_append_only BEFORE UPDATE OR DELETE ON audit_auditcheckpoint
    FOR EACH ROW EXECUTE FUNCTION zeromem_audit_refuse();
"""

REVERSE = r"""
DROP TRIGGER IF EXISTS audit_event_append_only ON audit_auditevent;
DROP TRIGGER IF EXISTS audit_seal_append_only ON audit_auditseal;
DROP TRIGGER IF EXISTS audit_checkpoint_append_only ON audit_auditcheckpoint;
DROP FUNCTION IF EXISTS zeromem_audit_event_guard();
DROP FUNCTION IF EXISTS zeromem_audit_seal_guard();
DROP FUNCTION IF EXISTS zeromem_audit_refuse();
"""


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
    dependencies = [("audit", "0002_audit_hash_chain_seals_checkpoints")]

    operations = [migrations.RunPython(forward, reverse)]
