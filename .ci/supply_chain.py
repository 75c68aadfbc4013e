"""CI: bandit (medium and high severity) on the code, pip-audit on the pinned requirements.

    python .ci/supply_chain.py        # from the repository root, with .ci/requirements.txt installed

* bandit: any medium or high finding fails. Accepted findings carry ``# nosec Bxxx`` in the
  code, with the reason in the comment above; the configuration is ``[tool.bandit]`` in
  pyproject.toml. (bandit's "nosec encountered, but no failed test" warnings — its other
  plugins looking at a marked line — are left out of the log.)
* pip-audit: a known vulnerability in any pinned package (or its dependencies) fails.
  When no vulnerability data can be had — the PyPI per-version JSON API answers "not
  found" for every package, or OSV is unreachable, as on the machines this project is
  built on — it says so loudly ("NOT AUDITED") and does not fail: a network limit is not
  a finding. Both services are tried.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
NETWORK_SIGNS = ("ConnectionError", "NameResolutionError", "Max retries exceeded", "Temporary failure in name")


def bandit() -> bool:
    done = subprocess.run(
        [BIN / "bandit", "-c", "pyproject.toml", "-r", ".", "--severity-level", "medium", "-q"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    noise = "but no failed test on file"
    sys.stdout.write(done.stdout)
    sys.stderr.write("".join(line for line in done.stderr.splitlines(keepends=True) if noise not in line))
    print(f"bandit (medium+high): {'clean' if done.returncode == 0 else 'FINDINGS (see above)'}")
    return done.returncode == 0


def pip_audit(service: str) -> tuple[str, str]:
    """(verdict, message): verdict is "clean", "vulnerable", "no_data" or "error"."""
    done = subprocess.run(
        [
            BIN / "pip-audit",
            "-r",
            "requirements.txt",
            "--vulnerability-service",
            service,
            "--format",
            "json",
            "--progress-spinner",
            "off",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    return classify(service, done.returncode, done.stdout, done.stderr)


def classify(service: str, returncode: int, stdout: str, stderr: str) -> tuple[str, str]:
    """Read pip-audit's JSON report (or its failure) into a verdict and a message."""
    try:
        report = json.loads(stdout)
    except ValueError:
        if any(sign in stderr for sign in NETWORK_SIGNS):
            return "no_data", f"the {service} service is unreachable from this machine"
        return "error", f"pip-audit failed ({returncode}):\n{stderr[-3000:]}"
    deps = report.get("dependencies", [])
    vulnerable = [d for d in deps if d.get("vulns")]
    skipped = [d for d in deps if "skip_reason" in d]
    audited = len(deps) - len(skipped)
    if vulnerable:
        lines = [
            f"  {d['name']} {d['version']}: "
            + ", ".join(
                v["id"] + (f" (fixed in {', '.join(v['fix_versions'])})" if v.get("fix_versions") else "")
                for v in d["vulns"]
            )
            for d in vulnerable
        ]
        return "vulnerable", "known vulnerabilities:\n" + "\n".join(lines)
    if deps and audited == 0:
        sample = skipped[0]["skip_reason"]
        return "no_data", f"none of {len(deps)} packages could be audited (e.g. {sample!r})"
    if returncode != 0:
        return "error", f"pip-audit failed ({returncode}):\n{stderr[-3000:]}"
    note = f"; {len(skipped)} could not be audited: {', '.join(d['name'] for d in skipped)}" if skipped else ""
    return "clean", f"{audited} packages audited, no known vulnerabilities{note}"


def main() -> int:
    ok = bandit()
    verdicts = []
    for service in ("pypi", "osv"):
        verdict, message = pip_audit(service)
        print(f"pip-audit ({service}): {message}")
        verdicts.append(verdict)
        if verdict in ("clean", "vulnerable"):
            break  # one service with data is enough
    if "vulnerable" in verdicts or "error" in verdicts:
        ok = False
    elif "clean" not in verdicts:
        print(
            "pip-audit: NOT AUDITED — no vulnerability data is reachable from this machine "
            "(not a finding; the build does not fail for it). Run pip-audit where PyPI's JSON API or OSV answers."
        )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
