"""ZeroMem settings, read from the environment (django-environ).

Two shapes of deployment share this file:

* embedded (no ``DATABASE_URL``): a SQLite file under ``var/`` and django-q2's ORM broker,
  so one command starts everything on a fresh machine;
* production (``DATABASE_URL=postgres://...``): PostgreSQL through psycopg 3 with a
  connection pool, optionally Redis (``REDIS_URL``) for the shared cache / rate limits.

``ZEROMEM_ENV=development`` turns on DEBUG and allows a throw-away SECRET_KEY; in any other
mode SECRET_KEY must be set and the deploy checks pass (see README "Settings").
"""

import hashlib
import math
import os
from pathlib import Path

import environ
from django.core.exceptions import ImproperlyConfigured

from zeromem.serving import DEFAULT_SEARCH_TIER_CONCURRENCY, pool_max_size, web_threads


class Env(environ.Env):
    """django-environ, with a value it cannot read refused naming its variable: its own error
    (``invalid literal for int() with base 10: 'abc'``) names neither the variable nor where."""

    def get_value(self, var, cast=None, default=environ.Env.NOTSET, parse_default=False):
        try:
            return super().get_value(var, cast=cast, default=default, parse_default=parse_default)
        except ValueError as exc:
            raise ImproperlyConfigured(f"{var} cannot be read: {exc}") from None

    def db_url(self, var=environ.Env.DEFAULT_DATABASE_ENV, default=environ.Env.NOTSET, engine=None):
        try:
            return super().db_url(var, default=default, engine=engine)
        except ValueError as exc:
            raise ImproperlyConfigured(f"{var} is not a database URL: {exc}") from None

    db = db_url

    # A yes/no setting that is neither (SECURE_SSL_REDIRECT=ture) is refused: django-environ
    # reads any word it does not know as False, silently switching the feature off.
    BOOLEAN_FALSE_STRINGS = ("false", "off", "no", "n", "0", "")

    @classmethod
    def parse_value(cls, value, cast):
        if cast is bool and isinstance(value, str):
            word = value.strip().lower()
            if word not in cls.BOOLEAN_TRUE_STRINGS and word not in cls.BOOLEAN_FALSE_STRINGS:
                raise ValueError(f"{value!r} is not a yes/no value (true/false, on/off, yes/no, 1/0)")
        return super().parse_value(value, cast)


BASE_DIR = Path(__file__).resolve().parent.parent
VAR_DIR = Path(Env().str("ZEROMEM_VAR_DIR", default=str(BASE_DIR / "var")))
VAR_DIR.mkdir(parents=True, exist_ok=True)

env = Env()
# A git-ignored .env (written by `python3 -m zeromem up`) keeps the dev settings for manage.py.
environ.Env.read_env(BASE_DIR / ".env", overwrite=False)

ZEROMEM_ENV = env.str("ZEROMEM_ENV", default="production")
DEVELOPMENT = ZEROMEM_ENV == "development"

DEBUG = env.bool("DEBUG", default=DEVELOPMENT)
if DEVELOPMENT:
    SECRET_KEY = env.str("SECRET_KEY", default="dev-only-insecure-key-" + "x" * 40)
else:
    SECRET_KEY = env.str("SECRET_KEY")  # required: raises ImproperlyConfigured when missing

# "testserver" is Django's test client's host: development (and so the tests) only.
ALLOWED_HOSTS = env.list(
    "ALLOWED_HOSTS", default=["localhost", "127.0.0.1", "[::1]"] + (["testserver"] if DEVELOPMENT else [])
)
CSRF_TRUSTED_ORIGINS = env.list("CSRF_TRUSTED_ORIGINS", default=[])

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "django.contrib.postgres",
    "rest_framework",
    "drf_spectacular",
    "drf_spectacular_sidecar",
    "servestatic",
    "django_q",
    "memories",
    "audit",
    "memories.portal",
    "zeromem.bench",
    "csp",
]
# The model every tenant-scoped row refers to; the audit app reaches it by this label
# (zeromem/kernel/tenancy.py), so that it never imports the memories app.
ZEROMEM_TENANT_MODEL = "memories.Tenant"

MIDDLEWARE = [
    "zeromem.middleware.RequestIdMiddleware",
    # Requests by route, status and latency for GET /metrics (zeromem/kit/metrics.py).
    "zeromem.kit.metrics.MetricsMiddleware",
    "django.middleware.security.SecurityMiddleware",
    "zeromem.middleware.StaticFilesMiddleware",  # ServeStatic, on /static/ only
    # Django's session, auth and messages middleware, skipped on /api/ and /healthz
    # (zeromem/middleware.py: API_PATHS); the admin and the portal get all of them.
    "zeromem.middleware.BrowserSessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "zeromem.middleware.BrowserAuthenticationMiddleware",
    "zeromem.middleware.BrowserMessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    # Content-Security-Policy on the admin and the portal (django-csp's, not run on its excluded paths)
    "zeromem.middleware.BrowserCSPMiddleware",
]

# Content-Security-Policy (django-csp) on the HTML pages: the admin and the portal load
# scripts, styles, fonts and images from this origin only (inline style attributes allowed:
# the admin's and the charts' own), post forms only here and cannot be framed. The API
# (JSON), its docs pages and static files are left out.
from csp.constants import NONE, SELF  # noqa: E402

CONTENT_SECURITY_POLICY = {
    "EXCLUDE_URL_PREFIXES": ["/api/", "/healthz", "/static/"],
    "DIRECTIVES": {
        "default-src": [NONE],
        "script-src": [SELF],
        "style-src": [SELF, "'unsafe-inline'"],
        "img-src": [SELF, "data:"],
        "font-src": [SELF],
        "connect-src": [SELF],
        "form-action": [SELF],
        "frame-ancestors": [NONE],
        "base-uri": [NONE],
    },
}

ROOT_URLCONF = "zeromem.urls"
WSGI_APPLICATION = "zeromem.wsgi.application"
ASGI_APPLICATION = "zeromem.asgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]

