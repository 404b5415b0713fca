#!/usr/bin/env bash
# System programs the test suite drives: a real Prometheus server and promtool (the exporter's
# scrape test and lint, the alert rules' unit tests), headless Chromium (the report's browser
# test), and Slurm's daemons and client (a real cluster runs what `deploy slurm` renders).
# Installs them with apt-get when missing and this shell may (root); otherwise says what to
# install. Python packages come from pyproject.
set -euo pipefail
missing=()
# Debian's prometheus package ships promtool too (the exporter's lint and the alert rules' tests)
{ command -v prometheus && command -v promtool; } >/dev/null || missing+=(prometheus)
command -v chromium >/dev/null || missing+=(chromium)
# a two-node Slurm on localhost (scripts/slurm-localhost.sh starts it; no systemd needed)
command -v slurmd >/dev/null || missing+=(slurmctld slurmd slurm-client munge)
if [ ${#missing[@]} -eq 0 ]; then
  exit 0
fi
if [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null; then
  echo "+ apt-get install ${missing[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
else
  echo "the tests need: ${missing[*]} (Debian: sudo apt-get install ${missing[*]});" \
    "or set DSTRAIN_ALLOW_MISSING_TOOLS=1 to skip the tests that drive them" >&2
fi
