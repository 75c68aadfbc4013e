"""Schemathesis against our own OpenAPI schema (DESIGN "Safe": no server error, no schema
violation), in process: the schema is read from /api/v1/schema and every request goes to
zeromem.wsgi.application in this thread, so it uses the test database and its transaction.

Every operation is fuzzed with valid and invalid data (positive and negative modes; the
examples, coverage and fuzzing phases), with a real all-scopes API key, against a tenant
seeded with a few memories; then a stateful run chains calls (PUT → GET/PATCH/DELETE → GET)
along the links schemathesis infers from the schema. Checks: no 5xx, only documented status
codes and content types, responses that match their schema, invalid input refused, auth
enforced (the same call without the key and with a wrong key is refused), and nothing is
readable after its DELETE.

Bounded for CI (~15 s): Hypothesis max_examples=25 per operation and per stateful run (plus
the coverage phase's deterministic edge cases), a fixed seed, so a run repeats exactly; the
summary line gives the counts. A longer run:

    ZEROMEM_FUZZ_EXAMPLES=500 python3 -m zeromem test tests/test_schema_fuzz.py
    ZEROMEM_FUZZ_SEED=7 ...      # another seed (the default is fixed, so runs repeat)
"""

import os
from collections import Counter

import hypothesis
import pytest
import schemathesis
from django.core.signals import request_finished, request_started
from django.db import close_old_connections, transaction
from hypothesis import HealthCheck

from memories import services
from memories.models import API_KEY_PREFIX, ApiKey, hash_api_key
from tests.factories import SYSTEM, make_key, make_tenant
from zeromem.wsgi import application

EXAMPLES = int(os.environ.get("ZEROMEM_FUZZ_EXAMPLES", "25"))
SEED = int(os.environ.get("ZEROMEM_FUZZ_SEED", "20250101"))
CHECKS = [
    "not_a_server_error",
    "status_code_conformance",
    "content_type_conformance",
    "response_schema_conformance",
    "negative_data_rejection",
    "ignored_auth",
    "use_after_free",
]
# Seeded so that GET/PATCH/DELETE/history find data: short keys like those the generator tries
# first, and the shapes the seeds recommend.
SEED_MEMORIES = [
    ("0", 0, {}),
    ("a", "x", {"tags": ["0"]}),
    ("0:0", {"k": [1, 2]}, {"category": "fact", "subject": "0"}),
    ("user:u1:pref_lang", "zh-CN", {"tags": ["pref", "lang"], "subject": "u1", "category": "user"}),
    ("user:u1:偏好", "中文", {"subject": "u1"}),
    ("task:t1:status", {"done": True, "steps": 3}, {"ttl_seconds": 3600, "category": "task"}),
]

schema = schemathesis.openapi.from_wsgi("/api/v1/schema", application)
schema.config.seed = SEED
schema.config.generation.update(max_examples=EXAMPLES, database="none")
schema.config.checks.update(included_check_names=CHECKS)

# Schemathesis builds some cases while pytest collects, before the test database exists, so
# the key is fixed here and the fixture creates its ApiKey row (through the service).
FUZZ_LOOKUP = "f0220f0220f0"
FUZZ_RAW_KEY = f"{API_KEY_PREFIX}{FUZZ_LOOKUP}_schemathesis-fuzz-key-only-in-the-test-database"


@schema.auth(refresh_interval=None, retry_on=[])
class _BearerKey:
    def get(self, case, context):
        return FUZZ_RAW_KEY

    def set(self, case, data, context):
        case.headers = case.headers or {}
        case.headers["Authorization"] = f"Bearer {data}"


STATS: Counter = Counter()  # (operation, status) → responses, for the summary line


@pytest.fixture(scope="module", autouse=True)
def _report(request):
    yield
    operations = {op for op, _ in STATS if op != "stateful"}
    cases = sum(n for (op, _), n in STATS.items() if op != "stateful")
    steps = sum(n for (op, _), n in STATS.items() if op == "stateful")
    classes = Counter()
    for (_, code), n in STATS.items():
        classes[f"{code // 100}xx"] += n
    mix = ", ".join(f"{c}: {n}" for c, n in sorted(classes.items()))
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    if reporter is not None and capture is not None and cases + steps:
        with capture.global_and_fixture_disabled():
            reporter.write_line(
                f"\nschemathesis {schemathesis.__version__}: {cases} cases over {len(operations)} operations"
                f" + {steps} stateful steps (examples={EXAMPLES}, seed={SEED}; responses {mix})"
            )


@pytest.fixture
def wsgi_in_test_transaction(db):
    """Requests go straight to the WSGI application, whose request_started/finished signals
    close the database connection (CONN_MAX_AGE=0 on PostgreSQL) and so end the test's
    transaction. Django's test Client unhooks them for its requests; so does this."""
    request_started.disconnect(close_old_connections)
    request_finished.disconnect(close_old_connections)
    yield
    request_started.connect(close_old_connections)
    request_finished.connect(close_old_connections)


@pytest.fixture
def fuzz_tenant(wsgi_in_test_transaction, monkeypatch):
    tenant = make_tenant("fuzz")
    fixed = (FUZZ_RAW_KEY, FUZZ_LOOKUP, hash_api_key(FUZZ_RAW_KEY))
    monkeypatch.setattr(ApiKey, "generate", staticmethod(lambda: fixed))
    _key, raw = make_key(tenant)  # every scope, no allowlist
    assert raw == FUZZ_RAW_KEY
    for key, value, extra in SEED_MEMORIES:
        services.memory_write(tenant=tenant, actor=SYSTEM, key=key, value=value, **extra)
    return tenant


@schema.parametrize()
@hypothesis.settings(suppress_health_check=list(HealthCheck), deadline=None)
def test_every_operation_holds_to_the_schema(case, fuzz_tenant):
    # Each case (with the probes its checks send) starts from the seeded tenant: Hypothesis
    # replays cases and expects the same outcome, which state left by earlier ones would break.
    savepoint = transaction.savepoint()
    try:
        response = case.call()
        STATS[(case.operation.label, response.status_code)] += 1
        case.validate_response(response)
    finally:
        transaction.savepoint_rollback(savepoint)


APIWorkflow = schema.as_state_machine()


@hypothesis.seed(SEED)
class _CountingWorkflow(APIWorkflow):
    # Each scenario starts from the seeded tenant (see above), and is rolled back at its end.
    def setup(self):
        self._savepoint = transaction.savepoint()

    def teardown(self):
        transaction.savepoint_rollback(self._savepoint)

    def after_call(self, response, case):
        super().after_call(response, case)
        STATS[("stateful", response.status_code)] += 1


def test_stateful_sequences_hold_to_the_schema(fuzz_tenant):
    # Links inferred from the schema (e.g. PUT /memories/{key} → DELETE, then GET the same key).
    assert any("_DELETE_api_v1_memories_key" in name for name in dir(APIWorkflow)), "no links inferred"
    _CountingWorkflow.run(
        settings=hypothesis.settings(
            max_examples=EXAMPLES,
            stateful_step_count=6,
            deadline=None,
            database=None,
            suppress_health_check=list(HealthCheck),
        )
    )