# --- Database -------------------------------------------------------------------------
if env.str("DATABASE_URL", default=""):
    DATABASES = {"default": env.db("DATABASE_URL")}
    if DATABASES["default"]["ENGINE"] == "django.db.backends.postgresql":
        # A psycopg_pool pool per process. Under WSGI (`python3 -m zeromem serve`) a request
        # thread checks a connection out at its first query and returns it when the request
        # finishes, so a pool of one connection per thread (+ headroom, zeromem/serving.py)
        # never makes a request wait, and `serve` keeps that many open (DB_POOL_MIN_SIZE =
        # threads) so that no request opens one. Under ASGI every request runs in a fresh
        # thread, so CONN_MAX_AGE would open a connection per request; the pool hands out
        # warm ones there too (set DB_POOL_MAX_SIZE to the concurrency you allow).
        DATABASES["default"]["CONN_MAX_AGE"] = 0
        # The pool checks a connection before handing it out (an empty query): after a
        # database restart its idle connections are dead, and without the check each would
        # cost one request a 503 (tests/test_database_outage.py). It is a round trip per
        # request; DB_POOL_CHECK_FRESH_SECONDS > 0 skips it for a connection just used whose
        # socket has nothing to read, at the price of 503s after a silent failover or a
        # backend just terminated (zeromem/dbpool.py: off by default).
        DATABASES["default"]["CONN_HEALTH_CHECKS"] = env.bool("DB_CONN_HEALTH_CHECKS", default=True)
        DATABASES["default"].setdefault("OPTIONS", {})["pool"] = {
            "min_size": env.int("DB_POOL_MIN_SIZE", default=2),
            "max_size": env.int("DB_POOL_MAX_SIZE", default=pool_max_size(web_threads(os.environ))),
            # With a connection per request thread no request waits for one, except while the
            # pool refills after a database restart: that took 2-3.6 s on a loaded 2-core
            # machine, so a 2-s timeout turned recoverable waits into 503s
            # (tests/test_database_outage.py). While the database is down: 503 after this.
            "timeout": env.float("DB_POOL_TIMEOUT", default=5.0),
            # While the database is down the pool retries connecting with exponential
            # backoff (1, 2, 4, 8 ... s) until it gives up after this long; the next waiting
            # request starts a new attempt. Short, so the API is back within ~1 s of the
            # database, not one backoff step (up to minutes) later (manage.py bench_load).
            "reconnect_timeout": env.float("DB_POOL_RECONNECT_TIMEOUT", default=2.0),
        }
        DATABASES["default"]["OPTIONS"].setdefault("connect_timeout", env.int("DB_CONNECT_TIMEOUT", default=3))
        # django-q2 forks its workers from a process that has opened the pool: without this
        # a child would reuse the parent's sockets (zeromem/forking.py).
        from zeromem.forking import forget_inherited_connections

        os.register_at_fork(after_in_child=forget_inherited_connections)
        # PgBouncer in transaction mode (README "Running as a fleet"): a server connection
        # belongs to a client for one transaction only, so nothing may outlive a transaction.
        # Server-side cursors (QuerySet.iterator() outside a transaction) and prepared
        # statements would; Django's psycopg 3 defaults already bind parameters client-side
        # (no prepared statements), and these pin that. The pool stays: connections to
        # PgBouncer are cheap but not free, and its size bounds what one process asks for.
        ZEROMEM_PGBOUNCER = env.bool("ZEROMEM_PGBOUNCER", default=False)
        if ZEROMEM_PGBOUNCER:
            DATABASES["default"]["DISABLE_SERVER_SIDE_CURSORS"] = True
            DATABASES["default"]["OPTIONS"]["server_side_binding"] = False
            DATABASES["default"]["OPTIONS"]["prepare_threshold"] = None
        # The hot path's statements (zeromem/kernel/hotsql.py: a read's SELECT and audit INSERT,
        # a write's lock, UPDATE and version row, the rate counter) are prepared once per
        # connection: planning the live-memory SELECT against memories_memory's 16 indexes cost
        # PostgreSQL more than running it. Everything else stays client-side bound. Off behind
        # PgBouncer in transaction mode (a prepared statement belongs to one server connection;
        # Debian 12's PgBouncer 1.18 does not track them; >= 1.21 with max_prepared_statements
        # does: then set DB_PREPARED_STATEMENTS=true).
        if env.bool("DB_PREPARED_STATEMENTS", default=not ZEROMEM_PGBOUNCER):
            DATABASES["default"]["OPTIONS"]["prepare_threshold"] = 5  # psycopg's default; hotsql prepares at once
            # ... and planned once: PostgreSQL plans a prepared statement for its first five
            # executions with the values given (a "custom" plan) before settling on one plan.
            # Those five read the tenant's statistics, which say a tenant imported since the
            # last ANALYZE holds no rows: a point read then filtered the whole tenant on its
            # first index (20-30 ms at 100k memories, each new connection). The hot statements
            # are point lookups by key or id, which one plan serves whatever the values.
            # Only prepared statements (hotsql's) are affected.
            # Not behind PgBouncer, which refuses a startup `options` parameter unless listed
            # in its ignore_startup_parameters (set plan_cache_mode on the role there instead).
            if not ZEROMEM_PGBOUNCER:
                generic = "-c plan_cache_mode=force_generic_plan"
                options = DATABASES["default"]["OPTIONS"].get("options", "")
                DATABASES["default"]["OPTIONS"]["options"] = f"{options} {generic}".strip()
        # Read scaling (zeromem/kernel/replica.py): audit review, exports and the dashboard
        # may read from a streaming replica; everything else, and every write, the primary.
        if env.str("DATABASE_REPLICA_URL", default=""):
            replica = env.db("DATABASE_REPLICA_URL")
            for setting in ("CONN_MAX_AGE", "CONN_HEALTH_CHECKS", "DISABLE_SERVER_SIDE_CURSORS"):
                if setting in DATABASES["default"]:
                    replica[setting] = DATABASES["default"][setting]
            replica["OPTIONS"] = {**DATABASES["default"]["OPTIONS"], **replica.get("OPTIONS", {})}
            replica["OPTIONS"]["pool"] = {
                **DATABASES["default"]["OPTIONS"]["pool"],
                "min_size": env.int("DB_REPLICA_POOL_MIN_SIZE", default=1),
            }
            DATABASES["replica"] = replica
else:
    DATABASES = {
        "default": {
            "ENGINE": "django.db.backends.sqlite3",
            "NAME": VAR_DIR / "zeromem.sqlite3",
            # WAL lets the web server and the django-q2 workers read while one writes;
            # IMMEDIATE transactions avoid "database is locked" on read-then-write upgrades.
            "OPTIONS": {
                "transaction_mode": "IMMEDIATE",
                "timeout": 20,
                "init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;",
            },
        }
    }
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
# Where wrapped data keys live (memories.models.DataKey; README "Encryption at rest"). A
# separate database, backed up on its own short retention, is what lets a forget reach old
# backups of the main one; unset, they live in the main database.
if env.str("ZEROMEM_KEYSTORE_URL", default=""):
    DATABASES["keystore"] = env.db("ZEROMEM_KEYSTORE_URL")
ZEROMEM_KEYSTORE_DATABASE = "keystore" if "keystore" in DATABASES else "default"
# Reads go to the replica alias only inside zeromem.kernel.replica.replica_reads(); data keys
# go to the key store first (memories.routers.KeystoreRouter answers only for DataKey).
DATABASE_ROUTERS = ["memories.routers.KeystoreRouter", "zeromem.kernel.replica.ReplicaRouter"]
ZEROMEM_PGBOUNCER = globals().get("ZEROMEM_PGBOUNCER", False)

# --- Cache (rate limits do not live here: audit/limits.py counts them exactly) -----------
if env.str("REDIS_URL", default=""):
    CACHES = {
        "default": {
            "BACKEND": "django.core.cache.backends.redis.RedisCache",
            "LOCATION": env.str("REDIS_URL"),
        }
    }
elif DATABASES["default"]["ENGINE"] == "django.db.backends.postgresql":
    CACHES = {
        "default": {
            # Shared by every instance of a fleet without Redis (a local file cache would be
            # one per machine). Only django-q2's cluster statistics (qinfo, qmonitor) use it;
            # the table is created by memories' migration 0012.
            "BACKEND": "django.core.cache.backends.db.DatabaseCache",
            "LOCATION": "zeromem_cache",
        }
    }
else:
    CACHES = {
        "default": {
            # Embedded (SQLite): one machine, shared across its processes with no service.
            "BACKEND": "django.core.cache.backends.filebased.FileBasedCache",
            "LOCATION": str(VAR_DIR / "cache"),
        }
    }

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.UserAttributeSimilarityValidator"},
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
    {"NAME": "django.contrib.auth.password_validation.NumericPasswordValidator"},
]

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True

