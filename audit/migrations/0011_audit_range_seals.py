"""Sealing without rewriting event rows: a seal names its events by id range.

Until now the sealing job UPDATEd every event once to set ``seal`` and ``chain`` (a second
copy of every row in the heap until VACUUM, every index entry written twice, the row twice
in the WAL). From here on a seal made by the job is a *range seal* (``by_range``): its events
are its tenant's events with ids ``first_event_id..last_event_id`` whose ``seal`` column is
null, and nothing is written to them — the chain values are recomputed by ``audit_verify``.
It is safe because the job seals only ids below a settled horizon: every transaction that
could still commit an event with such an id has ended (``audit.services._settled_horizon``),
so no event can commit late into a range already sealed.

Seals made before this migration keep their meaning (their events carry the seal number).
An event's ``seal`` column now stays null for new events; the partial index ``audit_unsealed``
(tenant, id) WHERE seal IS NULL keeps serving the tail (``id > the last range seal``).

PostgreSQL: the append-only guard lets the purge delete an event that a range seal holds (it
only allowed events with a seal number), and the seal guard freezes ``by_range`` too. A
partial index on seals (tenant, last_event_id) WHERE by_range finds the seal of an event id.
The function is shared by every partition's cloned trigger, so every partition gets it.
"""

import importlib

from django.db import migrations, models

EVENT_GUARD = r"""
CREATE OR REPLACE FUNCTION zeromem_audit_event_guard() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    mode text := coalesce(current_setting('zeromem.audit_mode', true), '');
    held boolean;
BEGIN
    IF TG_OP = 'DELETE' THEN
        IF mode = 'purge' AND OLD.seal IS NOT NULL THEN
            RETURN OLD;
        END IF;
        IF mode = 'purge' THEN
            -- held by a range seal: the tenant's first range seal ending at or after the id
            -- (index auditseal_range_last) starts at or before it
            IF OLD.tenant_id IS NULL THEN
                SELECT s.first_event_id <= OLD.id INTO held FROM audit_auditseal s
                WHERE s.by_range AND s.tenant_id IS NULL AND s.last_event_id >= OLD.id
                ORDER BY s.last_event_id LIMIT 1;
            ELSE
                SELECT s.first_event_id <= OLD.id INTO held FROM audit_auditseal s
                WHERE s.by_range AND s.tenant_id = OLD.tenant_id AND s.last_event_id >= OLD.id
                ORDER BY s.last_event_id LIMIT 1;
            END IF;
            IF held THEN
                RETURN OLD;
            END IF;
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
            NEW.prev_hash, NEW.hash, NEW.sealed_at, NEW.by_range)
           IS NOT DISTINCT FROM
           (OLD.id, OLD.tenant_id, OLD.seq, OLD.first_event_id, OLD.last_event_id, OLD.count, OLD.total,
            OLD.prev_hash, OLD.hash, OLD.sealed_at, OLD.by_range) THEN
        RETURN NEW;
    END IF;
    RAISE EXCEPTION 'audit seals are append-only (% of seal %)', TG_OP, OLD.seq
        USING ERRCODE = 'insufficient_privilege';
END $$;
"""


def _run(schema_editor, sql: str) -> None:
    if schema_editor.connection.vendor == "postgresql":
        # No parameters, so the '%' of RAISE formats is not taken for a placeholder.
        with schema_editor.connection.cursor() as cursor:
            cursor.execute(sql)


def forward(apps, schema_editor):
    _run(schema_editor, EVENT_GUARD)


def reverse(apps, schema_editor):
    # The guards of 0003 (its functions, not its triggers, which stay).
    previous = importlib.import_module("audit.migrations.0003_append_only_triggers").FORWARD
    _run(schema_editor, previous.split("CREATE TRIGGER")[0])


class Migration(migrations.Migration):
    dependencies = [("audit", "0010_audit_partitioned_by_month")]

    operations = [
        migrations.AddField(
            model_name="auditseal",
            name="by_range",
            field=models.BooleanField(default=False, editable=False),
        ),
        migrations.AddIndex(
            model_name="auditseal",
            index=models.Index(
                fields=["tenant", "last_event_id"], name="auditseal_range_last", condition=models.Q(by_range=True)
            ),
        ),
        migrations.RunPython(forward, reverse),
    ]
