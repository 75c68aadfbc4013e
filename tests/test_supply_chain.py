"""The CI supply-chain step (.ci/supply_chain.py) fails on a real finding, and only
reports — without failing — when no vulnerability data can be reached."""

import importlib.util
import json

from django.conf import settings

_spec = importlib.util.spec_from_file_location("supply_chain", settings.BASE_DIR / ".ci" / "supply_chain.py")
supply_chain = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(supply_chain)


def _report(*deps):
    return json.dumps({"dependencies": list(deps), "fixes": []})


def test_a_known_vulnerability_is_a_failure_naming_package_and_advisory():
    out = _report(
        {"name": "django", "version": "5.2.0", "vulns": [{"id": "PYSEC-2025-1", "fix_versions": ["5.2.1"]}]},
        {"name": "uvicorn", "version": "0.54.0", "vulns": []},
    )
    verdict, message = supply_chain.classify("pypi", 1, out, "")
    assert verdict == "vulnerable"
    assert "django 5.2.0: PYSEC-2025-1 (fixed in 5.2.1)" in message


def test_no_vulnerability_data_for_any_package_is_reported_not_failed():
    skip = "Dependency not found on PyPI and could not be audited: django (5.2.19)"
    verdict, message = supply_chain.classify("pypi", 0, _report({"name": "django", "skip_reason": skip}), "")
    assert verdict == "no_data" and "none of 1 packages could be audited" in message


def test_an_unreachable_service_is_reported_not_failed_but_a_crash_is_an_error():
    network = "requests.exceptions.ConnectionError: HTTPSConnectionPool(host='api.osv.dev', port=443)"
    assert supply_chain.classify("osv", 1, "", network)[0] == "no_data"
    assert supply_chain.classify("osv", 2, "", "ValueError: bad requirement")[0] == "error"


def test_audited_packages_without_findings_are_clean():
    out = _report({"name": "django", "version": "5.2.19", "vulns": []}, {"name": "x", "skip_reason": "not found"})
    verdict, message = supply_chain.classify("pypi", 0, out, "")
    assert verdict == "clean" and "1 packages audited" in message and "could not be audited: x" in message