STATIC_URL = "static/"
STATIC_ROOT = VAR_DIR / "static"
STATIC_ROOT.mkdir(exist_ok=True)
STORAGES = {
    "default": {"BACKEND": "django.core.files.storage.FileSystemStorage"},
    "staticfiles": {
        "BACKEND": "servestatic.storage.CompressedStaticFilesStorage"
        if not DEBUG
        else "django.contrib.staticfiles.storage.StaticFilesStorage"
    },
}
SERVESTATIC_USE_FINDERS = DEBUG

# --- Security (production values make `manage.py check --deploy` silent) ----------------
if not DEVELOPMENT:
    SECURE_SSL_REDIRECT = env.bool("SECURE_SSL_REDIRECT", default=True)
    SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")
    SECURE_HSTS_SECONDS = env.int("SECURE_HSTS_SECONDS", default=31536000)
    SECURE_HSTS_INCLUDE_SUBDOMAINS = True
    SECURE_HSTS_PRELOAD = env.bool("SECURE_HSTS_PRELOAD", default=True)
    SESSION_COOKIE_SECURE = True
    CSRF_COOKIE_SECURE = True
    # Probes and the load balancer speak plain HTTP to /healthz.
    SECURE_REDIRECT_EXEMPT = [r"^healthz$"]
SECURE_CONTENT_TYPE_NOSNIFF = True
X_FRAME_OPTIONS = "DENY"

