"""Allowlist entries match on whole segments now. An entry stored as a bare segment path
(``user:u1``, which as a plain prefix also covered ``user:u10:…``) that names a namespace
gets its trailing ':' (``user:u1:``); one that names a key (a summary key such as
``summary:session:s1``, or any key a memory of the tenant has) keeps its form, which now
covers that key and the keys under it. An empty entry covered every key, so a list holding
one becomes the empty list (the whole tenant, as before)."""

from django.db import migrations


def normalise(entries: list, *, names_a_key) -> list:
    if any(not isinstance(e, str) or not e.strip() for e in entries):
        return []
    out = []
    for entry in (e.strip() for e in entries):
        if not entry.endswith(":") and not entry.startswith("summary:") and not names_a_key(entry):
            entry += ":"
        if entry not in out:
            out.append(entry)
    return out


def forwards(apps, schema_editor):
    ApiKey = apps.get_model("memories", "ApiKey")
    Memory = apps.get_model("memories", "Memory")
    for key in ApiKey.objects.exclude(allowed_prefixes=[]).only("pk", "tenant_id", "allowed_prefixes").iterator():
        entries = key.allowed_prefixes if isinstance(key.allowed_prefixes, list) else []

        def names_a_key(entry, tenant_id=key.tenant_id):
            return Memory.objects.filter(tenant_id=tenant_id, key=entry).exists()

        normalised = normalise(entries, names_a_key=names_a_key)
        if normalised != entries:
            ApiKey.objects.filter(pk=key.pk).update(allowed_prefixes=normalised)


class Migration(migrations.Migration):
    dependencies = [("memories", "0008_forget_request_reach")]

    operations = [migrations.RunPython(forwards, migrations.RunPython.noop, elidable=True)]