# Request bodies: the JSON value cap is enforced by the service; this is the transport cap
# (a 50-call batch of maximal values still fits). Larger bodies get 413.
ZEROMEM_MAX_BODY_BYTES = env.int("ZEROMEM_MAX_BODY_BYTES", default=1024 * 1024)
DATA_UPLOAD_MAX_MEMORY_SIZE = ZEROMEM_MAX_BODY_BYTES
# A web process reads each body up to the cap before the request takes a thread (README
# "Serving", zeromem/kit/read_ahead.py): those over 64 KiB and chunked ones within this many bytes
# at once, one caller's within its share (past either 503 body_budget, Retry-After); each
# message within the timeout, and the whole body within the timeout plus a second per
# ZEROMEM_BODY_READ_MIN_BYTES_PER_SECOND bytes received (408).
ZEROMEM_BODY_READ_AHEAD_BYTES = env.int("ZEROMEM_BODY_READ_AHEAD_BYTES", default=64 * 1024 * 1024)
ZEROMEM_BODY_READ_AHEAD_PER_CALLER_BYTES = env.int(
    "ZEROMEM_BODY_READ_AHEAD_PER_CALLER_BYTES",
    default=min(ZEROMEM_BODY_READ_AHEAD_BYTES, max(ZEROMEM_BODY_READ_AHEAD_BYTES // 4, ZEROMEM_MAX_BODY_BYTES)),
)
ZEROMEM_BODY_READ_TIMEOUT_SECONDS = env.float("ZEROMEM_BODY_READ_TIMEOUT_SECONDS", default=30.0)
ZEROMEM_BODY_READ_MIN_BYTES_PER_SECOND = env.int("ZEROMEM_BODY_READ_MIN_BYTES_PER_SECOND", default=8 * 1024)

# --- ZeroMem ---------------------------------------------------------------------------
# Default and hard cap of a memory value's serialized size; tenants may lower or raise the
# default up to the hard cap.
ZEROMEM_VALUE_MAX_BYTES = env.int("ZEROMEM_VALUE_MAX_BYTES", default=16 * 1024)
ZEROMEM_VALUE_HARD_CAP_BYTES = env.int("ZEROMEM_VALUE_HARD_CAP_BYTES", default=256 * 1024)
# Arrays and objects one value may hold, at any depth: what PostgreSQL's jsonb parse of a
# write costs grows with them (~0.65 KB each for {}); a 16 KiB value holds at most 5,461.
ZEROMEM_VALUE_MAX_CONTAINERS = env.int("ZEROMEM_VALUE_MAX_CONTAINERS", default=10_000)
# One search's statements stop after this long (503 search_timeout, Retry-After); README "Search".
ZEROMEM_SEARCH_TIMEOUT_MS = env.int("ZEROMEM_SEARCH_TIMEOUT_MS", default=80)
# Each statement of the admin memory list's search (q: its capped count, its page) stops after
# this long; the page then lists nothing and asks to narrow the search (README "Admin console").
ZEROMEM_ADMIN_SEARCH_TIMEOUT_MS = env.int("ZEROMEM_ADMIN_SEARCH_TIMEOUT_MS", default=1000)
# A page of GET /api/v1/memories filtered by tag stops after this long (503 list_timeout).
ZEROMEM_MEMORY_LIST_TIMEOUT_MS = env.int("ZEROMEM_MEMORY_LIST_TIMEOUT_MS", default=2000)
# A REST page of whole values (GET /api/v1/memories, a memory's history, the LangGraph
# store's search) stops before its values pass this many bytes of JSON (at least one item a
# page); next_cursor (LangGraph: offset + items) continues after its last item. README "Pages".
ZEROMEM_PAGE_VALUES_MAX_BYTES = env.int("ZEROMEM_PAGE_VALUES_MAX_BYTES", default=4 * 1024 * 1024)
# The search tier (memories/search/tier.py, README "Search tier"): the Unix sockets of the
# processes that rank searches for the web processes (set by `python3 -m zeromem serve`;
# empty: each web process ranks its own), how long a web process waits for a ranking before
# answering 503 search_timeout, and how many rankings one tier process runs at once.
ZEROMEM_SEARCH_TIER = env.list("ZEROMEM_SEARCH_TIER", default=[])
ZEROMEM_SEARCH_TIER_WAIT_MS = env.int("ZEROMEM_SEARCH_TIER_WAIT_MS", default=2000)
ZEROMEM_SEARCH_TIER_CONCURRENCY = env.int("ZEROMEM_SEARCH_TIER_CONCURRENCY", default=DEFAULT_SEARCH_TIER_CONCURRENCY)
# Of those, how many at once for one tenant: 1 — a tenant's searches take their turns in each
# search process (one ranking costs ~10 ms, and the search budget admits ~10 a second), and
# the other turns stay free for other tenants. README "Search tier".
ZEROMEM_SEARCH_TIER_TENANT_CONCURRENCY = env.int("ZEROMEM_SEARCH_TIER_TENANT_CONCURRENCY", default=1)
# LangGraph store routes (/api/v1/langgraph): the key prefix its items live under, and how
# many memories a search with a filter or a namespace listing reads at most.
ZEROMEM_LANGGRAPH_PREFIX = env.str("ZEROMEM_LANGGRAPH_PREFIX", default="lg")
ZEROMEM_LANGGRAPH_SCAN_MAX = env.int("ZEROMEM_LANGGRAPH_SCAN_MAX", default=10000)
# Tokens returned per tenant and day (memories/services/usage.py): how often a process writes
# its running totals (seconds; 0 = on every tool response).
ZEROMEM_USAGE_FLUSH_SECONDS = env.float("ZEROMEM_USAGE_FLUSH_SECONDS", default=10.0)
ZEROMEM_TRASH_RETENTION_DAYS = env.int("ZEROMEM_TRASH_RETENTION_DAYS", default=30)
# The admin dashboard's memory figures are at most this old for a tenant with activity.
ZEROMEM_DASHBOARD_STATS_MINUTES = env.int("ZEROMEM_DASHBOARD_STATS_MINUTES", default=10)
# Its JSON size of live memories (a read of every live row) is recounted with every count for
# a tenant of at most ZEROMEM_DASHBOARD_CHARS_EXACT_MEMORIES live memories, and at most every
# ZEROMEM_DASHBOARD_CHARS_HOURS above that (memories/services/dashboard_stats.py).
ZEROMEM_DASHBOARD_CHARS_HOURS = env.float("ZEROMEM_DASHBOARD_CHARS_HOURS", default=24.0)
ZEROMEM_DASHBOARD_CHARS_EXACT_MEMORIES = env.int("ZEROMEM_DASHBOARD_CHARS_EXACT_MEMORIES", default=50000)
# The TTL purge sleeps this × each batch's time after the batch (memories/services/retention.py).
ZEROMEM_PURGE_PAUSE_RATIO = env.float("ZEROMEM_PURGE_PAUSE_RATIO", default=0.0)
# The TTL purge erases at most this many memories per second (0: unpaced), so its WAL is an
# even stream rather than bursts that concurrent commits queue behind.
ZEROMEM_PURGE_MEMORIES_PER_SECOND = env.float("ZEROMEM_PURGE_MEMORIES_PER_SECOND", default=60000.0)
# wal_compression set locally by the purge's and forget's erasing transactions when the role may
# (auto: zstd, lz4 or pglz, the best this PostgreSQL has; off: leave the server's setting).
ZEROMEM_PURGE_WAL_COMPRESSION = env.str("ZEROMEM_PURGE_WAL_COMPRESSION", default="auto")
# A verified API key is reused for this long by the process that verified it, so a request
# costs no key lookup; a revocation reaches every other process within this bound (the
# process that revokes drops it at once). 0 turns the cache off. memories/services/key_cache.py
ZEROMEM_API_KEY_CACHE_SECONDS = env.float("ZEROMEM_API_KEY_CACHE_SECONDS", default=10.0)
# POST /api/v1/tools/call answered without Django's handler and DRF's dispatch when nothing
# about the request needs them (memories/api/lane.py, README "The hot path"); false: never.
ZEROMEM_TOOL_LANE = env.bool("ZEROMEM_TOOL_LANE", default=True)
# Rate limits (audit/limits.py): exact across processes, counted in Redis when REDIS_URL is
# set, else in the database. Each call of a batch counts.
ZEROMEM_REDIS_URL = env.str("REDIS_URL", default="")
ZEROMEM_RATE_LIMIT_PER_MINUTE = env.int("ZEROMEM_RATE_LIMIT_PER_MINUTE", default=6000)
# Expensive work (search, recall, export, batch) a tenant may run at once, across processes;
# a request past it waits this long for a slot, then gets 429 tenant_busy. A slot held
# longer than its lease (a crashed process) lapses.
ZEROMEM_TENANT_MAX_CONCURRENT = env.int("ZEROMEM_TENANT_MAX_CONCURRENT", default=4)
ZEROMEM_TENANT_BUSY_WAIT_SECONDS = env.float("ZEROMEM_TENANT_BUSY_WAIT_SECONDS", default=0.5)
# Search (and recall) CPU time a tenant may use, across processes (memories/services/
# search_budget.py): milliseconds of the request thread's CPU per second on average, and up
# to BURST_MS at once above that; past it a search is refused with 429 search_budget and
# Retry-After. A rate of 0 turns the budget off.
ZEROMEM_TENANT_SEARCH_CPU_MS_PER_SECOND = env.int("ZEROMEM_TENANT_SEARCH_CPU_MS_PER_SECOND", default=100)
ZEROMEM_TENANT_SEARCH_CPU_BURST_MS = env.int("ZEROMEM_TENANT_SEARCH_CPU_BURST_MS", default=300)
# Idempotency-Key: how long a first answer is replayed to retries (then purged), how long a
# concurrent duplicate waits for the first request to finish (then 409, Retry-After), and
# after how long an unfinished first request no longer holds the key: one lease after its
# process last renewed the claim (it does every third of the lease while the request runs).
ZEROMEM_IDEMPOTENCY_SECONDS = env.int("ZEROMEM_IDEMPOTENCY_SECONDS", default=24 * 3600)
ZEROMEM_IDEMPOTENCY_WAIT_SECONDS = env.float("ZEROMEM_IDEMPOTENCY_WAIT_SECONDS", default=10.0)
ZEROMEM_IDEMPOTENCY_LEASE_SECONDS = env.int("ZEROMEM_IDEMPOTENCY_LEASE_SECONDS", default=300)
ZEROMEM_TENANT_SLOT_LEASE_SECONDS = env.int("ZEROMEM_TENANT_SLOT_LEASE_SECONDS", default=60)
# A tenant slot is renewed by its process's heartbeat (audit/limits.py) for at most this long.
ZEROMEM_TENANT_SLOT_MAX_HOLD_SECONDS = env.int("ZEROMEM_TENANT_SLOT_MAX_HOLD_SECONDS", default=3600)
# Encryption at rest (README "Encryption at rest"): base64 32-byte master keys, comma
# separated; the first wraps new data keys, all of them unwrap. Never stored in the
# database. Development mode derives one from SECRET_KEY when unset; production refuses to
# start without it (zeromem.E010). Unwrapped data keys stay in a process this long.
ZEROMEM_MASTER_KEYS_EXPLICIT = bool(env.list("ZEROMEM_MASTER_KEYS", default=[]))
if ZEROMEM_MASTER_KEYS_EXPLICIT or not DEVELOPMENT:
    ZEROMEM_MASTER_KEYS = env.list("ZEROMEM_MASTER_KEYS", default=[])
else:
    from zeromem.kernel.crypto import dev_master_key

    ZEROMEM_MASTER_KEYS = [dev_master_key(SECRET_KEY)]
ZEROMEM_DATA_KEY_CACHE_SECONDS = env.float("ZEROMEM_DATA_KEY_CACHE_SECONDS", default=10.0)
# Failed authentications per minute, per client address and per key prefix, before 429.
ZEROMEM_AUTH_FAILURES_PER_MINUTE = env.int("ZEROMEM_AUTH_FAILURES_PER_MINUTE", default=30)
# Failed admin sign-ins per client address and username within the window, before the
# sign-in form answers 429 until the window ends (zeromem/kit/login_throttle.py).
ZEROMEM_ADMIN_LOGIN_FAILURES = env.int("ZEROMEM_ADMIN_LOGIN_FAILURES", default=5)
ZEROMEM_ADMIN_LOGIN_WINDOW_SECONDS = env.int("ZEROMEM_ADMIN_LOGIN_WINDOW_SECONDS", default=900)
# Number of reverse proxies in front of the app; the client IP is read from X-Forwarded-For
# only when this is set (as DRF's NUM_PROXIES).
ZEROMEM_NUM_PROXIES = env.int("ZEROMEM_NUM_PROXIES", default=0)
# Summarization (memories/services/summaries.py): the digest's size budget, and the
# sessions the schedule compacts once idle.
# Finished background jobs (summaries) are deleted this many days after they were created
# (the zeromem:jobs-purge schedule).
ZEROMEM_JOB_RETENTION_DAYS = env.int("ZEROMEM_JOB_RETENTION_DAYS", default=30)
ZEROMEM_SUMMARY_MAX_CHARS = env.int("ZEROMEM_SUMMARY_MAX_CHARS", default=2000)
ZEROMEM_SUMMARIZE_IDLE_PREFIXES = env.list("ZEROMEM_SUMMARIZE_IDLE_PREFIXES", default=["session:"])
ZEROMEM_SUMMARIZE_IDLE_MINUTES = env.int("ZEROMEM_SUMMARIZE_IDLE_MINUTES", default=60)
# Optional LLM summarizer: an OpenAI-compatible endpoint ({base}/chat/completions). Empty
# base URL: the deterministic digest, no LLM, zero tokens.
ZEROMEM_LLM_BASE_URL = env.str("ZEROMEM_LLM_BASE_URL", default="")
ZEROMEM_LLM_MODEL = env.str("ZEROMEM_LLM_MODEL", default="")
ZEROMEM_LLM_API_KEY = env.str("ZEROMEM_LLM_API_KEY", default="")
ZEROMEM_LLM_TIMEOUT_SECONDS = env.float("ZEROMEM_LLM_TIMEOUT_SECONDS", default=30.0)
# How many times a job (e.g. a forget request) is started before it is marked failed. Counted
# by the job itself: django-q2's max_attempts misses tasks of killed workers (issue #327).
ZEROMEM_JOB_MAX_ATTEMPTS = env.int("ZEROMEM_JOB_MAX_ATTEMPTS", default=5)
# manage.py migrate on PostgreSQL asks for table locks with this lock_timeout (seconds; 0: no
# limit): an ALTER behind a long transaction fails fast instead of queueing the table's
# requests behind it (memories/management/commands/migrate.py).
ZEROMEM_MIGRATION_LOCK_TIMEOUT = env.float("ZEROMEM_MIGRATION_LOCK_TIMEOUT", default=5.0)
# Jobs one tenant may have pending (queued or running) at once, per kind; past it an API key or
# an end user gets 429 too_many_jobs (memories/services/jobs.py). django-q2's queue is one FIFO
# line for every tenant: without a cap one key at its rate limit grew it without bound, and
# every other tenant's forget requests waited behind it.
ZEROMEM_TENANT_MAX_PENDING_JOBS = env.int("ZEROMEM_TENANT_MAX_PENDING_JOBS", default=20)
ZEROMEM_TENANT_MAX_PENDING_FORGETS = env.int("ZEROMEM_TENANT_MAX_PENDING_FORGETS", default=100)
# ... and one end user (the portal) of those, so one cannot fill the tenant's and lock out the rest.
ZEROMEM_END_USER_MAX_PENDING_FORGETS = env.int("ZEROMEM_END_USER_MAX_PENDING_FORGETS", default=10)
# Audit log (audit/chain.py). The key of its hashes must live outside the database: whoever
# holds it could forge a chain. Derived from SECRET_KEY unless set, so set it explicitly in
# production and keep it when SECRET_KEY rotates (a new key cannot verify old events).
ZEROMEM_AUDIT_KEY = env.str(
    "ZEROMEM_AUDIT_KEY",
    default=hashlib.sha256(f"zeromem-audit-key:{SECRET_KEY}".encode()).hexdigest(),
)
# `check --deploy` warns when it is derived (zeromem/kernel/checks.py).
ZEROMEM_AUDIT_KEY_EXPLICIT = bool(env.str("ZEROMEM_AUDIT_KEY", default=""))
# Audit events older than this are purged (whole sealed batches, after a checkpoint);
# tenants may set their own (Tenant.audit_retention_days).
ZEROMEM_AUDIT_RETENTION_DAYS = env.int("ZEROMEM_AUDIT_RETENTION_DAYS", default=400)
# Events per seal: the sealing job's batch (one transaction, one seal row).
ZEROMEM_AUDIT_SEAL_BATCH = env.int("ZEROMEM_AUDIT_SEAL_BATCH", default=5000)
# PostgreSQL: how long a sealing run waits for the transactions that may still commit an event
# below its horizon (audit.services._settled_horizon); past it, that run seals nothing new.
ZEROMEM_AUDIT_SEAL_WAIT = env.float("ZEROMEM_AUDIT_SEAL_WAIT", default=5.0)
# PostgreSQL: the audit event of an operation that changed nothing (a read, a search, a
# refusal: a transaction of its own) commits without waiting for the WAL flush. Off: every event
# is flushed before its answer leaves. On: a crash of PostgreSQL itself (not of ZeroMem) can lose
# the last ~0.6 s (3 × wal_writer_delay) of such events; writes and their events stay flushed
# (README "Audit log": what it saves, measured).
ZEROMEM_AUDIT_READ_EVENTS_ASYNC = env.bool("ZEROMEM_AUDIT_READ_EVENTS_ASYNC", default=False)
# PostgreSQL: a write sends its UPDATE, its version INSERT and its audit INSERT as one statement
# (data-modifying WITH), one round trip instead of three (zeromem/kernel/hotsql.py holding()).
# Off: one statement each, as before (an escape hatch; README "The hot path").
ZEROMEM_WRITE_ONE_STATEMENT = env.bool("ZEROMEM_WRITE_ONE_STATEMENT", default=True)
# A write over a live memory outside any transaction: read without a lock, then its UPDATE
# (while the row is as read), version row and event as one statement (README "The hot path").
# Off: every write takes the row lock first, in a transaction of its own.
ZEROMEM_WRITE_WITHOUT_LOCK = env.bool("ZEROMEM_WRITE_WITHOUT_LOCK", default=True)
# A read of a key this process read or wrote lately sends its audit event with its SELECT, as
# one statement, written only if the row is still as last seen (README "The hot path").
ZEROMEM_READ_ONE_STATEMENT = env.bool("ZEROMEM_READ_ONE_STATEMENT", default=True)
# On the tool-call lane, a write over a key this process read or wrote lately sends the rate
# counter and its statement together, pipelined (one round trip, no SELECT), the statement
# writing only if the row is still as last seen (README "The hot path"). Off: read, then write.
ZEROMEM_WRITE_PIPED = env.bool("ZEROMEM_WRITE_PIPED", default=True)
# End-user portal (memories/portal/): how long a portal link stays valid before its first open, and
# how long the page stays open after it. ZEROMEM_PUBLIC_URL (e.g. https://memory.example.com)
# is the origin links are built with; empty: the origin the API request came to.
ZEROMEM_PORTAL_LINK_SECONDS = env.int("ZEROMEM_PORTAL_LINK_SECONDS", default=3600)
ZEROMEM_PORTAL_SESSION_SECONDS = env.int("ZEROMEM_PORTAL_SESSION_SECONDS", default=1800)
# Pages a portal session may load per minute (each writes an audit event); past it a 429 page.
ZEROMEM_PORTAL_PAGES_PER_MINUTE = env.int("ZEROMEM_PORTAL_PAGES_PER_MINUTE", default=60)
ZEROMEM_PUBLIC_URL = env.str("ZEROMEM_PUBLIC_URL", default="").rstrip("/")
# Semantic search (memories/search/embeddings.py, semantic.py). "off": words only, the
# model is never loaded. LOAD_WAIT: a search waits for the model to load (about 3 s) instead
# of searching by words until a background load finishes (tests and evaluations set it).
ZEROMEM_EMBEDDINGS = env.str("ZEROMEM_EMBEDDINGS", default="on")
# numpy's BLAS on one thread per process, set before anything imports numpy: requests already
# run in parallel, and a multi-threaded BLAS spinning on a busy machine turned a 2 ms question
# embedding into 60–300 ms (measured). An operator's own value wins.
for _blas_threads in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_blas_threads, "1")
ZEROMEM_EMBEDDINGS_LOAD_WAIT = env.bool("ZEROMEM_EMBEDDINGS_LOAD_WAIT", default=False)
# The newest embeddings per tenant scored exactly on every search (the cost cap), the fusion
# weight of meaning against words, and the per-process cache of those vectors.
ZEROMEM_SEMANTIC_CANDIDATES = env.int("ZEROMEM_SEMANTIC_CANDIDATES", default=20000)
ZEROMEM_SEMANTIC_WEIGHT = env.float("ZEROMEM_SEMANTIC_WEIGHT", default=0.4)
# "weighted" (score fusion, the default) or "rrf" (reciprocal rank fusion), for comparison.
ZEROMEM_SEMANTIC_FUSION = env.str("ZEROMEM_SEMANTIC_FUSION", default="weighted")
ZEROMEM_SEMANTIC_CACHE_SECONDS = env.int("ZEROMEM_SEMANTIC_CACHE_SECONDS", default=300)
ZEROMEM_SEMANTIC_CACHE_MB = env.int("ZEROMEM_SEMANTIC_CACHE_MB", default=256)
# How often a search checks for embeddings newer than its cached matrix (one index probe).
ZEROMEM_SEMANTIC_PROBE_SECONDS = env.float("ZEROMEM_SEMANTIC_PROBE_SECONDS", default=1.0)

REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": ["memories.api.auth.ApiKeyAuthentication"],
    "DEFAULT_PERMISSION_CLASSES": ["memories.api.auth.HasApiKey"],
    "DEFAULT_THROTTLE_CLASSES": ["memories.api.auth.ApiKeyRateThrottle"],
    "DEFAULT_RENDERER_CLASSES": ["zeromem.renderers.CompactJSONRenderer"],
    "DEFAULT_PARSER_CLASSES": ["zeromem.kit.parsers.JSONParser"],
    "DEFAULT_CONTENT_NEGOTIATION_CLASS": "zeromem.kit.negotiation.ContentNegotiation",
    "DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema",
    "EXCEPTION_HANDLER": "zeromem.kit.api.exception_handler",
    "UNAUTHENTICATED_USER": None,
    "NUM_PROXIES": ZEROMEM_NUM_PROXIES or None,
    # `?format=` belongs to GET /api/v1/tools (openai|anthropic|mcp), not to renderer choice.
    "URL_FORMAT_OVERRIDE": None,
}

SPECTACULAR_SETTINGS = {
    "TITLE": "ZeroMem API",
    "DESCRIPTION": "Memory for LLM agents through tool calls: namespaced keys, TTL, search, audit.",
    "VERSION": "1.0.0",
    "SERVE_INCLUDE_SCHEMA": False,
    # The schema and docs hold no tenant data: readable without a key.
    "SERVE_PERMISSIONS": ["rest_framework.permissions.AllowAny"],
    "SERVE_AUTHENTICATION": [],
    "SWAGGER_UI_DIST": "SIDECAR",
    "SWAGGER_UI_FAVICON_HREF": "SIDECAR",
    "REDOC_DIST": "SIDECAR",
    "COMPONENT_SPLIT_REQUEST": True,
    "SCHEMA_PATH_PREFIX": r"/api/v1",
    # Several components have a "status" field with different choices: name them.
    "ENUM_NAME_OVERRIDES": {"JobStatusEnum": "memories.models.Job.Status"},
    "POSTPROCESSING_HOOKS": [
        "drf_spectacular.hooks.postprocess_schema_enums",  # the default
        "zeromem.kit.api.schema_closed_request_bodies",
        "zeromem.kit.api.schema_idempotency_header",
    ],
}

# --- django-q2 -------------------------------------------------------------------------
Q_CLUSTER = {
    "name": "zeromem",
    "workers": env.int("Q_WORKERS", default=2),
    "timeout": env.int("Q_TIMEOUT", default=300),
    # retry must exceed timeout, or a long task is handed to a second worker while running.
    "retry": env.int("Q_RETRY", default=360),
    "max_attempts": env.int("Q_MAX_ATTEMPTS", default=5),
    "catch_up": False,
    "orm": "default",
}
if env.str("REDIS_URL", default=""):
    Q_CLUSTER.pop("orm")
    Q_CLUSTER["redis"] = env.str("REDIS_URL")

# Numbers at their worst values stop the process here, naming the variable, instead of a
# silently wrong deployment: ZEROMEM_AUDIT_RETENTION_DAYS=0 had the daily purge delete every
# sealed audit event, ZEROMEM_SEARCH_TIMEOUT_MS=0 turned the searches' statement_timeout off,
# a negative one failed every search with a 500. The least value each setting takes (0 where
# the README gives 0 a meaning, 1 where 0 refuses or erases everything).
_LEAST = {
    "ZEROMEM_MAX_BODY_BYTES": 1,
    "ZEROMEM_BODY_READ_AHEAD_BYTES": 1,
    "ZEROMEM_BODY_READ_AHEAD_PER_CALLER_BYTES": 1,
    "ZEROMEM_BODY_READ_TIMEOUT_SECONDS": 0.001,
    "ZEROMEM_BODY_READ_MIN_BYTES_PER_SECOND": 1,
    "ZEROMEM_VALUE_MAX_BYTES": 1,
    "ZEROMEM_VALUE_HARD_CAP_BYTES": 1,
    "ZEROMEM_VALUE_MAX_CONTAINERS": 1,
    "ZEROMEM_SEARCH_TIMEOUT_MS": 1,
    "ZEROMEM_MEMORY_LIST_TIMEOUT_MS": 1,
    "ZEROMEM_ADMIN_SEARCH_TIMEOUT_MS": 1,
    "ZEROMEM_PAGE_VALUES_MAX_BYTES": 1,
    "ZEROMEM_SEARCH_TIER_WAIT_MS": 1,
    "ZEROMEM_SEARCH_TIER_CONCURRENCY": 1,
    "ZEROMEM_SEARCH_TIER_TENANT_CONCURRENCY": 1,
    "ZEROMEM_LANGGRAPH_SCAN_MAX": 1,
    "ZEROMEM_USAGE_FLUSH_SECONDS": 0,
    "ZEROMEM_TRASH_RETENTION_DAYS": 0,
    "ZEROMEM_DASHBOARD_STATS_MINUTES": 0,
    "ZEROMEM_DASHBOARD_CHARS_HOURS": 0,
    "ZEROMEM_DASHBOARD_CHARS_EXACT_MEMORIES": 0,
    "ZEROMEM_PURGE_PAUSE_RATIO": 0,
    "ZEROMEM_PURGE_MEMORIES_PER_SECOND": 0,
    "ZEROMEM_API_KEY_CACHE_SECONDS": 0,
    "ZEROMEM_RATE_LIMIT_PER_MINUTE": 1,
    "ZEROMEM_TENANT_MAX_CONCURRENT": 1,
    "ZEROMEM_TENANT_BUSY_WAIT_SECONDS": 0,
    "ZEROMEM_TENANT_SEARCH_CPU_MS_PER_SECOND": 0,
    "ZEROMEM_TENANT_SEARCH_CPU_BURST_MS": 0,
    "ZEROMEM_IDEMPOTENCY_SECONDS": 1,
    "ZEROMEM_IDEMPOTENCY_WAIT_SECONDS": 0,
    "ZEROMEM_IDEMPOTENCY_LEASE_SECONDS": 1,
    "ZEROMEM_TENANT_SLOT_LEASE_SECONDS": 1,
    "ZEROMEM_TENANT_SLOT_MAX_HOLD_SECONDS": 1,
    "ZEROMEM_DATA_KEY_CACHE_SECONDS": 0,
    "ZEROMEM_AUTH_FAILURES_PER_MINUTE": 1,
    "ZEROMEM_ADMIN_LOGIN_FAILURES": 1,
    "ZEROMEM_ADMIN_LOGIN_WINDOW_SECONDS": 1,
    "ZEROMEM_NUM_PROXIES": 0,
    "ZEROMEM_JOB_RETENTION_DAYS": 0,
    "ZEROMEM_SUMMARY_MAX_CHARS": 1,
    "ZEROMEM_SUMMARIZE_IDLE_MINUTES": 0,
    "ZEROMEM_LLM_TIMEOUT_SECONDS": 0.001,
    "ZEROMEM_JOB_MAX_ATTEMPTS": 1,
    "ZEROMEM_MIGRATION_LOCK_TIMEOUT": 0,
    "ZEROMEM_TENANT_MAX_PENDING_JOBS": 1,
    "ZEROMEM_TENANT_MAX_PENDING_FORGETS": 1,
    "ZEROMEM_END_USER_MAX_PENDING_FORGETS": 1,
    "ZEROMEM_AUDIT_RETENTION_DAYS": 1,
    "ZEROMEM_AUDIT_SEAL_BATCH": 1,
    "ZEROMEM_AUDIT_SEAL_WAIT": 0,
    "ZEROMEM_PORTAL_LINK_SECONDS": 1,
    "ZEROMEM_PORTAL_SESSION_SECONDS": 1,
    "ZEROMEM_PORTAL_PAGES_PER_MINUTE": 1,
    "ZEROMEM_SEMANTIC_CANDIDATES": 1,
    "ZEROMEM_SEMANTIC_WEIGHT": 0,
    "ZEROMEM_SEMANTIC_CACHE_SECONDS": 0,
    "ZEROMEM_SEMANTIC_CACHE_MB": 0,
    "ZEROMEM_SEMANTIC_PROBE_SECONDS": 0,
}
_numbers = {name: globals()[name] for name in _LEAST}
_numbers |= {"Q_WORKERS": Q_CLUSTER["workers"], "Q_TIMEOUT": Q_CLUSTER["timeout"], "Q_RETRY": Q_CLUSTER["retry"]}
_numbers["Q_MAX_ATTEMPTS"] = Q_CLUSTER["max_attempts"]
_LEAST |= {"Q_WORKERS": 1, "Q_TIMEOUT": 1, "Q_RETRY": 1, "Q_MAX_ATTEMPTS": 0}
ZEROMEM_DB_POOL_CHECK_FRESH_SECONDS = env.float("DB_POOL_CHECK_FRESH_SECONDS", default=0.0)
# A request whose first statement is a hot-path read checks its connection out without the
# pool's empty query: the read is the check, sent again on a checked connection if it finds
# the connection dead (zeromem/dbpool.py).
ZEROMEM_DB_POOL_READ_CHECKS = env.bool("DB_POOL_READ_CHECKS", default=True)
if "pool" in DATABASES["default"].get("OPTIONS", {}):
    _pool = DATABASES["default"]["OPTIONS"]["pool"]
    _numbers["DB_POOL_CHECK_FRESH_SECONDS"] = ZEROMEM_DB_POOL_CHECK_FRESH_SECONDS
    _LEAST["DB_POOL_CHECK_FRESH_SECONDS"] = 0
    _numbers |= {"DB_POOL_MIN_SIZE": _pool["min_size"], "DB_POOL_MAX_SIZE": _pool["max_size"]}
    _numbers |= {"DB_POOL_TIMEOUT": _pool["timeout"], "DB_POOL_RECONNECT_TIMEOUT": _pool["reconnect_timeout"]}
    _numbers["DB_CONNECT_TIMEOUT"] = DATABASES["default"]["OPTIONS"]["connect_timeout"]
    _LEAST |= {"DB_POOL_MIN_SIZE": 0, "DB_POOL_MAX_SIZE": 1, "DB_POOL_TIMEOUT": 0.001, "DB_POOL_RECONNECT_TIMEOUT": 0}
    _LEAST["DB_CONNECT_TIMEOUT"] = 1
    if "replica" in DATABASES:
        _numbers["DB_REPLICA_POOL_MIN_SIZE"] = DATABASES["replica"]["OPTIONS"]["pool"]["min_size"]
        _LEAST["DB_REPLICA_POOL_MIN_SIZE"] = 0
for _name, _value in _numbers.items():
    if not math.isfinite(_value) or _value < _LEAST[_name]:
        raise ImproperlyConfigured(f"{_name} must be a number of at least {_LEAST[_name]}, not {_value!r}")
if ZEROMEM_BODY_READ_AHEAD_BYTES < ZEROMEM_MAX_BODY_BYTES:  # a body at the cap would never be read
    raise ImproperlyConfigured(
        f"ZEROMEM_BODY_READ_AHEAD_BYTES ({ZEROMEM_BODY_READ_AHEAD_BYTES}) must be at least"
        f" ZEROMEM_MAX_BODY_BYTES ({ZEROMEM_MAX_BODY_BYTES})"
    )
if not ZEROMEM_MAX_BODY_BYTES <= ZEROMEM_BODY_READ_AHEAD_PER_CALLER_BYTES <= ZEROMEM_BODY_READ_AHEAD_BYTES:
    raise ImproperlyConfigured(  # a caller's body at the cap would never be read; over the budget: no share
        f"ZEROMEM_BODY_READ_AHEAD_PER_CALLER_BYTES ({ZEROMEM_BODY_READ_AHEAD_PER_CALLER_BYTES}) must be from"
        f" ZEROMEM_MAX_BODY_BYTES ({ZEROMEM_MAX_BODY_BYTES}) to ZEROMEM_BODY_READ_AHEAD_BYTES"
        f" ({ZEROMEM_BODY_READ_AHEAD_BYTES})"
    )
# Upper bounds where a large value breaks a promise the README makes: a revoked API key and a
# shredded data key (a forget) keep working in other processes for up to the cache time.
_MOST = {"ZEROMEM_API_KEY_CACHE_SECONDS": 300, "ZEROMEM_DATA_KEY_CACHE_SECONDS": 300}
for _name, _most in _MOST.items():
    if globals()[_name] > _most:
        raise ImproperlyConfigured(f"{_name} must be at most {_most} (seconds), not {globals()[_name]!r}")
if ZEROMEM_SEMANTIC_WEIGHT > 1:
    raise ImproperlyConfigured(f"ZEROMEM_SEMANTIC_WEIGHT must be from 0 to 1, not {ZEROMEM_SEMANTIC_WEIGHT!r}")
if ZEROMEM_VALUE_HARD_CAP_BYTES < ZEROMEM_VALUE_MAX_BYTES:
    raise ImproperlyConfigured(
        f"ZEROMEM_VALUE_HARD_CAP_BYTES ({ZEROMEM_VALUE_HARD_CAP_BYTES}) is below ZEROMEM_VALUE_MAX_BYTES "
        f"({ZEROMEM_VALUE_MAX_BYTES})"
    )
# Words from a fixed set: a typo (ZEROMEM_EMBEDDINGS=of) was read as the other choice.
for _name, _value, _choices in (
    ("ZEROMEM_EMBEDDINGS", ZEROMEM_EMBEDDINGS, ("on", "off")),
    ("ZEROMEM_SEMANTIC_FUSION", ZEROMEM_SEMANTIC_FUSION, ("weighted", "rrf")),
    (
        "ZEROMEM_PURGE_WAL_COMPRESSION",
        ZEROMEM_PURGE_WAL_COMPRESSION.lower(),
        ("auto", "off", "", "on", "pglz", "lz4", "zstd"),
    ),
):
    if _value not in _choices:
        raise ImproperlyConfigured(f"{_name} must be one of {', '.join(c for c in _choices if c)}, not {_value!r}")
if Q_CLUSTER["retry"] <= Q_CLUSTER["timeout"]:
    # Otherwise django-q2 hands a task still running to a second worker.
    raise ImproperlyConfigured(f"Q_RETRY ({Q_CLUSTER['retry']}) must exceed Q_TIMEOUT ({Q_CLUSTER['timeout']})")
if ZEROMEM_LLM_TIMEOUT_SECONDS * 2 > Q_CLUSTER["timeout"]:
    # A summarize attempt waits for one LLM answer and then writes: past half of Q_TIMEOUT a slow
    # endpoint got the worker killed mid-attempt (counted, retried, the same wait again) instead
    # of the job failing cleanly with the LLM's error.
    raise ImproperlyConfigured(
        f"ZEROMEM_LLM_TIMEOUT_SECONDS ({ZEROMEM_LLM_TIMEOUT_SECONDS:g}) must be at most half of Q_TIMEOUT "
        f"({Q_CLUSTER['timeout']})"
    )
for _name in ("DB_POOL_MAX_SIZE",) if "DB_POOL_MAX_SIZE" in _numbers else ():
    for _least in ("DB_POOL_MIN_SIZE", "DB_REPLICA_POOL_MIN_SIZE"):
        if _least in _numbers and _numbers[_name] < _numbers[_least]:
            raise ImproperlyConfigured(f"{_name} ({_numbers[_name]}) is below {_least} ({_numbers[_least]})")

# Portal link tokens never reach a log line (zeromem/kit/logs.py): the filter sits on the
# loggers that write request paths (Django's 4xx/5xx, CSRF and runserver lines; granian's access log:
# zeromem/asgi.py, zeromem/wsgi.py) and on the console handler, for whatever propagates to it.
_PORTAL_TOKENS = {"()": "zeromem.kit.logs.RedactPortalTokens"}
# OpenTelemetry traces (zeromem/kernel/tracing.py, README "Traces"): off unless ZEROMEM_TRACING
# is true; off, nothing of OpenTelemetry's SDK is imported. The standard OTEL_* settings say
# where to and how much: the OTLP/HTTP endpoint (the SDK appends /v1/traces to the generic
# one; the traces one is used as it is), the service's name and the sampler.
OTEL_TRACES_EXPORTER = env.str("OTEL_TRACES_EXPORTER", default="otlp")
# The standard ways to say "no traces" win over the switch.
ZEROMEM_TRACING = (
    env.bool("ZEROMEM_TRACING", default=False)
    and OTEL_TRACES_EXPORTER != "none"
    and not env.bool("OTEL_SDK_DISABLED", default=False)
)
OTEL_EXPORTER_OTLP_ENDPOINT = env.str("OTEL_EXPORTER_OTLP_ENDPOINT", default="")
OTEL_EXPORTER_OTLP_TRACES_ENDPOINT = env.str("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", default="")
OTEL_EXPORTER_OTLP_PROTOCOL = env.str(
    "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", default=env.str("OTEL_EXPORTER_OTLP_PROTOCOL", default="http/protobuf")
)
OTEL_SERVICE_NAME = env.str("OTEL_SERVICE_NAME", default="zeromem")
OTEL_TRACES_SAMPLER = env.str("OTEL_TRACES_SAMPLER", default="parentbased_always_on")
OTEL_TRACES_SAMPLER_ARG = env.str("OTEL_TRACES_SAMPLER_ARG", default="")
if ZEROMEM_TRACING:
    from zeromem.kernel.tracing import SAMPLERS  # noqa: E402  (imports nothing of OpenTelemetry)

    if OTEL_TRACES_EXPORTER not in ("otlp", "console"):
        raise ImproperlyConfigured(f"OTEL_TRACES_EXPORTER must be otlp or console, not {OTEL_TRACES_EXPORTER!r}")
    if OTEL_TRACES_EXPORTER == "otlp" and OTEL_EXPORTER_OTLP_PROTOCOL != "http/protobuf":
        raise ImproperlyConfigured(
            f"OTEL_EXPORTER_OTLP_PROTOCOL must be http/protobuf (the exporter installed), "
            f"not {OTEL_EXPORTER_OTLP_PROTOCOL!r}"
        )
    if OTEL_TRACES_SAMPLER not in SAMPLERS:
        raise ImproperlyConfigured(f"OTEL_TRACES_SAMPLER must be one of {', '.join(SAMPLERS)}")
    try:
        if OTEL_TRACES_SAMPLER_ARG and not 0.0 <= float(OTEL_TRACES_SAMPLER_ARG) <= 1.0:
            raise ValueError
    except ValueError:
        raise ImproperlyConfigured("OTEL_TRACES_SAMPLER_ARG must be a ratio from 0 to 1") from None

# "json": one JSON object per line with the request id (zeromem/kit/logs.py), and the trace id
# when tracing; "text": plain.
ZEROMEM_LOG_FORMAT = env.str("ZEROMEM_LOG_FORMAT", default="text")
if ZEROMEM_LOG_FORMAT not in ("text", "json"):
    raise ImproperlyConfigured(f"ZEROMEM_LOG_FORMAT must be one of text, json, not {ZEROMEM_LOG_FORMAT!r}")
LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "filters": {"request_id": {"()": "zeromem.kit.logs.RequestIdFilter"}, "portal_tokens": _PORTAL_TOKENS},
    "formatters": {
        "text": {"format": "%(levelname)s %(name)s [%(request_id)s] %(message)s"},
        "json": {
            "()": "pythonjsonlogger.json.JsonFormatter",
            "fmt": "%(asctime)s %(levelname)s %(name)s %(message)s %(request_id)s"
            + (" %(trace_id)s" if ZEROMEM_TRACING else ""),
            "rename_fields": {"asctime": "time", "levelname": "level", "name": "logger"},
        },
    },
    "handlers": {
        "console": {
            "class": "logging.StreamHandler",
            "filters": ["request_id", "portal_tokens"],
            "formatter": "json" if ZEROMEM_LOG_FORMAT == "json" else "text",
        }
    },
    "root": {"handlers": ["console"], "level": env.str("LOG_LEVEL", default="INFO")},
    "loggers": {
        "django.db.backends": {"level": "WARNING"},
        "django.request": {"filters": ["portal_tokens"]},
        "django.server": {"filters": ["portal_tokens"]},
        # "Forbidden (CSRF cookie not set.): /portal/open/<token>": the landing page's button
        # refused by the CSRF check, its link still unused.
        "django.security.csrf": {"filters": ["portal_tokens"]},
        # The MCP SDK logs every stateless request's start and end at INFO ("Terminating session").
        "mcp": {"level": env.str("MCP_LOG_LEVEL", default="WARNING")},
    },
}
